"""The cost model of one MoE layer: predicted time per runtime stage, bytes per link class and
memory per rank, for one (form, comm backend, experts kernel), token count and routing.

    pred = predict_layer(Candidate("ep_dp", "deepep-ll", "deepgemm"),
                         Workload(cfg, quant, tokens=128), Topology.parse("2x8"), profile)
    pred.stages_us["experts.gemm1"], pred.total_us, pred.link_bytes["rdma"]

Stage names are the runtime's StageTimer names (runtime.py, layer.py, experts/*, comm/*); a
parent stage ("dispatch", "experts") includes its children ("dispatch.quantize", "experts.*"),
and `total_us` sums the top-level stages, as a step does. "norm" and "residual" are the
work between two layers (the pre-norm of the layer's input, the residual add of its output:
runtime.py) over the residual rows this rank holds. "relayout" (the token-layout change
entering a layer whose form differs from the previous one's) depends on the previous layer:
0 here, set by the planner (planner.transition_us). Token semantics: `tokens` is one
rank's batch (the data-parallel batch); the global batch is tokens x ranks, which the
replicated forms (tp, ep) process on every rank.

Experts: GEMM time = the sum over the experts of max(FLOPs / TFLOPS(rows), bytes / HBM) at
each expert's own rows (rounded up to the GEMM's alignment; a Poisson count around its
expected rows, grouped.py), read off the profile's measured curve;
permute / gather / act_quant / quantize are alpha-beta fits on byte counts (traffic.py).
Under ep / ep_dp the hottest rank (routing skew + the finite-batch maximum) sets the time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from epmoe.config import MoEConfig, QuantConfig
from epmoe.plan import traffic as tr
from epmoe.plan.beside import blend
from epmoe.plan.forms import FORMS, LayerPlan
from epmoe.plan.grouped import expert_us, grouped_gemm_us
from epmoe.plan.memory import Memory, layer_memory
from epmoe.plan.comm_cost import (BACKENDS, LL, MODELLED_ONLY, CommCase, collective_us,
                                  combine_cost, dispatch_cost, launch_us)
from epmoe.plan.profile import OVERLAPPED, SCHED_SLICE, HardwareProfile
from epmoe.plan.routing import RoutingSpec, RoutingStats, SlotMap, finite_max, routing_stats
from epmoe.plan.timeslice import base_slice_us, time_sliced
from epmoe.plan.topology import Topology

EXPERTS = ("torch", "triton", "deepgemm")
TOP_STAGES = ("relayout", "norm", "router", "dispatch", "experts", "combine", "shared",
              "all_reduce", "residual")
STAGES = ("relayout", "norm", "router", "dispatch", "dispatch.quantize", "experts",
          "experts.permute", "experts.gemm1", "experts.act_quant", "experts.gemm2",
          "experts.gather", "combine", "shared", "all_reduce", "residual")
BETWEEN = {"norm": 1, "residual": 1}  # the inter-layer stages and the kernels each launches
COMM_STAGES = ("dispatch", "combine", "all_reduce")
# GEMM row alignment per expert group: DeepGEMM's get_mk_alignment_for_contiguous_layout and
# Triton's BLOCK_M on GPU (experts/*.py); masked kernels skip rows past the count per 64-row
# block; the torch reference loops over exact rows.
ALIGN = {"deepgemm": 128, "triton": 128, "torch": 1}
MASKED_BLOCK = 64
# Torch ops the router launches (epmoe/router.py + the gate matmul in layer.py), per kind.
ROUTER_OPS = {"softmax": 6, "sigmoid_grouped": 16, "sqrtsoftplus": 12, "softmax_biased": 10}
# The torch reference's per-expert loop (experts/torch_experts.py): ops per non-empty expert.
TORCH_OPS = {"experts.gemm1": 3, "experts.act_quant": 8, "experts.gemm2": 2}
FP32_EFFICIENCY = 0.7  # estimate: fp32 SIMT matmul reaches ~70% of peak (router's gate GEMM)
# The split router on a GPU (gate_topk.gate_way's split way: cuBLAS's bf16 gate GEMM with fp32
# logits out, then the routing kernel on them), from one H100 (BENCHMARKS.md 50: CUDA events,
# 1 to 16,384 tokens, the gates of DeepSeek-V3, Kimi-K2 and Qwen3-235B):
# - the gate GEMM takes max(its fixed time + its compute, its bytes at HBM rate): 7.6-8.1 us at
#   1 token whatever the gate (cuBLAS's kernel and its split-K reduce); compute-bound gates
#   (256 and 384 experts) reach 0.61-0.71 of the bf16 peak at 8,192-16,384 tokens on top of
#   it, while Qwen3-235B's narrow gate (128 experts) streams its tokens at HBM rate and hides it;
# - the routing kernel: 3.3-4.6 us at 1 token, then its selection (TOPK passes over a token's
#   E scores) 1.0-1.2 ps per (token, expert, k) on 132 SMs, the SM count scaling it to others.
GATE_GEMM_FLOOR_US = 8.0
GATE_GEMM_EFFICIENCY = 0.70
ROUTE_KERNEL_FLOOR_US = 4.0
ROUTE_PS_PER_SM = 1.1 * 132


@dataclass(frozen=True)
class Candidate:
    """One way to run a layer: a parallel form, a comm backend, an experts kernel."""

    form: str
    backend: str
    experts: str

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"form ({self.form!r}) must be one of {FORMS}")
        if self.backend not in BACKENDS + MODELLED_ONLY:
            raise ValueError(f"comm backend ({self.backend!r}) must be one of "
                             f"{BACKENDS + MODELLED_ONLY}")
        if self.experts not in EXPERTS:
            raise ValueError(f"experts kernel ({self.experts!r}) must be one of {EXPERTS}")
        if self.form != "ep_dp" and self.backend != "local":
            raise ValueError(f"form {self.form!r} replicates tokens: its backend must be "
                             f"'local', got {self.backend!r}")

    @property
    def label(self) -> str:
        return f"{self.form}/{self.backend}/{self.experts}"


@dataclass(frozen=True)
class Workload:
    """tokens: one rank's batch. max_tokens: LL buffer capacity per rank (default tokens).
    reuse_layout: DeepEP HT reuses a cached layout (no count exchange), as its benchmarks do.
    comm_sms: SMs given to SM-driven comm (None: each backend's default).
    overlap_shared: the shared MLP runs on a side stream (None: yes on CUDA profiles)."""

    cfg: MoEConfig
    quant: QuantConfig = field(default_factory=QuantConfig)
    tokens: int = 128
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    slots: SlotMap | None = None
    max_tokens: int | None = None
    reuse_layout: bool = False
    comm_sms: int | None = None
    overlap_shared: bool | None = None  # None: on CUDA profiles, as the runtime's default

    def __post_init__(self):
        if not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"tokens per rank ({self.tokens!r}) must be a positive int")
        object.__setattr__(self, "routing", RoutingSpec.parse(self.routing))

    @property
    def num_slots(self) -> int:
        return self.cfg.num_experts if self.slots is None else self.slots.num_slots


@dataclass(frozen=True)
class LayerPrediction:
    candidate: Candidate
    stages_us: dict
    link_bytes: dict
    memory: Memory
    notes: dict

    overlap_shared: bool = False
    tail_us: float = 0.0

    @property
    def total_us(self) -> float:
        """The layer's time: the top-level stages in sequence, except that an overlapped
        shared MLP (a side stream on CUDA, layer.py) hides behind dispatch -> combine, plus
        the layer's tail (`tail_us`: what a measured forward takes beyond that composition
        of its own stages: the shared add and casts, the side stream's join, launch gaps,
        SM contention; calibrated, 0 without a measurement)."""
        return layer_body_us(self.stages_us, self.overlap_shared) + self.tail_us

    @property
    def comm_us(self) -> float:
        return sum(self.stages_us.get(s, 0.0) for s in COMM_STAGES)


def layer_body_us(s: dict, overlap_shared: bool) -> float:
    """The stages of one layer composed as the runtime runs them (no tail)."""
    routed = s.get("dispatch", 0.0) + s.get("experts", 0.0) + s.get("combine", 0.0)
    shared = s.get("shared", 0.0)
    body = max(routed, shared) if overlap_shared else routed + shared
    between = s.get("norm", 0.0) + s.get("residual", 0.0)
    return s.get("relayout", 0.0) + s.get("router", 0.0) + body + s.get("all_reduce", 0.0) \
        + between


def between_us(prof: HardwareProfile, stage: str, rows: float, d: int) -> float:
    """An inter-layer stage ("norm" or "residual") over `rows` bf16 residual rows of width d:
    the profile's fit (kernels["layer"][stage], timed as the runtime runs it) when it has
    one, else its bytes at HBM bandwidth, at least its kernel launches."""
    nbytes = tr.BETWEEN_BYTES[stage](rows, d)
    fit = prof.most_specific("layer", stage)
    if fit is not None:
        return fit.time_us(nbytes)
    return max(nbytes / (prof.fig("hbm_GBps") * 1e3), launch_us(prof, BETWEEN[stage]))


def _tail_us(cfg: MoEConfig, prof: HardwareProfile, n: int, experts: str) -> float:
    """The layer's measured tail over the n x hidden bf16 bytes of the layer's output: the
    experts backend's own fit (kernels["layer"]["tail.<experts>"]) when the profile has one,
    else the pooled kernels["layer"]["tail"], else 0."""
    fit = prof.most_specific("layer", f"tail.{experts}", "tail")
    return 0.0 if fit is None else max(0.0, fit.time_us(n * cfg.hidden * 2.0))


def predict_layer(cand: Candidate, work: Workload, topo: Topology, prof: HardwareProfile,
                  stats: RoutingStats | None = None) -> LayerPrediction:
    """Predicted stages of one layer on the slowest rank (see the module docstring)."""
    cfg, quant, world = work.cfg, work.quant, topo.world
    if stats is None and cand.form != "tp":
        stats = routing_stats(cfg, work.routing, world, topo.gpus_per_node, work.slots)
    t = work.tokens
    n_rep = t * world if cand.form != "ep_dp" else t  # tokens this rank routes
    plan = LayerPlan(cand.form, 0, world, cand.backend if world > 1 else "local", cand.experts,
                     work.num_slots)
    inter = cfg.moe_intermediate // world if cand.form == "tp" else cfg.moe_intermediate
    e_local = work.num_slots if cand.form == "tp" else work.num_slots // world
    case = CommCase(cfg, quant, topo, prof, stats, n_rep if cand.backend == "local" else t,
                    work.max_tokens or t, work.comm_sms, work.reuse_layout, cand.experts)
    st: dict[str, float] = {"router": _router_us(cfg, prof, n_rep)}
    for stage in BETWEEN:  # the residual rows: every rank's under the replicated forms
        st[stage] = between_us(prof, stage, n_rep, cfg.hidden)
    disp = dispatch_cost(cand.backend, case)
    st["dispatch"], st["dispatch.quantize"] = disp.us, disp.quantize_us
    # rows into the experts on the hottest rank: tokens n_in, (token, expert) pairs
    n_in, pairs, slot_rows = _expert_rows(cand, work, topo, stats, n_rep)
    kind = "masked" if cand.backend in LL else "layout" if cand.backend == "symm-ht" else "tokens"
    overlap = work.overlap_shared if work.overlap_shared is not None else \
        prof.fig("sm_arch") > 0
    args = (cand.experts, kind, cfg, quant, prof, n_in, pairs, slot_rows, inter)
    ex = _experts_stages(*args)
    st["shared"] = _shared_us(cand, cfg, quant, prof, plan, n_rep, overlap)
    if overlap and st["shared"]:  # the routed kernels that run beside it share the GPU
        ex = blend(ex, _experts_stages(*args, overlapped=True), st["dispatch"], st["shared"])
    st.update(ex)
    comb = combine_cost(cand.backend, case)
    st["combine"] = comb.us
    if overlap and st["shared"]:  # held back by the routed path at most until it ends (an
        # overlapped curve measured beside a longer routed path does not carry over)
        routed = st["dispatch"] + st["experts"] + st["combine"]
        alone = _shared_us(cand, cfg, quant, prof, plan, n_rep, False)
        st["shared"] = min(st["shared"], routed + alone)
    ar_bytes = {}
    st["all_reduce"] = 0.0
    if plan.needs_all_reduce:
        st["all_reduce"], ar_bytes = collective_us(case, "all_reduce", n_rep * cfg.hidden * 2.0)
    link = {}
    for part in (disp.link_bytes, comb.link_bytes, ar_bytes):
        for k, v in part.items():
            link[k] = link.get(k, 0.0) + v
    notes = {**disp.notes, **comb.notes, "tokens_in": n_in, "pairs": pairs,
             "rows_per_expert": pairs / max(e_local, 1)}
    if stats is not None:
        notes.update(ranks_per_token=stats.ranks_per_token, nodes_per_token=stats.nodes_per_token,
                     imbalance=stats.imbalance)
    mem = layer_memory(cand, work, topo, n_in, pairs, e_local, inter, plan, case)
    stages, tail = {s: st.get(s, 0.0) for s in STAGES}, _tail_us(cfg, prof, n_rep, cand.experts)
    f = topo.oversubscription  # CPU ranks sharing cores: time-sliced (timeslice.py)
    if f > 1:
        notes["oversubscription"] = f
        blocking = {"all_reduce"} | ({"dispatch", "combine"} if plan.backend != "local" else set())
        q = prof.device[SCHED_SLICE].value if SCHED_SLICE in prof.device else 0.0
        stages, tail = time_sliced(stages, tail, f, q or base_slice_us(topo.cores_per_node),
                                   blocking)
    return LayerPrediction(cand, stages, link, mem, notes, overlap, tail)


def _router_us(cfg: MoEConfig, prof: HardwareProfile, n: int) -> float:
    """The router stage: a measured fit of this router kind (kernels["router"]) when the
    profile has one; else on a GPU the split way (the gate GEMM in bf16: its fixed time and
    compute, or its bytes; then the routing kernel: its fixed time and its selection work; at
    least two launches), on a CPU the torch path (the gate GEMM at fp32 rates and the
    router's ops)."""
    if prof.has_kernel("router", cfg.router):
        return prof.kernel("router", cfg.router).time_us(
            tr.router_bytes(n, cfg.hidden, cfg.num_experts))
    flops = 2.0 * n * cfg.hidden * cfg.num_experts
    if prof.fig("sm_arch") > 0:
        hbm = prof.fig("hbm_GBps") * 1e3
        gemm = max(GATE_GEMM_FLOOR_US + flops / (prof.fig("peak_tflops_bf16")
                                                 * GATE_GEMM_EFFICIENCY * 1e6),
                   (2.0 * (n + cfg.num_experts) * cfg.hidden + 4.0 * n * cfg.num_experts) / hbm)
        select = n * cfg.num_experts * cfg.top_k * ROUTE_PS_PER_SM * 1e-6 / prof.fig("sms")
        route = ROUTE_KERNEL_FLOOR_US + max(select, n * (4.0 * cfg.num_experts
                                                         + 8.0 * cfg.top_k) / hbm)
        return max(gemm + route, launch_us(prof, 2))
    gpu = (flops / (prof.fig("peak_tflops_fp32") * FP32_EFFICIENCY * 1e6)
           + n * (6.0 * cfg.hidden + 24.0 * cfg.num_experts) / (prof.fig("hbm_GBps") * 1e3))
    return max(gpu, launch_us(prof, ROUTER_OPS[cfg.router]))


def _expert_rows(cand, work, topo, stats, n_rep):
    """(tokens in, pairs, expected rows per local slot) on the hottest rank."""
    world, k = topo.world, work.cfg.top_k
    if cand.form == "tp":  # every expert here, load balanced by construction
        pairs = n_rep * k
        return n_rep, pairs, [pairs / work.num_slots] * work.num_slots
    hot = stats.hot_rank
    glob = work.tokens * world  # every rank's tokens reach the experts once
    mean_pairs = glob * stats.pairs_rank[hot]
    pairs = finite_max(mean_pairs, mean_pairs, world)
    scale = pairs / mean_pairs if mean_pairs else 0.0
    slot_rows = [glob * q * scale for q in stats.slots_of(hot)]
    if cand.form == "ep" or cand.backend in ("local", "allgather"):
        n_in = glob  # every token visits every rank (replicated or all-gathered)
    else:
        h = glob * stats.hit_rank[hot]
        n_in = finite_max(h, h * (1 - stats.hit_rank[hot]), world)
    return n_in, pairs, slot_rows


def _aligned_rows(means, a: int) -> float:
    """sum of E[ceil(X / a) * a] for X ~ Poisson(m), m in `means`: the rows groups of those
    mean sizes occupy at alignment a (above 400 rows, the mean plus half an alignment)."""
    m = np.maximum(np.asarray(means, dtype=float), 0.0)
    if a <= 1:
        return float(m.sum())
    big = m > 400
    total = float((m[big] + (a - 1) / 2.0).sum())
    small = m[~big & (m > 0)]
    if small.size:
        top = small.max()
        x = np.arange(int(top + 12 * math.sqrt(top) + 2 * a) + 1)
        log_fact = np.concatenate(([0.0], np.cumsum(np.log(np.arange(1, x.size)))))
        log_p = x[None, :] * np.log(small)[:, None] - small[:, None] - log_fact[None, :]
        total += float((np.exp(log_p) @ (np.ceil(x / a) * a)).sum())
    return total


def _gemm_curve(prof, backend, quant, layout, n, k, overlapped=False):
    recipe = "bf16" if backend == "torch" else quant.recipe  # torch computes in fp32
    return prof.curve(backend, recipe, layout, n, k, overlapped)


def _gemm_us(prof, backend, quant, layout, slot_rows, n, k, align: int = 1,
             overlapped: bool = False) -> float:
    """The grouped GEMM over the experts' expected rows in a step (grouped.py: each expert at
    its own rows, a Poisson count, read off the curve)."""
    return grouped_gemm_us(_gemm_curve(prof, backend, quant, layout, n, k, overlapped), quant,
                           slot_rows, n, k, align, prof.fig("hbm_GBps"))


def _kernel_us(prof, experts: str, names: tuple[str, ...], overlapped: bool,
               nbytes: float, calls: float = 0.0) -> float:
    """The stage's time from the most specific fit of `names` (most specific first), its
    fixed cost per call where the fit was measured per call (AlphaBeta.calls).
    Beside the shared MLP the fits timed so (".overlapped") are read, but never below the
    fit timed alone: contention only slows a stage, and an overlapped fit comes from the
    sizes that ran entirely beside the shared MLP (often the largest), extrapolated below."""
    alone = prof.most_specific(experts, *names)
    if alone is None:
        raise KeyError(f"profile {prof.name!r} has no {names[-1]!r} kernel fit for {experts!r}")
    us = alone.time_us(nbytes, calls)
    beside = prof.most_specific(experts, *(n + OVERLAPPED for n in names)) if overlapped \
        else None
    return max(us, beside.time_us(nbytes, calls)) if beside is not None else us


def _experts_stages(experts, kind, cfg, quant, prof, n_in, pairs, slot_rows, inter,
                    overlapped: bool = False):
    """The experts' stages; overlapped: each entirely beside the shared MLP on its side
    stream (the calibration times them both ways: contention slows them; beside.py's
    timeline decides which stages run so)."""
    d = cfg.hidden
    align = MASKED_BLOCK if kind == "masked" and experts != "torch" else ALIGN[experts]
    rows = _aligned_rows(slot_rows, align)
    layout = "masked" if kind == "masked" else "contiguous"
    s = {"experts.gemm1": _gemm_us(prof, experts, quant, layout, slot_rows, 2 * inter, d,
                                   align, overlapped),
         "experts.gemm2": _gemm_us(prof, experts, quant, layout, slot_rows, d, inter, align,
                                   overlapped)}
    # act+quant computes each expert's rows in whole blocks and skips padding (either layout)
    aq_rows = rows if experts == "torch" else _aligned_rows(slot_rows, tr.ACT_BLOCK_ROWS)
    recipe = "bf16" if experts == "torch" else quant.recipe  # (its fp8 and bf16 passes differ)
    busy = sum(1 - math.exp(-m) for m in slot_rows)  # experts given a row (Poisson)
    s["experts.act_quant"] = _kernel_us(prof, experts, (f"act_quant.{recipe}", "act_quant"),
                                        overlapped, tr.act_quant_bytes(aq_rows, inter, quant),
                                        busy if experts == "torch" else 0.0)
    if kind == "tokens":  # per recipe where calibrated so, else pooled over recipes
        s["experts.permute"] = _kernel_us(prof, experts, (f"permute.{recipe}", "permute"),
                                          overlapped,
                                          tr.permute_bytes(n_in, pairs, d, quant, experts))
        s["experts.gather"] = _kernel_us(prof, experts, (f"gather.{recipe}", "gather"),
                                         overlapped, tr.gather_bytes(n_in, pairs, d))
    extra = 0.0
    if experts == "torch":  # Python loop over non-empty experts, two host syncs, dequantize
        for stage, ops in TORCH_OPS.items():
            s[stage] = max(s[stage], launch_us(prof, ops) * busy)
        extra = 2 * prof.fig("sync_us") + rows * 6.0 * d / (prof.fig("hbm_GBps") * 1e3)
    s["experts"] = sum(s.values()) + extra
    return s


def _shared_us(cand, cfg, quant, prof, plan, n, overlapped: bool) -> float:
    """The shared experts' stage as layer.py times it: the backend's quantize_input, then its
    run_dense (GEMM1, act+quant, GEMM2 over every row, no permute / gather). Split like tp
    when it tiles, else rank 0 runs it whole. A measured MLP curve of the backend and recipe
    (alone, or overlapped with the routed path on its side stream) gives the time; without
    one, the GEMM curves (Triton's run_dense is its masked GEMM) plus the kernel fits."""
    if not cfg.num_shared_experts:
        return 0.0
    _, sl = plan.shared_slice(cfg, quant)
    width = sl[1] if sl is not None else cfg.shared_intermediate
    d = cfg.hidden
    recipe = "bf16" if cand.experts == "torch" else quant.recipe
    curve = prof.mlp_curve(cand.experts, recipe, width, d, overlapped)
    if curve is not None:
        return curve.time_us(n, width, d)
    layout = "masked" if cand.experts == "triton" else "contiguous"
    hbm = prof.fig("hbm_GBps")  # one dense GEMM over every row: one "expert" at n rows
    us = sum(expert_us(_gemm_curve(prof, cand.experts, quant, layout, nn, kk), quant, n, n,
                       nn, kk, hbm) for nn, kk in ((2 * width, d), (d, width)))
    us += prof.kernel(cand.experts, "act_quant").time_us(tr.act_quant_bytes(n, width, quant))
    if cand.experts == "torch":
        us = max(us, launch_us(prof, sum(TORCH_OPS.values())))
    q = tr.quantize_bytes(n, d, quant)
    return us + (prof.kernel("comm", "quantize").time_us(q) if q else 0.0)
