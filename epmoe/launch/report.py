"""Turn the ranks' reports into one summary (JSON-ready): oracle check, timing, load.
epmoe.launch.render prints it; epmoe.launch.plots draws it."""

from __future__ import annotations

import datetime
import statistics

import torch

from epmoe import __version__
from epmoe.checkpoint import SafetensorsCheckpoint
from epmoe.comm import SYMM
from epmoe.plan.run import RunConfig
from epmoe.reference import (Oracle, max_rel_err, reference_hash_route, reference_moe,
                             reference_route, tolerance)
from epmoe.weights import layer_weights

# Beyond this many oracle FLOPs the check covers a prefix of each rank's tokens.
MAX_CHECK_TOKENS_PER_RANK = 64


class LazyOracleLayer:
    """The float64 oracle's weights of one layer, built per expert on use and only the last
    one kept (reference_moe goes expert by expert: a full-size model's check holds one
    expert in float64, not every expert its tokens touch)."""

    def __init__(self, run: RunConfig, layer: int):
        self.run, self.layer = run, layer
        self.ckpt = SafetensorsCheckpoint.open(run.weights)  # None: synthetic weights
        lw = layer_weights(run.cfg, run.quant, layer, run.seed, [], checkpoint=self.ckpt)
        from epmoe.weights import layer_to_oracle

        o = layer_to_oracle(lw)
        self.gate, self.bias, self.shared, self.shared_gate = o.gate, o.bias, o.shared, \
            o.shared_gate
        self.tid2eid = o.tid2eid
        self._cache: dict[int, tuple] = {}
        outer = self

        class _Idx:
            def __init__(self, j):
                self.j = j

            def __getitem__(self, e):
                return outer._expert(int(e))[self.j]

        self.w13, self.w2 = _Idx(0), _Idx(1)
        self.b13 = self.b2 = None
        if run.cfg.expert_bias:
            self.b13, self.b2 = _Idx(2), _Idx(3)

    def _expert(self, e: int):
        if e not in self._cache:
            from epmoe.quant import dequantize_weight

            self._cache.clear()

            lw = layer_weights(self.run.cfg, self.run.quant, self.layer, self.run.seed, [e],
                               with_shared=False, checkpoint=self.ckpt)
            ex = lw.experts

            def first(t):
                return None if t is None else t[0].double()
            self._cache[e] = (dequantize_weight(ex.w13)[0].double(),
                              dequantize_weight(ex.w2)[0].double(), first(ex.b13), first(ex.b2))
        return self._cache[e]

    def as_tuple(self) -> Oracle:
        return Oracle(self.gate, self.bias, self.w13, self.w2, self.shared, self.b13, self.b2,
                      self.shared_gate, self.tid2eid)


def layer_sources(run: RunConfig, reports: list[dict], l: int) -> list[dict]:
    """The reports whose layer-l rows together are the step's batch: every rank's own rows, or
    rank 0's (a replicated layer: every rank holds the same gathered batch)."""
    return reports if run.holds_own_rows(l) and run.own_tokens else reports[:1]


