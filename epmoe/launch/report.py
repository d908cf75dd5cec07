"""Turn the ranks' reports into one summary (JSON-ready): oracle check, timing, load.
epmoe.launch.render prints it; epmoe.launch.plots draws it."""

from __future__ import annotations

import datetime
import statistics

import torch

from epmoe import __version__
from epmoe.reference import TOLERANCE, max_rel_err, reference_moe
from epmoe.runtime import RunConfig
from epmoe.weights import synthetic_layer

# Beyond this many oracle FLOPs the check covers a prefix of each rank's tokens.
MAX_CHECK_TOKENS_PER_RANK = 64


class LazyOracleLayer:
    """The float64 oracle's weights of one layer, built per expert on first use (a full-size
    model never materializes all of its experts)."""

    def __init__(self, run: RunConfig, layer: int):
        self.run, self.layer = run, layer
        lw = synthetic_layer(run.cfg, run.quant, layer, run.seed, [], with_shared=True)
        from epmoe.weights import layer_to_oracle

        self.gate, self.bias, _, _, self.shared = layer_to_oracle(lw)
        self._cache: dict[int, tuple] = {}
        outer = self

        class _Idx:
            def __init__(self, j):
                self.j = j

            def __getitem__(self, e):
                return outer._expert(int(e))[self.j]

        self.w13, self.w2 = _Idx(0), _Idx(1)

    def _expert(self, e: int):
        if e not in self._cache:
            from epmoe.quant import dequantize_weight

            lw = synthetic_layer(self.run.cfg, self.run.quant, self.layer, self.run.seed, [e],
                                 with_shared=False)
            self._cache[e] = (dequantize_weight(lw.experts.w13)[0].double(),
                              dequantize_weight(lw.experts.w2)[0].double())
        return self._cache[e]

    def as_tuple(self):
        return self.gate, self.bias, self.w13, self.w2, self.shared


def check_correctness(run: RunConfig, reports: list[dict]) -> dict:
    """Compare every layer's output (last step) with the float64 oracle on the gathered tokens."""
    if not run.check or not reports[0]["last"]:
        return dict(checked=False, passed=None, max_rel_err=None,
                    tolerance=TOLERANCE[run.quant.recipe])
    srcs = reports if run.form == "ep_dp" else reports[:1]
    per_layer = []
    n_check = min(run.tokens, MAX_CHECK_TOKENS_PER_RANK)
    for l in range(run.num_layers):
        recs = [r["last"][l] for r in srcs]
        x = torch.cat([rec["x"][:n_check] for rec in recs])
        out = torch.cat([rec["out"][:n_check] for rec in recs])
        ids = w = None
        if recs[0]["ids"] is not None:
            ids = torch.cat([rec["ids"][:n_check] for rec in recs])
            w = torch.cat([rec["w"][:n_check] for rec in recs])
        oracle = LazyOracleLayer(run, l).as_tuple()
        ref = reference_moe(x, oracle, run.cfg, run.quant, ids, w)
        per_layer.append(max_rel_err(out, ref))
        if run.form != "ep_dp":  # replicated tokens: every rank must hold the same output
            for r in reports[1:]:
                other = r["last"][l]["out"][:n_check]
                per_layer[-1] = max(per_layer[-1], max_rel_err(other, ref))
    tol = TOLERANCE[run.quant.recipe]
    worst = max(per_layer)
    return dict(checked=True, passed=bool(worst <= tol), max_rel_err=worst, tolerance=tol,
                per_layer=per_layer, tokens_checked=n_check * len(srcs),
                metric="max|out-ref| / max|ref| per layer, float64 oracle")


def _median(xs):
    return statistics.median(xs) if xs else None


STAGE_ORDER = ["router", "dispatch", "dispatch.quantize", "experts", "experts.permute",
               "experts.gemm1", "experts.act_quant", "experts.gemm2", "experts.gather", "combine",
               "shared", "all_reduce"]


