"""Cost-aware rebalancing: is a new placement worth the bytes it moves?

Model: the part of a step that follows the load, on the busiest GPU, costs mean_l / b_l in
layer l for balancedness b_l (mean/max GPU load) and equal means across layers, so

    follows after = follows now x sum_l 1/b_new_l / sum_l 1/b_old_l
    gain per step = follows now - follows after

`follows now` is the slowest rank's measured time per step in the stages that follow its
load (`follows_load`: the experts, and with a backend that brings each token's rows to its
experts' ranks also dispatch and combine, which move the hottest rank's rows; the runtime's
stage timer, the simulator's cost model), or the whole step where none was measured. Against
the cost model's own gain from a move (BENCHMARKS.md 52) that credits 1.0-1.3x with all2all
and DeepEP and 1.1-1.4x with allgather, where the whole step credited up to 3.5x and the
experts alone as little as 0.2x.

The move occupies the links for move_ms = max over ranks of (bytes received from its own node
/ intra-node bandwidth + bytes from other nodes / inter-node bandwidth); in sync mode the steps
stall that long, in async mode the steps keep the old placement until the bytes have landed
(ceil(move_ms / step time) steps, at least one). Rebalance when

    sync:  gain per step x steps until the next rebalance                     > move_ms
    async: gain per step x (steps until the next rebalance - steps to land)   > move_ms

(in async mode the move still borrows move_ms of link time from the steps' dispatch/combine).
The link figures leave out what a move also costs (checksumming every slot, the collectives'
fixed costs, a loaded host), so once a run has moved weights the next move is costed at
move_ms x (the last move's measured time / its link time): the run's own figure.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Default link bandwidths (GB/s per direction, usable), used when no figure is given:
NVLINK_GBPS = 150.0  # intra-node: H800-class NVLink (DeepEP's README measures ~155-160 GB/s)
RDMA_GBPS = 40.0  # inter-node: one 400 Gb/s NIC per GPU (~50 GB/s line rate, ~40 usable)


# Comm backends that bring a token's rows to its experts' ranks: their dispatch and combine move
# the hottest rank's rows, so they follow its load with the experts. The others (allgather:
# every rank gets every row; local) move the same bytes whatever the placement.
ROUTED_TO_EXPERTS = ("all2all", "deepep-ht", "deepep-ll", "symm-ht", "symm-ll", "deepep-v2")


def follows_load(backend: str) -> tuple[str, ...]:
    """The stages of a layer on `backend` whose time follows the hottest rank's load."""
    return ("dispatch", "experts", "combine") if backend in ROUTED_TO_EXPERTS else ("experts",)


def measured_follows_ms(stage_ms: dict[str, list[float]], where: dict[str, list[tuple]],
                        backends: list[str]) -> float | None:
    """A rank's time per step in the stages that follow its load (`follows_load` of each
    layer's backend), median over the steps its stage timer holds; stage_ms / where: the
    timer's times and (step, layer) tags per stage; None: none timed."""
    per_step: dict = {}
    for l, backend in enumerate(backends):
        for stage in follows_load(backend):
            for v, (step, layer) in zip(stage_ms.get(stage, ()), where.get(stage, ()),
                                        strict=True):
                if layer == l:
                    per_step[step] = per_step.get(step, 0.0) + v
    return statistics.median(per_step.values()) if per_step else None


@dataclass(frozen=True)
class MigrationLinks:
    """What the moved weights run at, GB/s per direction: inside a node / between nodes, and
    where the figures came from (the launcher: its profile's all_to_all fits on the run's
    topology; else DeepEP-class defaults)."""

    intra_gbps: float = NVLINK_GBPS
    inter_gbps: float = RDMA_GBPS
    source: str = "default figures (H800-class NVLink, one 400 Gb/s NIC)"

    def __post_init__(self):
        for name in ("intra_gbps", "inter_gbps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"migration links: {name} ({v!r}) must be a finite GB/s > 0")


@dataclass(frozen=True)
class Decision:
    """Whether to apply a new placement, and the numbers behind it."""

    rebalance: bool
    reason: str
    gain_ms: float  # predicted step time saved until the next rebalance
    move_ms: float  # link time the move takes (the stall in sync mode)
    bytes_moved: int  # the most bytes any rank receives
    intra_gbps: float
    inter_gbps: float
    links_source: str = ""  # where intra_gbps / inter_gbps came from
    link_ms: float = 0.0  # the move's time on the links alone (move_ms / the move scale)

    def summary(self) -> dict:
        return dict(decision="rebalance" if self.rebalance else "skip", reason=self.reason,
                    gain_ms=self.gain_ms, move_ms=self.move_ms, bytes_moved=self.bytes_moved,
                    intra_gbps=self.intra_gbps, inter_gbps=self.inter_gbps,
                    links_source=self.links_source, link_ms=self.link_ms)


def decide(step_ms: float, inv_bal_old: float, inv_bal_new: float, steps_until_next: int,
           recv_intra_bytes: list[int], recv_inter_bytes: list[int], migration: str,
           link_gbps: float | None = None, links: MigrationLinks | None = None,
           move_scale: float | None = None, follows_ms: float | None = None) -> Decision:
    """inv_bal_*: sum over layers of 1 / balancedness; recv_*_bytes: per rank, bytes it
    receives from its own node / from other nodes; links: the run's link figures (None: the
    defaults); link_gbps (one figure for both) overrides them; move_scale: how much longer
    than its link time the run's last move took (its checksums, collectives' fixed costs, a
    loaded host: measured, so the next move is costed as moves cost here; None: 1);
    follows_ms: the ms of a step that follow the hottest rank's load (`follows_load`; None or
    0: the whole step)."""
    links = links or MigrationLinks()
    intra = links.intra_gbps if link_gbps is None else link_gbps
    inter = links.inter_gbps if link_gbps is None else link_gbps
    source = links.source if link_gbps is None else "one figure given (eplb_link_gbps)"
    link_ms = max((a / intra + b / inter) / 1e6 for a, b in zip(recv_intra_bytes,
                                                               recv_inter_bytes))
    move_ms = link_ms * (move_scale or 1.0)
    moved = max(a + b for a, b in zip(recv_intra_bytes, recv_inter_bytes))
    follows = min(follows_ms, step_ms) if follows_ms and step_ms > 0 else step_ms
    per_step = follows * (1 - inv_bal_new / inv_bal_old) if inv_bal_old > 0 else 0.0
    if migration == "async":
        land = max(1, math.ceil(move_ms / step_ms)) if step_ms > 0 else 1
        gain = per_step * max(0, steps_until_next - land)
        horizon = f"{steps_until_next} steps - {land} to land"
    else:
        gain = per_step * steps_until_next
        horizon = f"{steps_until_next} steps"
    link = (f"{moved / 1e6:.2f} MB at {intra:.3g}/{inter:.3g} GB/s intra/inter node = "
            f"{link_ms:.3f} ms")
    if move_scale:
        link += f" x {move_scale:.3g} (the last move, measured) = {move_ms:.3f} ms"
    if per_step <= 0:
        return Decision(False, f"no predicted gain (balancedness would not improve); move "
                               f"{link}", gain, move_ms, moved, intra, inter, source, link_ms)
    ok = gain > move_ms
    part = f" (of {follows:.3f} ms a step that follow the load)" if follows != step_ms else ""
    why = (f"gain {per_step:.3f} ms/step{part} x {horizon} = {gain:.3f} ms "
           f"{'>' if ok else '<='} move {link}")
    return Decision(ok, why, gain, move_ms, moved, intra, inter, source, link_ms)