def check_correctness(run: RunConfig, reports: list[dict]) -> dict:
    """Compare every layer's output (last step) with the float64 oracle on the gathered tokens."""
    # fp8 GEMMs on tensor cores (any rank's experts): the recipe's stated wider tolerance
    fp8_mma = any(r.get("fp8_mma", False) for r in reports)
    tol = tolerance(run.quant, fp8_mma)
    if not run.check or not reports[0]["last"]:
        return dict(checked=False, passed=None, max_rel_err=None, tolerance=tol)
    per_layer, router, checked = [], [], 0
    for l in range(run.num_layers):
        srcs = layer_sources(run, reports, l)
        n_check = min(run.layer_tokens(l), MAX_CHECK_TOKENS_PER_RANK)
        recs = [r["last"][l] for r in srcs]
        x = torch.cat([rec["x"][:n_check] for rec in recs])
        out = torch.cat([rec["out"][:n_check] for rec in recs])
        # the routing the layer used: the oracle replays it (the router is checked apart)
        ids = torch.cat([rec["ids"][:n_check] for rec in recs])
        w = torch.cat([rec["w"][:n_check] for rec in recs])
        oracle = LazyOracleLayer(run, l).as_tuple()
        ref = reference_moe(x, oracle, run.cfg, run.quant, ids, w)
        per_layer.append(max_rel_err(out, ref))
        if bool(recs[0].get("routed", False)):
            tok = None if recs[0].get("tok") is None else \
                torch.cat([rec["tok"][:n_check] for rec in recs])
            router.append(check_router(x, ids, w, oracle, run.cfg, tok))
        checked = max(checked, n_check * len(srcs))
        if len(srcs) == 1:  # replicated tokens: every rank must hold the same output
            for r in reports[1:]:
                other = r["last"][l]["out"][:n_check]
                per_layer[-1] = max(per_layer[-1], max_rel_err(other, ref))
    worst = max(per_layer)
    out = dict(checked=True, passed=bool(worst <= tol), max_rel_err=worst, tolerance=tol,
               fp8_mma=fp8_mma,
               per_layer=per_layer, tokens_checked=checked,
               metric="max|out-ref| / max|ref| per layer, float64 oracle (replaying the "
                      "routing each layer used)")
    if router:
        agree = min(r["agreement"] for r in router)
        w_err = max(r["weight_rel_err"] for r in router)
        ok = agree >= ROUTER_MIN_AGREEMENT and w_err <= ROUTER_WEIGHT_TOL
        out["router"] = dict(passed=ok, agreement=agree, weight_rel_err=w_err,
                             min_agreement=ROUTER_MIN_AGREEMENT, weight_tol=ROUTER_WEIGHT_TOL,
                             metric="share of tokens whose top-k set equals the float64 "
                                    "router's (worst layer); weights of those tokens")
        out["passed"] = out["passed"] and ok
    return out


# The layer's router may compute logits in bf16 with fp32 accumulation (the fused GPU router):
# tokens whose k-th and (k+1)-th scores lie within that rounding may pick the other expert, a
# legitimate difference. The MoE output is checked against the oracle on the routing the layer
# used; the router is checked here: nearly every token's top-k set must equal the oracle's.
ROUTER_MIN_AGREEMENT = 0.9
ROUTER_WEIGHT_TOL = 1e-2


def check_router(x, ids, w, oracle, cfg, token_ids=None) -> dict:
    """Top-k sets and weights of the layer's router against the float64 reference router (a
    hash layer's, given the rows' token ids: its table's experts, their scores)."""
    o = Oracle(*oracle)
    logits = x.double() @ o.gate.T
    if token_ids is not None:
        ref_ids, ref_w = reference_hash_route(logits, cfg, o.tid2eid, token_ids)
    else:
        ref_ids, ref_w = reference_route(logits, cfg, o.bias)
    ids_s, order = ids.long().sort(1)
    ref_s, ref_order = ref_ids.sort(1)
    same = (ids_s == ref_s).all(1)
    w_err = 0.0
    if same.any():
        got = w.double().gather(1, order)[same]
        want = ref_w.gather(1, ref_order)[same]
        w_err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
    return dict(agreement=float(same.double().mean()) if same.numel() else 1.0,
                weight_rel_err=w_err)


def _overlap(stages: dict, step_ms: float | None) -> float | None:
    """(sum of the top-level stage times - step time) / that sum: the share of stage time
    hidden under other stages (shared experts on a side stream, micro-batches)."""
    from epmoe.overlap import overlap_fraction

    if not step_ms:
        return None
    return overlap_fraction({k: v for k, v in stages.items() if "." not in k}, step_ms)


def _median(xs):
    return statistics.median(xs) if xs else None


STAGE_ORDER = ["router", "dispatch", "dispatch.quantize", "experts", "experts.permute",
               "experts.gemm1", "experts.act_quant", "experts.gemm2", "experts.gather", "combine",
               "shared", "all_reduce"]


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
              extra: dict | None = None) -> dict:
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
        correctness=check_correctness(run, reports),
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