def _stage_ms_per_step(names: list[str], reports: list[dict], steps: int) -> dict[str, float]:
    """Per stage: the median ms of one call times calls per step = ms per step in the stage."""
    out = {}
    for name in names:
        vals = [v for r in reports for v in r["stages_ms"].get(name, [])]
        if vals:
            out[name] = _median(vals) * len(vals) / (len(reports) * steps)
    return out


def summarize(run: RunConfig, reports: list[dict], where: list[dict],
              extra: dict | None = None) -> dict:
    world = run.world
    steps = len(reports[0]["step_ms"])
    step_ms = [max(r["step_ms"][s] for r in reports) for s in range(steps)]
    timed = step_ms[1:] if steps > 1 else step_ms  # step 0 warms up
    names = {k for r in reports for k in r["stages_ms"]}
    names = [n for n in STAGE_ORDER if n in names] + sorted(names - set(STAGE_ORDER))
    stages = _stage_ms_per_step(names, reports, steps)
    stages_per_rank = [_stage_ms_per_step(names, [r], steps) for r in reports]
    tokens_step = run.tokens * (world if run.form == "ep_dp" else 1)
    load_src = reports if run.form == "ep_dp" else reports[:1]
    load_LS = sum(r["load_LS"] for r in load_src)  # [L, slots]
    cfg = run.cfg
    per_slot = load_LS.sum(0)
    per_rank = [int(x) for x in per_slot.view(world, -1).sum(1)] if run.form != "tp" else \
        [int(per_slot.sum())] * world
    load_LE = sum(r["load_LE"] for r in load_src)
    per_expert = load_LE.sum(0)
    bal = (sum(per_rank) / len(per_rank)) / max(max(per_rank), 1)
    nodes = sorted({w["node_id"] for w in where})
    summary = dict(
        epmoe_version=__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        config=dict(model=run.model, recipe=run.quant.recipe, scale_fmt=run.quant.scale_fmt,
                    tokens_per_rank=run.tokens if run.form == "ep_dp" else None,
                    tokens=tokens_step, layers=run.num_layers, steps=run.steps, seed=run.seed,
                    routing=run.routing, hidden=cfg.hidden, moe_intermediate=cfg.moe_intermediate,
                    num_experts=cfg.num_experts, top_k=cfg.top_k),
        world=dict(form=run.form, ep=world if run.form != "tp" else 1,
                   tp=world if run.form == "tp" else 1, dp=world if run.form == "ep_dp" else 1,
                   backend=reports[0]["backend"], backend_reason=reports[0]["backend_reason"],
                   experts=reports[0]["experts_reason"], device=reports[0]["device"],
                   nodes=len(nodes),
                   ranks=[dict(rank=w["rank"], host=w["host"], node=nodes.index(w["node_id"]),
                               device=w["device"]) for w in where]),
        correctness=check_correctness(run, reports),
        timing=dict(step_ms_median=_median(timed), step_ms=step_ms, stages_ms=stages,
                    stages_ms_per_rank=stages_per_rank,
                    step_ms_median_per_rank=[_median(r["step_ms"][1:] or r["step_ms"])
                                             for r in reports],
                    tokens_per_s=tokens_step / (_median(timed) / 1e3) if timed else None,
                    note="step = all layers, max over ranks; median excludes step 0 (warm-up); "
                         "stages_ms: ms per step in each stage (median per call x calls per "
                         "step, over all ranks; stages_ms_per_rank: the same per rank)"),
        load=dict(tokens_per_expert=per_expert.tolist(), tokens_per_rank=per_rank,
                  tokens_per_layer_expert=load_LE.tolist(), balancedness=bal,
                  unit="(token, k) pairs routed, summed over layers and steps (per layer for "
                       "tokens_per_layer_expert); balancedness = mean/max pairs per rank"),
    )
    if extra:
        summary.update(extra)
    return summary
