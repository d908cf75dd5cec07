"""Turn the ranks' reports into one summary (JSON-ready): oracle check, timing, load.
epmoe.launch.render prints it; epmoe.launch.plots draws it."""

from __future__ import annotations

import datetime
import statistics

from epmoe import __version__
from epmoe.comm import SYMM
from epmoe.launch.oracle import Solver, check_correctness, layer_sources
from epmoe.plan.run import RunConfig


def _overlap(stages: dict, step_ms: float | None) -> float | None:
    """(sum of the top-level stage times - step time) / that sum: the share of stage time
    hidden under other stages (shared experts on a side stream, micro-batches)."""
    from epmoe.overlap import overlap_fraction

    if not step_ms:
        return None
    return overlap_fraction({k: v for k, v in stages.items() if "." not in k}, step_ms)


def _median(xs):
    return statistics.median(xs) if xs else None


STAGE_ORDER = ["relayout", "norm", "router", "dispatch", "dispatch.quantize", "experts",
               "experts.permute", "experts.gemm1", "experts.act_quant", "experts.gemm2",
               "experts.gather", "combine", "shared", "all_reduce", "residual"]


def run_host_op_us(reports: list[dict]) -> float | None:
    """The slowest rank's host speed (`epmoe.timing.host_op_us`: us per tiny eager op), None
    where no rank measured it."""
    xs = [r["host_op_us"] for r in reports if r.get("host_op_us") and r["host_op_us"] > 0]
    return max(xs) if xs else None


def _stage_ms_per_step(names: list[str], reports: list[dict]) -> dict[str, float]:
    """Per stage, ms per step: the median over steps (and ranks) of a step's calls summed, so
    layers that differ (a step's first layer starts on an idle GPU, a hash layer's router)
    each count; a step without a call counts 0. Calls are grouped by the (step, layer) tag
    the runtime gave each (`stages_at`): their number may vary by step (the torch experts
    time their GEMMs once per expert that got rows)."""
    out = {}
    tagged = [_steps(r) for r in reports]
    for name in names:
        if not any(r["stages_ms"].get(name) for r in reports):
            continue
        sums = []
        for r, steps_r in zip(reports, tagged):
            per_step: dict = {}
            for (st, _), v in _by_step_layer(r, name).items():
                per_step[st] = per_step.get(st, 0.0) + v
            sums += [per_step.get(st, 0.0) for st in steps_r]
        out[name] = _median(sums)
    return out


def _steps(report: dict) -> list:
    """The steps a rank's stage calls were tagged with (the timed ones: steps 1..)."""
    return sorted({s for at in report["stages_at"].values() for s, _ in at if s is not None})


def _by_step_layer(report: dict, name: str) -> dict[tuple, float]:
    """{(step, layer): ms of the stage's calls there, summed} for one rank."""
    by: dict[tuple, float] = {}
    for v, at in zip(report["stages_ms"].get(name, []), report["stages_at"].get(name, [])):
        key = tuple(at)
        by[key] = by.get(key, 0.0) + v
    return by


def _stage_ms_per_layer(names: list[str], reports: list[dict],
                        layers: int) -> dict[str, list[float]]:
    """Per stage, ms per step of each layer: the median over steps and ranks of that layer's
    calls in a step summed (0 where it made none), by the runtime's (step, layer) tags."""
    out = {}
    tagged = [_steps(r) for r in reports]
    for name in names:
        by = [_by_step_layer(r, name) for r in reports]
        if not any(l is not None for b in by for _, l in b):  # called outside the layers
            continue
        per_layer = [[b.get((st, l), 0.0) for b, steps_r in zip(by, tagged) for st in steps_r]
                     for l in range(layers)]
        if all(per_layer):
            out[name] = [_median(v) for v in per_layer]
    return out


