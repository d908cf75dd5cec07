"""EPLB runs: steps with periodic rebalancing; before/after balance, slots moved, time."""

from __future__ import annotations

import statistics

from epmoe.launch.driver import run_steps


def execute_eplb(d, run, args) -> tuple[list[dict], list[dict], dict]:
    """Run the steps; every `--rebalance-every` steps measure the window's balancedness,
    rebalance, and later measure the balancedness the new placement achieves."""
    events: list[dict] = []
    every = args.rebalance_every

    def on_step(s: int) -> None:
        if (s + 1) % every or s + 1 >= run.steps:
            return
        if events:  # what the previous placement achieved on the steps since it was applied
            events[-1]["balancedness_after"] = d.call_all(f"measure after step {s}",
                                                          "window_balancedness")[0]
        res = d.call_all(f"rebalance after step {s}", "rebalance")
        events.append(dict(step=s + 1, balancedness_before=res[0]["balancedness_before"],
                           balancedness_predicted=res[0]["balancedness_predicted"],
                           slots_moved=res[0]["slots_moved"], mode=res[0]["mode"],
                           rebalance_ms=max(r["rebalance_ms"] for r in res)))

    reports, where = run_steps(d, on_step)
    if events:
        events[-1]["balancedness_after"] = d.call_all("measure final window",
                                                      "window_balancedness")[0]
    srcs = reports if run.own_tokens else reports[:1]
    slot_load = sum(r["load_LS"] for r in srcs)  # [L, slots], all steps, all ranks
    first = events[0]["balancedness_before"] if events else None
    last_after = events[-1].get("balancedness_after") if events else None
    eplb = dict(
        redundant_experts=run.redundant_experts, rebalance_every=every,
        window_steps=run.eplb_window, routing=run.routing,
        rebalances=len(events), events=events,
        balancedness_before=first, balancedness_after=last_after,
        slots_moved=sum(e["slots_moved"] for e in events),
        rebalance_ms_median=statistics.median([e["rebalance_ms"] for e in events])
        if events else None,
        slot_load_LS=slot_load.tolist(), final_phy2log_LR=reports[0]["phy2log"],
        note="balancedness = mean/max (token,k) pairs per rank, per layer, averaged over "
             "layers; 'before' measured over the window before the first rebalance, 'after' "
             "over the steps after the last one; slot_load_LS: (token, k) pairs per layer x "
             "physical slot over the whole run; final_phy2log_LR: each slot's logical expert "
             "at the end")
    return reports, where, dict(eplb=eplb)
