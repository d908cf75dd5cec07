"""The EPLB table of a run report (fits 80 columns; the reasons follow as lines)."""

from __future__ import annotations


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def render_eplb(eplb: dict, console) -> None:
    from rich.table import Table

    topo = eplb["topology"]
    console.print(f"EPLB placement mode: {eplb['placement_mode']} ({eplb['mode_reason']}); "
                  f"{topo['num_nodes']} node(s); migration {eplb['migration']}")
    t = Table(title=f"EPLB: {eplb['rebalances']} rebalance(s), {eplb['redundant_experts']} "
                    f"redundant experts, routing {eplb['routing']}")
    for col in ("step", "bal", "pred", "after", "kind", "decision", "moved", "stall ms"):
        t.add_column(col, justify="right")
    for e in eplb["events"]:
        t.add_row(str(e["step"]), _f(e.get("balancedness_before")),
                  _f(e.get("balancedness_predicted")), _f(e.get("balancedness_after")),
                  e.get("kind", "-"), e["decision"], str(e["slots_moved"]),
                  _f(e.get("stall_ms"), ".1f"))
    console.print(t)
    for e in eplb["events"]:
        console.print(f"step {e['step']}: {e['decision']}: {e['reason']}")
        if e.get("traffic_after"):
            b, a = e["traffic_before"], e["traffic_after"]
            console.print(f"  nodes/token {b['nodes_per_token']:.2f} -> "
                          f"{a['nodes_per_token']:.2f}, ranks/token {b['ranks_per_token']:.2f}"
                          f" -> {a['ranks_per_token']:.2f}, inter-node "
                          f"{b['internode_bytes_per_step'] / 1e6:.2f} -> "
                          f"{a['internode_bytes_per_step'] / 1e6:.2f} MB/step")
        if e.get("tradeoff"):
            console.print(f"  [yellow]trade-off[/yellow]: {e['tradeoff']}")
        if e.get("switch"):
            sw = e["switch"]
            console.print(f"  switched at step {sw['step']} after {sw['steps_waited']} step(s) "
                          f"of background staging ({sw['stage_ms']:.0f} ms), switch "
                          f"{sw['switch_ms']:.1f} ms")
    if eplb.get("baseline_step_ms") is not None:
        console.print(f"stall: median {_f(eplb['stall_ms_median'], '.1f')} ms per rebalance "
                      f"(baseline step {eplb['baseline_step_ms']:.1f} ms)")
