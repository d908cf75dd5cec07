"""The EPLB table of a run report."""

from __future__ import annotations


def render_eplb(eplb: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"EPLB: {eplb['rebalances']} rebalance(s), {eplb['redundant_experts']} "
                    f"redundant experts, routing {eplb['routing']}")
    for col in ("after step", "balancedness before", "predicted", "measured after",
                "mode", "slots moved", "rebalance ms"):
        t.add_column(col, justify="right")
    for e in eplb["events"]:
        after = e.get("balancedness_after")
        t.add_row(str(e["step"]), f"{e['balancedness_before']:.3f}",
                  f"{e['balancedness_predicted']:.3f}",
                  "-" if after is None else f"{after:.3f}", e["mode"], str(e["slots_moved"]),
                  f"{e['rebalance_ms']:.1f}")
    console.print(t)
