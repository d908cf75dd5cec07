"""A sweep point's MoE stack layer by layer: routings that differ per layer (a run's recorded
load), the pick over the whole stack, and the step composed as the runtime runs it.

A sweep's routing entry is `uniform`, `zipf:S`, one per-expert load vector (every layer
alike), or a file of recorded load (epmoe/plan/recorded.py: a launch summary's
`load.tokens_per_layer_expert`, a bare JSON list per layer, or a routing trace). A file's
layers are priced each at its own load; a file of one layer stands for every layer. Loads
are per logical expert, so one run's record prices any EP size; an EPLB run's placement is
for its own size and is not used (a sweep places replicas itself: `redundant_per_rank`, per
layer at each point's size).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from epmoe.plan.backlog import Backlog
from epmoe.plan.cost import predict_layer
from epmoe.plan.planner import distinct, stack_order
from epmoe.plan.recorded import is_recorded, read_recorded
from epmoe.plan.routing import RoutingSpec


@dataclass(frozen=True)
class StackRouting:
    """label: the rows' routing column; specs: one per MoE layer, or one for every layer."""

    label: str
    specs: tuple

    def distinct(self) -> tuple[tuple, tuple[int, ...]]:
        """(the distinct specs, each layer's index into them)."""
        return distinct(self.specs)


def stack_routing(entry, cfg, key: str = "routing") -> StackRouting:
    """A sweep routing entry for a stack of cfg.num_moe_layers layers of cfg.num_experts
    experts; ValueError naming what does not fit. key: the sweep key that gave it."""
    where = f"sweep {key}"
    if isinstance(entry, str) and is_recorded(entry):
        rec = read_recorded(entry, where, cfg.num_experts)
        loads = rec.fitted(cfg.num_experts, cfg.num_moe_layers, f"{where} {entry}",
                           fix=f"record the whole stack, or one layer (it stands for all), "
                               f"or set layers = {rec.layers}")
        # (a one-layer record stays one spec: StackRouting's "one for every layer")
        specs = tuple(RoutingSpec.from_load(row) for row in loads[:rec.layers])
        return StackRouting("rec:" + Path(entry).stem, specs)
    try:
        spec = RoutingSpec.parse(entry)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if spec.kind == "load" and len(spec.load) != cfg.num_experts:
        hint = ("; routing is a list of specs (a load vector is one list inside it)"
                if key == "routing" else "")
        raise ValueError(f"{where} {entry!r}: a recorded load has one entry per expert "
                         f"({cfg.num_experts}), it has {len(spec.load)}{hint}")
    return StackRouting(spec.label(), (spec,))


def layer_pairs(priced: StackRouting, placed: StackRouting | None,
                layers: int) -> tuple[tuple, tuple[int, ...]]:
    """(the distinct (priced spec, spec the replicas are placed for) pairs, each layer's index
    into them); placed None: each layer's replicas placed for its own load. One pair for every
    layer when both routings are one spec for every layer."""
    if placed is None:
        specs, index = priced.distinct()
        return tuple((s, s) for s in specs), index
    if len(priced.specs) == len(placed.specs) == 1:
        return ((priced.specs[0], placed.specs[0]),), (0,)

    def at(r: StackRouting, l: int):
        return r.specs[l if len(r.specs) > 1 else 0]

    return distinct([(at(priced, l), at(placed, l)) for l in range(layers)])


def stack_pick(ranked: list, index: tuple[int, ...]):
    """The candidate feasible at every distinct layer with the least summed time over the
    stack, as its prediction per layer; None when no candidate runs every layer. ranked: one
    `Ranked` per distinct routing; index: each layer's distinct routing."""
    order = stack_order(ranked, index)
    if not order:
        return None
    return [next(p for p in ranked[i].preds if p.candidate.label == order[0]) for i in index]


def stack_layers_us(layers: list, topo, prof) -> float:
    """A step of `layers` [(prediction on an idle GPU, workload, routing stats)] as the launch
    report composes one (plan/backlog.py): the first as on an idle GPU, each later one from the
    profile's queued figures while the GPU runs behind the host (a profile without them: the
    sum of the idle predictions)."""
    work = layers[0][1]
    behind = Backlog(prof, False, work.tokens * work.cfg.hidden * 2.0)
    if not behind.differs:
        return sum(p.total_us for p, _, _ in layers)
    total, queued = 0.0, {}
    for p0, w, stats in layers:
        p = p0
        if behind.is_queued():
            key = id(p0)
            if key not in queued:
                queued[key] = predict_layer(p0.candidate, w, topo, behind.queued, stats)
            p = queued[key]
        behind.ran(p.total_us, p0.candidate.experts)
        total += p.total_us
    return total
