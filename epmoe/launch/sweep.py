"""`python -m epmoe.launch --plan sweep`: launch every feasible uniform stack, compare.

Every (form, comm backend, experts kernel) the planner would consider for the run (feasible
at every layer here, fitting in memory, within --backend / --experts) runs uniformly across
the stack: one launch each (each on its own private Ray cluster, or on the --address one),
with the run's --steps and --tokens (per rank), least predicted over the stack first (each
layer at the loads the plan assumes for it). Each row: the cost model's predicted step, the
measured step (median, warm-up step excluded), their ratio and the oracle check. Then the
planner's own pick (`--plan auto`, which may mix forms; launched too unless it is one of the
rows) against the fastest measured row: within 5% or not. --sweep-budget-s bounds the sweep
(no new launch after it; the rest are listed as skipped). Output: an 80-column table, and
JSON (--out / --json) under "sweep".

Exit codes: 0 every launch passed (or was unchecked), 1 a correctness check failed, 2 bad flags,
3 no launch succeeded.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from epmoe.launch.planning import PlannedLaunch, Planning, context, make_plan, planned_run, \
    planner_scope
from epmoe.outputs import json_text
from epmoe.plan import Workload
from epmoe.plan.planner import candidates, distinct, rank_layer, stack_order
from epmoe.plan.run import RunConfig

NEAR_BEST = 0.05  # the planner's pick counts as right within 5% of the best measured


def launch_summary(run: RunConfig, planning: Planning, address=None, use_gpu=None) -> dict:
    """One launch through the driver (its own private Ray cluster, or the --address one) ->
    the summary with predictions (as the CLI prints)."""
    from epmoe.launch.console import Phases
    from epmoe.launch.driver import driver_for
    from epmoe.launch.report import summarize

    pl = PlannedLaunch(run, planning)
    with driver_for(run, address, phases=Phases(quiet=True), use_gpu=use_gpu,
                    on_where=pl.at_where) as d:
        reports, where = d.execute()
        run = d.run
        summary = summarize(run, reports, where, solver=d.solve_checks)
    pl.attach(summary, run, reports)
    return summary


def sweep_candidates(base: RunConfig, ctx: Planning, tokens: int, restrict: dict):
    """-> (the candidates feasible at every layer, least predicted over the whole stack first,
    [(label, why not)]): each distinct layer routing (the run's planned loads differ per
    layer) ranked once; a candidate rejected at one layer is out, with that layer's reason."""
    cands = candidates(base.world, restrict["forms"], restrict["backends"], restrict["experts"])
    specs, index = distinct([ctx.routing.layer(l) for l in range(base.num_layers)])
    ranked = [rank_layer(Workload(base.cfg, base.quant, tokens, spec), ctx.topology,
                         ctx.profile, cands, base.num_layers, available=restrict["available"])
              for spec in specs]
    order = stack_order(ranked, index)
    by_label = {p.candidate.label: p.candidate for p in ranked[0].preds}
    why_not = {}  # label -> [(first layer of that routing, why)]
    for i, r in enumerate(ranked):
        for label, why in r.rejected:
            why_not.setdefault(label, []).append((index.index(i), why))
    rejected = [(c, why if len(at) == len(ranked) else f"{why} (at layer {l})")
                for c, at in why_not.items() for l, why in at[:1]]
    return [by_label[c] for c in order], rejected


def _row(label: str, s: dict | None, error: str | None = None) -> dict:
    if s is None:
        return dict(candidate=label, status="skipped" if error is None else "failed",
                    error=error, predicted_ms=None, measured_ms=None, ratio=None, passed=None)
    t, c = s["timing"], s["correctness"]
    host = (t.get("prediction") or {}).get("host")  # the profile scaled to the run's host
    return dict(candidate=label, status="ok", error=None, predicted_ms=t["predicted_step_ms"],
                measured_ms=t["step_ms_median"], ratio=t["step_ratio"],
                passed=c["passed"] if c.get("checked") else None,
                stages_ms=t["stages_ms"], predicted_stages_ms=t["predicted_ms"],
                timing=t.get("mode", "launched"), host_issue_ms=t.get("host_issue_ms_median"),
                predicted_issue_ms=t.get("predicted_issue_ms"),
                host_factor=host["factor"] if host else None)


