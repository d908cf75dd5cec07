"""Moving expert weights between ranks when the placement changes.

Every rank holds the contiguous slot block [rank*S, (rank+1)*S). Given the old and new
`phy2log` of a layer, a slot whose logical expert changes needs that expert's bytes: from a
local slot that holds it already (a copy), else from the lowest rank that held it before (a
receive). All ranks derive the same plan from the same placements; the transfers of a layer
go as one `batch_isend_irecv` (gloo and NCCL; fp8 travels as raw bytes). Quantization scales
move with their weights. Afterwards every slot's checksum must equal its logical expert's
pre-migration checksum: a mismatch (a stale or corrupt slot) raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe.comm.wire import as_wire
from epmoe.experts.base import ExpertWeights


@dataclass(frozen=True)
class Transfer:
    """Weights of logical `expert` go from slot `src_slot` (rank src) to `dst_slot` (rank dst)."""

    expert: int
    src_slot: int
    dst_slot: int
    src: int
    dst: int


def plan_migration(old_R: list[int], new_R: list[int], world: int) -> list[Transfer]:
    """Transfers for one layer (same on every rank). Unchanged slots never move."""
    if len(old_R) != len(new_R) or len(old_R) % world:
        raise ValueError(f"placements must have equal slot counts divisible by world "
                         f"({len(old_R)}, {len(new_R)}, world {world})")
    per = len(old_R) // world
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(old_R):
        holders.setdefault(e, []).append(s)
    out = []
    for s, (o, n) in enumerate(zip(old_R, new_R)):
        if o == n:
            continue
        if n not in holders:
            raise ValueError(f"logical expert {n} has no replica in the old placement: cannot "
                             f"source its weights")
        dst = s // per
        local = [h for h in holders[n] if h // per == dst]
        src_slot = local[0] if local else holders[n][0]
        out.append(Transfer(n, src_slot, s, src_slot // per, dst))
    return out


def _tensors(w: ExpertWeights) -> list[torch.Tensor]:
    """Per-slot tensors (leading dim = local slot) that define an expert: data and scales."""
    ts = [w.w13.data, w.w2.data]
    ts += [t for t in (w.w13.scale, w.w2.scale) if t is not None]
    return ts


def slot_checksums(w: ExpertWeights) -> torch.Tensor:
    """int64 [S]: a position-weighted byte sum per local slot over all its tensors (exact)."""
    s = w.num_experts
    out = torch.zeros(s, dtype=torch.long, device=w.w13.data.device)
    for t in _tensors(w):
        b = as_wire(t).reshape(s, -1).view(torch.uint8).long()
        pos = torch.arange(1, b.shape[1] + 1, device=b.device) % 65521
        out += (b * pos).sum(1) + b.sum(1) * 31
    return out


def migrate_layer(w: ExpertWeights, old_R: list[int], new_R: list[int], rank: int, world: int,
                  group=None) -> int:
    """Apply one layer's migration in place on this rank's weights; returns slots changed."""
    per = len(old_R) // world
    base = rank * per
    transfers = plan_migration(old_R, new_R, world)
    if not transfers:
        return 0
    # checksums of every slot before, gathered so each rank can verify what it received
    mine = slot_checksums(w)
    if world > 1:
        all_sums = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(all_sums, mine, group=group)
        before = torch.cat(all_sums).cpu()
    else:
        before = mine.cpu()
    tensors = _tensors(w)
    # snapshot local sources first: a slot may be both a source and a destination
    staged = {}
    ops = []
    recv_bufs = []
    for t in transfers:
        if t.src == rank and t.dst != rank:
            for x in tensors:
                ops.append(dist.P2POp(dist.isend, as_wire(x[t.src_slot - base]).clone(),
                                      t.dst, group))
        if t.dst == rank:
            if t.src == rank:
                staged[t.dst_slot] = [x[t.src_slot - base].clone() for x in tensors]
            else:
                bufs = [torch.empty_like(as_wire(x[0])) for x in tensors]
                recv_bufs.append((t.dst_slot, bufs))
                for b in bufs:
                    ops.append(dist.P2POp(dist.irecv, b, t.src, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for dst_slot, vals in staged.items():
        for x, v in zip(tensors, vals):
            x[dst_slot - base].copy_(v)
    for dst_slot, bufs in recv_bufs:
        for x, b in zip(tensors, bufs):
            x[dst_slot - base].copy_(b.view(x.dtype).view(x[0].shape))
    after = slot_checksums(w).cpu()
    for i in range(per):
        want = before[old_R.index(new_R[base + i])] if new_R[base + i] in old_R else None
        if want is None or int(after[i]) != int(want):
            raise RuntimeError(f"rank {rank} slot {base + i}: checksum after migration does not "
                               f"match logical expert {new_R[base + i]} (stale or corrupt slot)")
    return sum(1 for t in transfers)
