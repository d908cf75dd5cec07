"""The planner: per MoE layer and per token bucket, the feasible (form, comm backend, experts
kernel) with the lowest predicted time that fits in memory, explained in one line.

    plan = plan_stack(get_preset("deepseek-v3"), QuantConfig("fp8_block"),
                      Topology.parse("2x8"), load_profile("h200"), buckets=(128, 4096))
    plan.layer_plans(rank, tokens)   # -> [LayerPlan] for the runtime

Feasibility (`feasible`) reuses the runtime's own rules where they are pure: LayerPlan.validate
(divisibility, quant tiling per tp shard), DeepEP's accepted hidden sizes / top-k / ranks
(epmoe.comm.deepep constants), the registered comm backends (epmoe.comm.BACKENDS). scope
"runtime" allows what epmoe runs today (DeepEP intranode); "model" allows every mechanism the
cost model knows (DeepEP across nodes), for the simulator.
Layers may differ (recorded loads, EPLB placements); a stack may mix forms: entering a
replicated-token layer (tp, ep) from an ep_dp layer costs an all-gather, which the per-stack
search (a shortest path over layers) charges to the later layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.config import MoEConfig, QuantConfig
from epmoe.plan.backlog import Backlog
from epmoe.plan.comm_cost import (BACKENDS, FITS_OF, HT_KERNELS, LL, MODELLED_ONLY,
                                  CommCase, collective_us)
from epmoe.plan.forms import FORMS, LayerPlan
from epmoe.plan.cost import EXPERTS, TOP_STAGES, Candidate, LayerPrediction, Workload, \
    predict_layer
from epmoe.plan.planfile import Choice, LayerEntry, Plan
from epmoe.plan.profile import HardwareProfile
from epmoe.plan.routing import RoutingSpec, SlotMap, routing_stats
from epmoe.plan.topology import Topology

SCOPES = ("runtime", "model")
MEMORY_FRACTION = 0.9  # of HBM a plan may fill by default (the rest: allocator, other layers)


def _registered() -> frozenset:
    from epmoe.comm import BACKENDS as REGISTERED

    return frozenset(REGISTERED)


def feasible(cand: Candidate, cfg: MoEConfig, quant: QuantConfig, topo: Topology,
             prof: HardwareProfile, num_slots: int | None = None, scope: str = "runtime",
             available: frozenset | None = None) -> str | None:
    """None if `cand` can run (scope runtime) or be modelled (scope model), else why not."""
    return rule_violation(cand, cfg, quant, topo, int(prof.fig("sm_arch")), num_slots, scope,
                          available) or profile_gap(cand, cfg, quant, topo, prof)


def rule_violation(cand: Candidate, cfg: MoEConfig, quant: QuantConfig, topo: Topology,
                   sm_arch: int, num_slots: int | None = None, scope: str = "runtime",
                   available: frozenset | None = None) -> str | None:
    """The runtime's own rules, without a profile: LayerPlan's shapes, the registered comm
    backends, DeepEP's (epmoe.comm.deepep.shape_unsupported / ll_shape_unsupported) and
    DeepGEMM's (epmoe.experts.deepgemm_experts.arch_unsupported) pure rules. sm_arch:
    compute capability x 10, 0 for CPU ranks."""
    if scope not in SCOPES:
        raise ValueError(f"scope ({scope!r}) must be one of {SCOPES}")
    world, b = topo.world, cand.backend
    if world == 1 and (cand.form != "ep_dp" or b != "local"):
        return "one rank: every form is ep_dp/local"
    try:
        LayerPlan(cand.form, 0, world, b, cand.experts, num_slots).validate(cfg, quant)
    except ValueError as exc:
        return str(exc)
    if scope == "runtime" and b in MODELLED_ONLY:
        return f"backend {b} is modelled only (epmoe runs DeepEP V1: deepep-ht)"
    if scope == "runtime" and b not in (available or _registered()):
        return f"backend {b} is not registered in epmoe.comm"
    if b in HT_KERNELS + LL:
        from epmoe.comm.deepep import (ll_shape_unsupported, normal_layout_unsupported,
                                       shape_unsupported)

        if not sm_arch:
            return f"{b} needs CUDA GPUs"
        why = shape_unsupported(cfg, quant, None)
        if why:
            return why
        if b.startswith("symm") and topo.num_nodes > 1:
            return f"{b} stores into peers over NVLink: one node only"
        if b == "deepep-ht" and scope == "model":  # (runtime: intranode only, below)
            why = normal_layout_unsupported(world, topo.num_nodes, topo.gpus_per_node)
            if why:
                return why
        if b.startswith("deepep") and scope == "runtime":
            why = shape_unsupported(cfg, quant, world)
            if why or topo.num_nodes > 1:
                return why or f"epmoe's DeepEP runs intranode, not on {topo.describe()}"
        if b in LL:
            why = ll_shape_unsupported(cfg)
            if why:
                return why
    inter = cfg.moe_intermediate // world if cand.form == "tp" else cfg.moe_intermediate
    return _experts_rule(cand.experts, cfg, quant, inter, sm_arch)


def tokens_rule(cand: Candidate, work: Workload) -> str | None:
    """The rules that depend on the bucket's batch: the low-latency backends' buffers hold a
    fixed number of tokens per rank (the run's max tokens), sized when they are built."""
    cap = work.max_tokens or work.tokens
    if cand.backend == "symm-ll":
        from epmoe.comm.symm.ll import MAX_TOKENS

        if cap > MAX_TOKENS:
            return (f"symm-ll holds at most {MAX_TOKENS} tokens per rank (its masked region "
                    f"holds every rank's tokens per expert), not {cap}")
    if cand.backend == "deepep-ll":
        from epmoe.comm.deepep import ll_tokens_unsupported

        return ll_tokens_unsupported(cap, work.cfg.hidden, work.num_slots)
    return None


def profile_gap(cand: Candidate, cfg: MoEConfig, quant: QuantConfig, topo: Topology,
                prof: HardwareProfile) -> str | None:
    """Why the profile cannot predict `cand` (a GEMM curve or comm fit it lacks), or None."""
    b = cand.backend
    inter = cfg.moe_intermediate // topo.world if cand.form == "tp" else cfg.moe_intermediate
    try:
        prof.curve(cand.experts, "bf16" if cand.experts == "torch" else quant.recipe,
                   "contiguous", 2 * inter, cfg.hidden)
        if b in HT_KERNELS + LL:
            for cls in {topo.intra} | ({"rdma"} if topo.num_nodes > 1 else set()):
                prof.comm_fit(FITS_OF.get(b, b), cls, "dispatch")
    except KeyError as exc:
        return str(exc).strip('"')
    return None


def _experts_rule(experts: str, cfg: MoEConfig, quant: QuantConfig, inter: int,
                  arch: int) -> str | None:
    """Triton's and DeepGEMM's pure rules (their `supports` also probe the device)."""
    if experts == "torch":
        return None
    if arch == 0:
        return f"{experts} experts need a CUDA GPU" + (
            " (Triton's CPU interpreter is for tests)" if experts == "triton" else "")
    if experts == "deepgemm":
        from epmoe.experts.deepgemm_experts import arch_unsupported

        return arch_unsupported(cfg, quant, arch, inter)
    try:
        quant.check_shapes(cfg, inter)
    except ValueError as exc:
        return str(exc)
    return None


def candidates(world: int, forms=None, backends=None, experts=None) -> list[Candidate]:
    """Every (form, backend, experts) of the restrictions; ep_dp on more than one rank leaves
    out the local backend (it moves no tokens) unless asked for by name."""
    out = []
    for form in forms or FORMS:
        ep_dp = backends or tuple(b for b in BACKENDS if b != "local" or world == 1)
        for b in ("local",) if form != "ep_dp" else ep_dp:
            if form != "ep_dp" and backends and "local" not in backends and world > 1:
                continue
            for e in experts or EXPERTS:
                out.append(Candidate(form, b, e))
    return out


@dataclass(frozen=True)
class Ranked:
    """One layer at one bucket: feasible predictions, fastest first, and what was rejected."""

    preds: tuple[LayerPrediction, ...]
    rejected: tuple[tuple[str, str], ...]


def rank_layer(work: Workload, topo: Topology, prof: HardwareProfile, cands, num_layers: int,
               scope: str = "runtime", available=None, budget_bytes: float | None = None,
               stats=None) -> Ranked:
    """Every candidate of `cands` for one layer: feasible ones predicted and ranked (stats:
    routing statistics, computed once here when not given)."""
    budget = budget_bytes if budget_bytes is not None else \
        MEMORY_FRACTION * prof.fig("hbm_GiB") * 2**30
    preds, rejected = [], []
    for c in cands:
        why = feasible(c, work.cfg, work.quant, topo, prof, work.num_slots, scope, available) \
            or tokens_rule(c, work)
        if why is None:
            if stats is None and c.form != "tp":
                try:
                    stats = routing_stats(work.cfg, work.routing, topo.world,
                                          topo.gpus_per_node, work.slots)
                except ValueError as exc:  # e.g. experts that do not split over the ranks
                    rejected.append((c.label, str(exc)))
                    continue
            try:
                p = predict_layer(c, work, topo, prof, stats)
            except KeyError as exc:  # the profile lacks a fit this candidate needs
                rejected.append((c.label, str(exc).strip('"')))
                continue
            m = p.memory
            need = m.weights * num_layers + m.workspace + m.buffers
            if need > budget:
                why = f"needs {need / 2**30:.1f} GiB per rank, budget {budget / 2**30:.1f} GiB"
            else:
                preds.append(p)
        if why is not None:
            rejected.append((c.label, why))
    preds.sort(key=lambda p: p.total_us)
    return Ranked(tuple(preds), tuple(rejected))


def distinct(items) -> tuple[tuple, tuple[int, ...]]:
    """(the distinct items in first-seen order, each item's index into them)."""
    uniq, index = [], []
    for x in items:
        if x not in uniq:
            uniq.append(x)
        index.append(uniq.index(x))
    return tuple(uniq), tuple(index)


def stack_order(ranked, index: tuple[int, ...]) -> list[str]:
    """The labels of the candidates feasible at every distinct layer, least summed predicted
    time over the stack first. ranked: one `Ranked` per distinct routing; index: each layer's
    distinct routing (a uniform stack of one candidate for every layer, as `--plan sweep`
    launches and the simulator's recorded stacks price)."""
    by_label = [{p.candidate.label: p for p in r.preds} for r in ranked]
    common = [c for c in by_label[0] if all(c in b for b in by_label[1:])]
    return sorted(common, key=lambda c: sum(by_label[i][c].total_us for i in index))


def rejections(rejected, most: int = 4) -> str:
    """Why candidates were rejected, one (candidate: reason) per distinct reason (the tp ones
    all say the same), the first `most` of them."""
    seen = {}
    for c, w in rejected:
        seen.setdefault(w, c)
    return "; ".join(f"{c}: {w}" for w, c in list(seen.items())[:most])


def explain(best: LayerPrediction, runner: LayerPrediction | None, rejected=()) -> str:
    """One line: how the pick beats the runner-up, and the stage that separates them."""
    if runner is None:
        extra = f" ({len(rejected)} rejected, e.g. {rejected[0][0]}: {rejected[0][1]})" \
            if rejected else ""
        return f"the only feasible candidate{extra}"
    mine, theirs = _visible_us(best), _visible_us(runner)
    gap = max(mine, key=lambda k: theirs[k] - mine[k])  # where the pick gains the most
    pct = 100 * (runner.total_us / best.total_us - 1)
    head = f"beats {runner.candidate.label} {runner.total_us / 1e3:.3f} ms by {pct:.0f}%"
    if theirs[gap] - mine[gap] < 0.005 * best.total_us:
        return f"{head}: a tie (stages within 0.5%)"
    return f"{head}: {gap} {mine[gap]:.0f} vs {theirs[gap]:.0f} us"


def _visible_us(p: LayerPrediction) -> dict:
    """Each top-level stage's share of the layer's time: an overlapped shared MLP counts only
    what outlasts dispatch -> combine; the layer's calibrated tail is a stage of its own."""
    s = dict(p.stages_us)
    if p.overlap_shared:
        routed = sum(s.get(k, 0.0) for k in ("dispatch", "experts", "combine"))
        s["shared"] = max(0.0, s.get("shared", 0.0) - routed)
    return {**{k: s.get(k, 0.0) for k in TOP_STAGES}, "tail": p.tail_us}


def transition_us(prev: str | None, form: str, case: CommCase) -> float:
    """The runtime's "relayout" stage entering a `form` layer after a `prev` one: ep_dp ->
    tp/ep all-gathers every rank's bf16 rows; replicated -> ep_dp takes a slice (free)."""
    if prev == "ep_dp" and form != "ep_dp":
        return collective_us(case, "all_gather", case.tokens * case.cfg.hidden * 2.0)[0]
    return 0.0


def _runner_up(ranked: Ranked, best: LayerPrediction) -> LayerPrediction | None:
    return next((p for p in ranked.preds if p.candidate != best.candidate), None)


def plan_stack(cfg: MoEConfig, quant: QuantConfig, topo: Topology, prof: HardwareProfile,
               buckets, *, num_layers: int | None = None, routing="uniform", loads_LE=None,
               placement=None, redundant_experts: int = 0, scope: str = "runtime",
               forms=None, backends=None, experts=None, available=None,
               memory_GiB: float | None = None, model: str | None = None) -> Plan:
    """Plan every MoE layer for every bucket (tokens per rank). loads_LE: per-layer recorded
    expert loads (else `routing` for all layers); placement: EPLB placement (anything with
    phy2log [L][slots]); redundant_experts without a placement: slot s holds expert s % E."""
    buckets = tuple(sorted({int(b) for b in buckets}))
    if not buckets or buckets[0] < 1:
        raise ValueError(f"buckets ({buckets}) must be positive token counts per rank")
    layers = num_layers or cfg.num_moe_layers
    e = cfg.num_experts
    budget = None if memory_GiB is None else memory_GiB * 2**30
    cands = candidates(topo.world, forms, backends, experts)
    cache: dict = {}
    stats_cache: dict = {}  # routing statistics do not depend on the token count
    entries: list[list[tuple[int, Choice]]] = [[] for _ in range(layers)]
    num_slots = e + redundant_experts
    for tokens in buckets:
        per_layer = []
        behind = Backlog(prof, False, tokens * cfg.hidden * 2.0)  # as the launch report
        for l in range(layers):
            queued = behind.is_queued()  # behind the layers before: the queued figures
            spec = RoutingSpec.parse(routing) if loads_LE is None else \
                RoutingSpec.from_load(loads_LE[l])
            slots = SlotMap.from_placement(placement, l) if placement is not None else \
                SlotMap(tuple(s % e for s in range(num_slots))) if redundant_experts else None
            if slots is not None:
                num_slots = slots.num_slots
            key = (spec, slots, queued)
            if key not in cache:
                work = Workload(cfg, quant, tokens, spec, slots)
                if (spec, slots) not in stats_cache:
                    try:
                        stats_cache[(spec, slots)] = routing_stats(cfg, spec, topo.world,
                                                                   topo.gpus_per_node, slots)
                    except ValueError:  # slots do not split over the ranks: tp layers only
                        stats_cache[(spec, slots)] = None
                cache[key] = (work, rank_layer(work, topo, behind.profile(l), cands, layers,
                                               scope, available, budget,
                                               stats_cache[(spec, slots)]))
            per_layer.append(cache[key])
            fastest = cache[key][1].preds[:1]  # the backlog after it: as if it ran the fastest
            behind.ran(fastest[0].total_us if fastest else 0.0,
                       fastest[0].candidate.experts if fastest else "",
                       fastest[0].candidate.backend if fastest else "local")
        cache.clear()
        for l, choice in enumerate(_best_path(per_layer, topo, prof)):
            entries[l].append((tokens, choice))
    return Plan(model or cfg.name, quant, topo.to_dict(), prof.name, num_slots, buckets,
                tuple(LayerEntry(l, tuple(c)) for l, c in enumerate(entries)), scope)


def _best_path(per_layer, topo, prof) -> list[Choice]:
    """Shortest path over layers: node cost = layer time, edge cost = layout transition."""
    for l, (work, ranked) in enumerate(per_layer):
        if not ranked.preds:
            first = rejections(ranked.rejected)
            fix = "change --topology, --quant or the memory budget"
            if any(" fit on " in w for _, w in ranked.rejected):  # a link the profile lacks
                fix = f"give a --profile with fits on those links (e.g. a spec one), or {fix}"
            raise ValueError(f"layer {l}: no candidate is feasible on {topo.describe()} "
                             f"({first}); {fix}")
    case = CommCase(per_layer[0][0].cfg, per_layer[0][0].quant, topo, prof, None,
                    per_layer[0][0].tokens, per_layer[0][0].tokens)
    best = {p.candidate: (p.total_us, [p]) for p in per_layer[0][1].preds}
    for _, ranked in per_layer[1:]:
        nxt = {}
        for p in ranked.preds:
            nxt[p.candidate] = min(
                ((cost + transition_us(prev.form, p.candidate.form, case) + p.total_us,
                  path + [p]) for prev, (cost, path) in best.items()), key=lambda x: x[0])
        best = nxt
    _, path = min(best.values(), key=lambda x: x[0])
    out, prev = [], None
    for (_, ranked), p in zip(per_layer, path):
        tr = transition_us(prev, p.candidate.form, case)
        r = _runner_up(ranked, p)
        out.append(Choice(p.candidate.form, p.candidate.backend, p.candidate.experts,
                          p.total_us + tr, {**p.stages_us, "relayout": tr},
                          explain(p, r, ranked.rejected),
                          None if r is None else r.candidate.label,
                          None if r is None else r.total_us, tr))
        prev = p.candidate.form
    return out