def summarize(run: RunConfig, reports: list[dict], where: list[dict],
              extra: dict | None = None, solver: Solver | None = None,
              progress=None) -> dict:
    """The summary of a launch; solver / progress: where the float64 check of each layer runs
    and who hears of it (`oracle.check_correctness`)."""
    world = run.world
    steps = len(reports[0]["step_ms"])
    step_ms = [max(r["step_ms"][s] for r in reports) for s in range(steps)]
    timed = step_ms[1:] if steps > 1 else step_ms  # step 0 warms up
    names = {k for r in reports for k in r["stages_ms"]}
    names = [n for n in STAGE_ORDER if n in names] + sorted(names - set(STAGE_ORDER))
    stages = _stage_ms_per_step(names, reports)  # ranks time steps 1.. only
    stages_per_rank = [_stage_ms_per_step(names, [r]) for r in reports]
    per_layer = _stage_ms_per_layer(names, reports, run.num_layers)
    tokens_step = run.global_tokens
    cfg = run.cfg
    per_rank = [0] * world
    load_LE = []  # (token, k) pairs per layer x logical expert
    for l in range(run.num_layers):
        srcs = layer_sources(run, reports, l)
        per_slot = sum(r["load_LS"][l] for r in srcs)  # [slots]
        load_LE.append(sum(r["load_LE"][l] for r in srcs))
        if run.layer_spec(l).form == "tp":  # every rank runs every pair (a slice of I)
            per_rank = [p + int(per_slot.sum()) for p in per_rank]
        else:
            per_rank = [p + int(x) for p, x in zip(per_rank, per_slot.view(world, -1).sum(1))]
    per_expert = sum(load_LE)
    bal = (sum(per_rank) / len(per_rank)) / max(max(per_rank), 1)
    nodes = sorted({w["node_id"] for w in where})
    summary = dict(
        epmoe_version=__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        config=dict(model=run.model, weights=run.weights or "synthetic",
                    recipe=run.quant.recipe, scale_fmt=run.quant.scale_fmt,
                    tokens_per_rank=run.tokens if run.own_tokens else None,
                    tokens=tokens_step, layers=run.num_layers, steps=run.steps, seed=run.seed,
                    routing=run.routing, hidden=cfg.hidden, moe_intermediate=cfg.moe_intermediate,
                    num_experts=cfg.num_experts, top_k=cfg.top_k),
        world=dict(form="mixed" if run.mixed else run.form,
                   ep=world if run.form != "tp" or run.mixed else 1,
                   tp=world if "tp" in run.forms else 1, dp=world if run.own_tokens else 1,
                   layers=[dict(form=f, backend=b[0], reason=b[1]) for f, b in
                           zip(run.forms, reports[0].get("layer_backends", []))],
                   backend=reports[0]["backend"], backend_reason=reports[0]["backend_reason"],
                   experts=reports[0]["experts_reason"], device=reports[0]["device"],
                   nodes=len(nodes), ranks_per_gpu=run.ranks_per_gpu,
                   comm_options=dict(run.comm_options),  # symm layers' SymmOptions knobs
                   comm_options_used=bool(run.comm_options) and any(  # auto may pick no symm
                       b[0] in SYMM for b in reports[0].get("layer_backends", [])),
                   ranks=[dict(rank=w["rank"], host=w["host"], node=nodes.index(w["node_id"]),
                               device=w["device"]) for w in where]),
        correctness=check_correctness(run, reports, solver, progress),
        timing=dict(step_ms_median=_median(timed), step_ms=step_ms, stages_ms=stages,
                    stages_ms_per_rank=stages_per_rank, stages_ms_per_layer=per_layer,
                    step_ms_median_per_rank=[_median(r["step_ms"][1:] or r["step_ms"])
                                             for r in reports],
                    tokens_per_s=tokens_step / (_median(timed) / 1e3) if timed else None,
                    overlap=_overlap(stages, _median(timed)),
                    mode=reports[0].get("timing", "launched"),
                    cuda_graph=run.cuda_graph,  # steps 1.. replayed from one graph per rank
                    host_issue_ms_median=_median(  # steps 1.., the slowest rank's each
                        [max(r["host_ms"][s] for r in reports) for s in range(1, steps)]
                        if all(len(r.get("host_ms", ())) == steps for r in reports) else []),
                    host_op_us=run_host_op_us(reports),
                    note="step = all layers, max over ranks; median excludes step 0 (warm-up); "
                         "stages_ms: ms per step in each stage (median over steps 1.. and "
                         "ranks of the stage's calls in one step, summed); stages_ms_per_rank: "
                         "the same per rank; stages_ms_per_layer: the same per layer"),
        load=dict(tokens_per_expert=per_expert.tolist(), tokens_per_rank=per_rank,
                  tokens_per_layer_expert=[x.tolist() for x in load_LE], balancedness=bal,
                  unit="(token, k) pairs routed, summed over layers and steps (per layer for "
                       "tokens_per_layer_expert); balancedness = mean/max pairs per rank"),
    )
    if extra:
        summary.update(extra)
    return summary