def run_sweep(a: argparse.Namespace, build_run, experts=None) -> dict:
    """The sweep as data (see the module docstring); ValueError on bad flags. experts: keep
    to these kernels (a benchmark's choice; the CLI's --experts takes one)."""
    if a.tp > 1 or not a.dp:
        raise ValueError("--plan sweep tries every form itself: give the rank count with "
                         "--ep N (no --tp / --no-dp)")
    world, tokens = a.ep, a.tokens
    base = build_run(argparse.Namespace(**{**vars(a), "ep": 1, "backend": "auto",
                                           "plan": None})).replace(world=world)
    ctx = context(a, base, "sweep", tokens)
    restrict = planner_scope(a, base, "auto")
    if experts is not None:
        keep = tuple(e for e in restrict["experts"] or experts if e in experts)
        if not keep:
            raise ValueError(f"none of the experts kernels {experts} can run here")
        restrict["experts"] = keep
    cands, rejected = sweep_candidates(base, ctx, tokens, restrict)
    if not cands:
        raise ValueError(f"no feasible candidate to sweep on {ctx.topology.describe()}: "
                         + "; ".join(f"{c}: {w}" for c, w in rejected[:3]))
    use_gpu = {"auto": None, "cpu": False, "cuda": True}[a.device]
    from epmoe.launch.cluster import parse_address

    address = parse_address(a.address) if a.address else None
    t0, rows, measured = time.monotonic(), [], {}
    # every launch starts (and stops) its own private Ray cluster, or joins --address
    for c in cands:
        if time.monotonic() - t0 > a.sweep_budget_s:
            rows.append(_row(c.label, None))
            continue
        one = dict(restrict, forms=(c.form,), backends=(c.backend, "local"),
                   experts=(c.experts,))
        plan = make_plan(base, ctx.topology, ctx.profile, tokens, one, ctx.routing)
        rows.append(_launch(c.label, planned_run(base, plan, tokens),
                            replace(ctx, plan=plan, restrict=one), address, use_gpu))
        if rows[-1]["status"] == "ok":
            measured[c.label] = rows[-1]
    auto = make_plan(base, ctx.topology, ctx.profile, tokens, restrict, ctx.routing)
    labels = [e.choice(tokens).label for e in auto.layers]
    uniform = labels[0] if len(set(labels)) == 1 else None
    if uniform in measured:
        auto_row, launched = measured[uniform], False
    else:
        auto_row = _launch("auto", planned_run(base, auto, tokens),
                           replace(ctx, mode="auto", plan=auto, restrict=restrict),
                           address, use_gpu)
        launched = True
    ok = [r for r in rows if r["status"] == "ok"]
    best = min(ok, key=lambda r: r["measured_ms"]) if ok else None
    gap = auto_row["measured_ms"] / best["measured_ms"] - 1 \
        if best and auto_row["status"] == "ok" else None
    return dict(
        model=base.model, recipe=base.quant.recipe, ranks=world, tokens_per_rank=tokens,
        layers=base.num_layers, steps=base.steps, topology=ctx.topology.describe(),
        profile=ctx.profile.name, budget_s=a.sweep_budget_s,
        seconds=time.monotonic() - t0, rows=rows, rejected=[list(r) for r in rejected],
        fastest=best and best["candidate"], fastest_ms=best and best["measured_ms"],
        auto=dict(stack=labels, label=uniform or "mixed", launched=launched,
                  predicted_ms=auto.step_us(tokens) / 1e3,
                  planned_routing=ctx.routing.label,
                  measured_ms=auto_row["measured_ms"], passed=auto_row["passed"],
                  vs_best=gap, within_5pct=None if gap is None else gap <= NEAR_BEST),
        note="predicted / measured: the step (all layers; measured median excludes the "
             "warm-up step); vs_best: auto's measured step / the fastest row's - 1; "
             "auto.predicted_ms: the planner's, at planned_routing and the profile's host; a "
             "row's predicted_ms: its launch report's, at the run's measured routing and host")


def _launch(label, run, planning, address, use_gpu) -> dict:
    from epmoe.launch.driver import LaunchError

    try:
        return _row(label, launch_summary(run, planning, address, use_gpu))
    except (LaunchError, ValueError) as exc:
        return _row(label, None, str(exc).splitlines()[0])


def render(s: dict) -> str:
    """80 columns: one row per candidate, then the fastest and the planner's pick."""
    lines = [f"sweep: {s['model']} {s['recipe']}, {s['ranks']} rank(s) on {s['topology']}"[:80],
             f"{s['tokens_per_rank']} tokens/rank, {s['layers']} layer(s), {s['steps']} steps, "
             f"profile {s['profile']}, {s['seconds']:.0f} s"[:80],
             f"{'candidate':<28}{'predicted ms':>13}{'measured ms':>13}{'pred/meas':>11}"
             f"  {'oracle':<8}", "-" * 80]
    for r in s["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['candidate']:<28}{r['status']}: {r['error'] or 'budget'}"[:80])
            continue
        check = {True: "pass", False: "FAIL", None: "-"}[r["passed"]]
        lines.append(f"{r['candidate']:<28}{_ms(r['predicted_ms']):>13}"
                     f"{_ms(r['measured_ms']):>13}{_x(r['ratio']):>11}  {check:<8}")
    lines.append("-" * 80)
    if s["fastest"]:
        lines.append(f"fastest measured: {s['fastest']} {s['fastest_ms']:.3f} ms")
    au = s["auto"]
    what = au["label"] if au["label"] != "mixed" else "mixed " + ",".join(
        dict.fromkeys(au["stack"]))
    verdict = "not measured" if au["vs_best"] is None else (
        f"{'within' if au['within_5pct'] else 'NOT within'} 5% of the best "
        f"({100 * au['vs_best']:+.1f}%)")
    lines.append(f"planner (auto): {what}"[:80])
    lines.append(f"  predicted {au['predicted_ms']:.3f} ms, measured "
                 f"{_ms(au['measured_ms'])} ms: {verdict}"[:80])
    if au.get("planned_routing"):  # a row's prediction follows its run (launch report)
        lines.append(f"  (planned at {au['planned_routing']} routing and the profile's host; "
                     f"a row: its run's)"[:80])
    return "\n".join(line.rstrip() for line in lines)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(a: argparse.Namespace) -> int:
    from epmoe.launch.cli import build_run

    try:
        s = run_sweep(a, build_run)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json_text(dict(sweep=s), indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text if a.json else render(s))
    rows = [r for r in s["rows"] if r["status"] == "ok"]
    if not rows:
        return 3
    return 1 if any(r["passed"] is False for r in rows) or s["auto"]["passed"] is False else 0
