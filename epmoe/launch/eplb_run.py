"""EPLB runs: steps with periodic rebalancing; balance before/after, the decision and its reason,
slots moved, traffic, and the stall each rebalance causes (sync or async migration)."""

from __future__ import annotations

import statistics
import time

from epmoe.launch.checks import flag
from epmoe.launch.inprocess import run_steps


def execute_eplb(d, run, args) -> tuple[list[dict], list[dict], dict]:
    """Run the steps; every `--rebalance-every` steps measure the window's balancedness and
    rebalance; while an async migration stages, ask after each step whether it switched.
    The driver's wall time of every step (the rebalance calls excluded) gives the stall."""
    events: list[dict] = []
    every = flag(args, "rebalance_every")
    wall: list[float] = []
    mark = [None]  # end of the previous step's hooks

    def on_step(s: int) -> None:
        now = time.perf_counter()
        if mark[0] is not None:
            wall.append((now - mark[0]) * 1e3)
        if events and events[-1].get("pending"):
            st = d.call_all(f"status after step {s}", "eplb_status")[0]
            if not st["pending"]:
                events[-1].update(pending=False, switch=st["last_switch"])
        if not (s + 1) % every and s + 1 < run.steps:
            if events:  # what the previous placement achieved on the steps since it was applied
                events[-1]["balancedness_after"] = d.call_all(f"measure after step {s}",
                                                              "window_balancedness")[0]
            t0 = time.perf_counter()
            res = d.call_all(f"rebalance after step {s}", "rebalance", every)
            ev = dict(res[0], step=s + 1, call_ms=(time.perf_counter() - t0) * 1e3,
                      rebalance_ms=max(r["rebalance_ms"] for r in res))
            ev["pending"] = ev["migration"] == "async" and ev["decision"] == "rebalance"
            events.append(ev)
        mark[0] = time.perf_counter()

    reports, where = run_steps(d, on_step)
    if events:
        events[-1]["balancedness_after"] = d.call_all("measure final window",
                                                      "window_balancedness")[0]
    status = d.call_all("eplb status", "eplb_status")[0]
    base = _stalls(events, wall)
    srcs = reports if run.own_tokens else reports[:1]
    slot_load = sum(r["load_LS"] for r in srcs)  # [L, slots], all steps, all ranks
    done = [e for e in events if e["decision"] == "rebalance"]
    eplb = dict(
        redundant_experts=run.redundant_experts, rebalance_every=every,
        window_steps=run.eplb_window, routing=run.routing, migration=run.eplb_migration,
        placement_mode=status["placement_mode"], mode_reason=status["mode_reason"],
        topology=status["topology"], rebalances=len(done), events=events,
        balancedness_before=events[0]["balancedness_before"] if events else None,
        balancedness_after=events[-1].get("balancedness_after") if events else None,
        slots_moved=sum(e["slots_moved"] for e in events),
        rebalance_ms_median=_median([e["rebalance_ms"] for e in done]),
        stall_ms_median=_median([e["stall_ms"] for e in done if "stall_ms" in e]),
        baseline_step_ms=base, step_wall_ms=[round(x, 3) for x in wall],
        slot_load_LS=slot_load.tolist(), final_phy2log_LR=reports[0]["phy2log"],
        note="balancedness = mean/max (token,k) pairs per rank, per layer, averaged over "
             "layers; 'before' measured over the window before the first rebalance, 'after' "
             "over the steps after the last one; stall_ms = the rebalance call plus the extra "
             "wall time (over baseline_step_ms, the median of unaffected steps) of the steps "
             "until the new placement is in use; step_wall_ms: the driver's wall time per step "
             "from step 1 on, rebalance calls excluded; slot_load_LS: (token, k) pairs per layer "
             "x physical slot over the whole run; final_phy2log_LR: each slot's logical expert "
             "at the end")
    return reports, where, dict(eplb=eplb)


def _stalls(events: list[dict], wall: list[float]) -> float | None:
    """Fill each applied event's stall_ms and worst_step_ms; returns the baseline step wall.

    wall[i] is step i + 1. A rebalance after step s affects steps s+1 .. its switch (sync:
    s+1 only); the worst step is the longest wait between two step completions there (the
    first one includes the rebalance call)."""
    affected: dict[int, list[int]] = {}
    for i, e in enumerate(events):
        if e["decision"] != "rebalance":
            continue
        s = e["step"] - 1
        last = e["switch"]["step"] if e.get("switch") else s + 1
        if e["migration"] == "async" and not e.get("switch"):
            last = len(wall)  # never switched before the end
        affected[i] = [t for t in range(s + 1, max(last, s + 1) + 1) if 1 <= t <= len(wall)]
    busy = {t for ts in affected.values() for t in ts}
    quiet = [wall[t - 1] for t in range(2, len(wall) + 1) if t not in busy]
    base = _median(quiet)
    if base is None:
        return None
    for i, ts in affected.items():
        e = events[i]
        extra = sum(wall[t - 1] - base for t in ts)
        e["stall_ms"] = e["call_ms"] + extra
        gaps = [wall[t - 1] + (e["call_ms"] if t == ts[0] else 0.0) for t in ts]
        e["worst_step_ms"] = max(gaps) if gaps else e["call_ms"]
    return base


def _median(xs):
    return statistics.median(xs) if xs else None
