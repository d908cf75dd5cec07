"""The launch's float64 check: each layer's output against `epmoe.reference` on the rows and
routing that layer saw, computed where the ranks are.

`layer_checks` cuts the ranks' reports into one `LayerCheck` per layer; `solve` runs one layer's
oracle on a device (in float64 on the rank's GPU when it has one: a full-size layer's experts
are regenerated there in about a second, against a minute or more on a host core), falling back
to the host when the GPU is out of memory; a driver spreads the layers over its ranks
(`solve_checks`) and `check_correctness` turns the verdicts into the report's `correctness`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from epmoe.checkpoint import SafetensorsCheckpoint
from epmoe.plan.run import RunConfig
from epmoe.reference import (Oracle, max_rel_err, reference_hash_route, reference_moe,
                             reference_route, rounding_slack, tolerance)
from epmoe.weights import expert_weights, layer_to_oracle, layer_weights

# Beyond this many oracle FLOPs the check covers a prefix of each rank's tokens.
MAX_CHECK_TOKENS_PER_RANK = 64
# The layer's router may compute logits in bf16 with fp32 accumulation (the fused GPU router):
# tokens whose k-th and (k+1)-th scores lie within that rounding may pick the other expert, a
# legitimate difference. The MoE output is checked against the oracle on the routing the layer
# used; the router is checked here: nearly every token's top-k set must equal the oracle's.
ROUTER_MIN_AGREEMENT = 0.9
ROUTER_WEIGHT_TOL = 1e-2
# The slowest the oracle regenerates weights, in values per second (one host core: ~55e6
# measured on this project's 2-core box; a GPU ~100x more): one layer's check may take
# --timeout plus its weights at this rate before the driver gives up on the rank.
MIN_VALUES_PER_S = 5e6


class LazyOracleLayer:
    """The float64 oracle's weights of one layer on `device`, built per expert on use and only
    the last one kept (reference_moe goes expert by expert: a full-size model's check holds
    one expert in float64, not every expert its tokens touch)."""

    def __init__(self, run: RunConfig, layer: int, device=None):
        self.run, self.layer, self.device = run, layer, device
        self.ckpt = SafetensorsCheckpoint.open(run.weights)  # None: synthetic weights
        o = layer_to_oracle(layer_weights(run.cfg, run.quant, layer, run.seed, [],
                                          checkpoint=self.ckpt, device=device))
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
            ex = expert_weights(self.run.cfg, self.run.quant, self.layer, self.run.seed, [e],
                                device=self.device, checkpoint=self.ckpt)

            def first(t):
                return None if t is None else t[0].double()
            self._cache[e] = (dequantize_weight(ex.w13)[0].double(),
                              dequantize_weight(ex.w2)[0].double(), first(ex.b13), first(ex.b2))
        return self._cache[e]

    def as_tuple(self) -> Oracle:
        return Oracle(self.gate, self.bias, self.w13, self.w2, self.shared, self.b13, self.b2,
                      self.shared_gate, self.tid2eid)


@dataclass(frozen=True)
class LayerCheck:
    """What one layer's check needs: the rows it saw (every source rank's first
    MAX_CHECK_TOKENS_PER_RANK, in rank order), the routing it used, the rows' token ids (a hash
    layer), whether its router ran (then it is checked too), and the outputs to judge with the
    check's tolerance (which rows need their rounding slack)."""

    layer: int
    x: torch.Tensor  # [n, D] as the layer saw them
    ids: torch.Tensor  # [n, K] logical expert ids, -1 = empty slot
    w: torch.Tensor  # [n, K]
    tok: torch.Tensor | None
    routed: bool
    outs: tuple = ()  # the outputs judged against the oracle, [n, D] each (every rank's copy
    # of a replicated layer): rows off by more than `tol` get their rounding slack
    tol: float = math.inf

    def weight_values(self, run: RunConfig) -> int:
        """Weight values the oracle regenerates: each routed expert the rows reach (w13, w2)."""
        cfg = run.cfg
        experts = len({e for e in self.ids.flatten().tolist() if e >= 0})
        return experts * 3 * cfg.hidden * cfg.moe_intermediate


@dataclass(frozen=True)
class LayerVerdict:
    layer: int
    ref: torch.Tensor  # float64 [n, D] on the host
    slack: torch.Tensor  # float64 [n, D] on the host: reference.rounding_slack on the rows
    # some output misses by more than the tolerance, zero on the others
    router: dict | None  # check_router's, if the layer's router ran
    device: str  # where the oracle ran ("cuda", "cpu", "cpu (cuda out of memory)")
    seconds: float


def layer_sources(run: RunConfig, reports: list[dict], l: int) -> list[dict]:
    """The reports whose layer-l rows together are the step's batch: every rank's own rows, or
    rank 0's (a replicated layer: every rank holds the same gathered batch)."""
    return reports if run.holds_own_rows(l) and run.own_tokens else reports[:1]


def layer_checks(run: RunConfig, reports: list[dict], tol: float = math.inf
                 ) -> list[LayerCheck]:
    """One LayerCheck per layer from the ranks' reports of the last step."""
    out = []
    for l in range(run.num_layers):
        n = min(run.layer_tokens(l), MAX_CHECK_TOKENS_PER_RANK)
        srcs = layer_sources(run, reports, l)
        recs = [r["last"][l] for r in srcs]

        def cat(key):
            return torch.cat([rec[key][:n] for rec in recs])
        tok = None if recs[0].get("tok") is None else cat("tok")
        outs = (cat("out"),) if len(srcs) == len(reports) else \
            tuple(r["last"][l]["out"][:n] for r in reports)  # replicated: every rank's copy
        out.append(LayerCheck(l, cat("x"), cat("ids"), cat("w"), tok,
                              bool(recs[0].get("routed", False)), outs, tol))
    return out


