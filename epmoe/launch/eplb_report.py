"""The EPLB table of a run report."""

from __future__ import annotations


def render_eplb(eplb: dict, console) -> None:
    from epmoe.launch.render import table  # cells wrap to fit 80 columns

    rows = []
    for e in eplb["events"]:
        after = e.get("balancedness_after")
        rows.append([str(e["step"]), f"{e['balancedness_before']:.3f}",
                     f"{e['balancedness_predicted']:.3f}",
                     "-" if after is None else f"{after:.3f}", e["mode"], str(e["slots_moved"]),
                     f"{e['rebalance_ms']:.1f}"])
    cols = ("after step", "balancedness before", "predicted", "measured after", "mode",
            "slots moved", "rebalance ms")
    console.print(table(f"EPLB: {eplb['rebalances']} rebalance(s), {eplb['redundant_experts']} "
                        f"redundant experts, routing {eplb['routing']}",
                        [(c, "right") for c in cols], rows))
