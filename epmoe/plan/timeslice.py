"""CPU ranks that outnumber their node's cores: where the time-slicing lands in the stages.

A rank waits in its collectives on a socket (gloo), giving its core to another rank, so between
two collectives every rank on a node computes on a core it shares with f - 1 others
(f = ranks / cores, `Topology.oversubscription`), in the scheduler's round robin of slices of
q us. Take one stretch of compute of w us (alone) that every rank starts when a collective
releases them all:

- it runs its first min(w, q) us uninterrupted and is preempted after every slice beyond:
  measured, it takes w + (f - 1) max(0, w - q), the preemptions falling on the stages that run
  after its first slice;
- the ranks queued behind others' first slices: rank i of a core starts i min(w, q) us late,
  inside the collective it is returning from (its call returns when it gets the core), and
  enters the next collective (f - 1 - i) min(w, q) us before the last rank does; over the
  ranks that is (f - 1) min(w, q) / 2 on the collective before the stretch and as much on
  the one after it;
- a collective's own work is done by every rank at once: f times its time alone.

Every stretch thus costs f w in all and the layer f times its time alone, as before; what
changes is which stages the time-slicing shows in. The slice is the profile's measured one
(`sched_slice_us`, `python -m epmoe.bench.sched_slice`: 4 ms on the development box, its
tick); without one, Linux's default: EEVDF's base slice, 0.75 ms x (1 + log2(min(cpus, 8)))
(kernel/sched/fair.c, `sysctl_sched_base_slice` scaled by `get_update_sysctl_factor`), 1.5 ms
on 2 CPUs, 3 ms from 8, which a kernel rounds up to its tick.
"""

from __future__ import annotations

import math

# the layer's stages in the order a CPU rank runs them (layer.py: no side stream on CPU);
# "tail" is the layer's measured remainder after its stages (cost._tail_us)
ORDER = ("relayout", "norm", "router", "dispatch", "experts", "combine", "shared", "all_reduce",
         "tail", "residual")
EXPERT_STAGES = ("experts.permute", "experts.gemm1", "experts.act_quant", "experts.gemm2",
                 "experts.gather")


def base_slice_us(cores: int) -> float:
    """Linux's default scheduler slice on a node of `cores` CPUs."""
    return 750.0 * (1 + int(math.log2(min(max(cores, 1), 8))))


def _leaves(st: dict[str, float]) -> list[str]:
    """The stages in run order, "experts" split into its kernels (its own remainder last)."""
    out = []
    for s in ORDER:
        if s == "experts" and any(st.get(c, 0.0) for c in EXPERT_STAGES):
            out += [c for c in EXPERT_STAGES if c in st] + ["experts.rest"]
        elif s in st:
            out.append(s)
    return out


def time_sliced(stages_us: dict[str, float], tail_us: float, f: float, slice_us: float,
                blocking: set[str]) -> tuple[dict[str, float], float]:
    """(stages, tail) of one layer on ranks time-slicing a core f ways (see the module
    docstring): the compute between two `blocking` stages (collectives) stretched past its first
    slice, the blocking stages f times their own time plus the queueing of the compute next to
    them. Without a blocking stage every stage stretches by f. Their sum is f times the input's
    (parents re-summed; "dispatch.quantize" grows as its "dispatch" does, f-fold when that is a
    collective)."""
    st = {**stages_us, "tail": tail_us}
    kids = sum(st.get(c, 0.0) for c in EXPERT_STAGES)
    st["experts.rest"] = max(0.0, st.get("experts", 0.0) - kids)
    seq = _leaves(st)
    ends = [i for i, s in enumerate(seq) if s in blocking and st[s] > 0]
    if f <= 1 or not ends:
        out = {s: v * max(f, 1.0) for s, v in stages_us.items()}
        return out, tail_us * max(f, 1.0)
    out = {s: st[s] * f for s in seq if s in blocking}
    n = len(seq)
    for j, b in enumerate(ends):  # the compute after blocking stage b, up to the next one
        nxt = ends[(j + 1) % len(ends)]
        run = [seq[(b + 1 + i) % n] for i in range((nxt - b - 1) % n)]
        t = 0.0
        for s in run:
            a, t = t, t + st[s]
            out[s] = st[s] + (f - 1) * max(0.0, t - max(a, slice_us))
        queued = (f - 1) * min(t, slice_us) / 2
        out[seq[b]] += queued
        out[seq[nxt]] += queued
    if stages_us.get("dispatch.quantize"):  # the dispatch's own work, before its collective
        d = st["dispatch"]
        grow = f if "dispatch" in blocking or not d else out["dispatch"] / d
        out["dispatch.quantize"] = stages_us["dispatch.quantize"] * grow
    if "experts.rest" in seq:
        out["experts"] = sum(out[s] for s in EXPERT_STAGES if s in out) + out.pop("experts.rest")
    tail = out.pop("tail", tail_us * f)
    return {s: out.get(s, v * f) for s, v in stages_us.items()}, tail


__all__ = ["ORDER", "base_slice_us", "time_sliced"]