def _solve_on(run: RunConfig, check: LayerCheck, device: torch.device):
    oracle = LazyOracleLayer(run, check.layer, device).as_tuple()
    x = check.x.to(device)
    ref = reference_moe(x, oracle, run.cfg, run.quant, check.ids, check.w).cpu()
    slack = torch.zeros_like(ref)
    rows = suspect_rows(check, ref)
    if rows.numel():  # only there: a row's slack costs ~F times its oracle
        slack[rows] = rounding_slack(x[rows.to(device)], oracle, run.cfg, run.quant,
                                     check.ids[rows], check.w[rows]).cpu()
    router = check_router(check.x, check.ids, check.w, oracle, run.cfg, check.tok) \
        if check.routed else None
    return ref, slack, router


def suspect_rows(check: LayerCheck, ref: torch.Tensor) -> torch.Tensor:
    """The rows where some judged output is off by more than the tolerance (of max|ref|)."""
    bound = check.tol * ref.abs().max()
    off = torch.zeros(ref.shape[0], dtype=torch.bool)
    for o in check.outs:
        off |= ((o.double() - ref).abs() > bound).any(1) | o.isnan().any(1)
    return off.nonzero().flatten()


def solve(run: RunConfig, check: LayerCheck, device=None) -> LayerVerdict:
    """One layer's float64 oracle on `device` (default: the host); on the host instead when
    the device runs out of memory (the ranks' weights and buffers are still there)."""
    dev = torch.device("cpu" if device is None else device)
    t0 = time.monotonic()
    where = dev.type
    try:
        ref, slack, router = _solve_on(run, check, dev)
    except torch.OutOfMemoryError:
        if dev.type == "cpu":
            raise
        torch.cuda.empty_cache()
        where = f"cpu ({dev.type} out of memory)"
        ref, slack, router = _solve_on(run, check, torch.device("cpu"))
    return LayerVerdict(check.layer, ref, slack, router, where, round(time.monotonic() - t0, 3))


def solve_here(run: RunConfig, checks: Iterable[LayerCheck], device=None) -> Iterator[LayerVerdict]:
    """Every check in this process, one after another."""
    for c in checks:
        yield solve(run, c, device)


def check_deadline_s(run: RunConfig, checks: Iterable[LayerCheck]) -> float:
    """How long a rank may take over the largest of `checks` before it counts as hung (whole
    seconds, rounded up)."""
    return float(math.ceil(run.timeout_s + max((c.weight_values(run) for c in checks),
                                               default=0) / MIN_VALUES_PER_S))


Solver = Callable[[list[LayerCheck]], Iterable[LayerVerdict]]


def check_correctness(run: RunConfig, reports: list[dict], solver: Solver | None = None,
                      progress: Callable[[int, int], None] | None = None) -> dict:
    """Compare every layer's output (last step) with the float64 oracle on the gathered tokens.
    solver: where the layers' oracles run (default: this process, on the host); progress:
    called with (layers done, layers) after each verdict."""
    # fp8 GEMMs on tensor cores (any rank's experts): the recipe's stated wider tolerance
    fp8_mma = any(r.get("fp8_mma", False) for r in reports)
    tol = tolerance(run.quant, fp8_mma)
    if not run.check or not reports[0]["last"]:
        return dict(checked=False, passed=None, max_rel_err=None, tolerance=tol)
    checks = layer_checks(run, reports, tol)
    solver = solver or (lambda cs: solve_here(run, cs))
    t0 = time.monotonic()
    verdicts: dict[int, LayerVerdict] = {}
    for v in solver(checks):
        verdicts[v.layer] = v
        if progress is not None:
            progress(len(verdicts), len(checks))
    per_layer, raw, router = [], [], []
    for c in checks:  # (replicated tokens: every rank's copy must match)
        v = verdicts[c.layer]
        per_layer.append(max(max_rel_err(o, v.ref, v.slack) for o in c.outs))
        raw.append(max(max_rel_err(o, v.ref) for o in c.outs))
        if v.router is not None:
            router.append(v.router)
    worst = max(per_layer)
    out = dict(checked=True, passed=bool(worst <= tol), max_rel_err=worst, tolerance=tol,
               max_rel_err_raw=max(raw), fp8_mma=fp8_mma, per_layer=per_layer,
               tokens_checked=max(c.x.shape[0] for c in checks),
               oracle=dict(devices=sorted({v.device for v in verdicts.values()}),
                           seconds=round(time.monotonic() - t0, 3),
                           layer_seconds_max=max(v.seconds for v in verdicts.values())),
               metric="max(|out-ref| - slack) / max|ref| per layer, float64 oracle "
                      "(replaying the routing each layer used); slack: what rounding an "
                      "element of GEMM1's output to its other bf16 neighbour moves an output "
                      "by (reference.rounding_slack); max_rel_err_raw: without it")
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


def check_router(x, ids, w, oracle, cfg, token_ids=None) -> dict:
    """Top-k sets and weights of the layer's router against the float64 reference router (a
    hash layer's, given the rows' token ids: its table's experts, their scores). The logits
    are taken where the oracle's gate is; the routing itself on the host."""
    o = Oracle(*oracle)
    logits = (x.to(o.gate.device).double() @ o.gate.T).cpu()
    if token_ids is not None:
        ref_ids, ref_w = reference_hash_route(logits, cfg, o.tid2eid.cpu(), token_ids)
    else:
        ref_ids, ref_w = reference_route(logits, cfg, None if o.bias is None else o.bias.cpu())
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
