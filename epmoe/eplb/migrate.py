"""Moving expert weights between ranks when the placement changes.

Every rank holds the contiguous slot block [rank*S, (rank+1)*S). Given the old and new
`phy2log` of a layer, a slot whose logical expert changes needs that expert's bytes: from a
local slot that holds it already (a copy), else from the lowest rank that held it before (a
receive). All ranks derive the same plan from the same placements; the transfers of a layer
go as one `batch_isend_irecv` (gloo and NCCL; fp8 travels as raw bytes). Quantization scales
move with their weights.

Two halves: `stage_layers` fills staging buffers with the new contents of this rank's changed
slots (the weights in use are only read, so steps may run meanwhile) and verifies them: every
slot's checksum (staged or unchanged) must equal its logical expert's pre-migration checksum,
else it raises (a stale or corrupt slot). `apply_staged` then copies the staging buffers in.
`migrate_layer` is both at once for one layer (the synchronous mode: staging memory is one
layer's changed slots); the asynchronous mode stages every layer in one call (one all-gather
and one batch of transfers; staging memory is every changed slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe.comm.wire import as_wire
from epmoe.experts.base import ExpertWeights
from epmoe.peers import wait_works


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


def bytes_to_move(old_LR: list[list[int]], new_LR: list[list[int]], node_of_rank,
                  slot_bytes: float) -> tuple[list[int], list[int], int]:
    """Per rank, the bytes it receives from its own node and from other nodes when every layer
    goes from old_LR to new_LR (slot_bytes: one slot's weights), and the slots that change."""
    world, b = len(node_of_rank), int(round(slot_bytes))
    intra, inter, slots = [0] * world, [0] * world, 0
    for old_R, new_R in zip(old_LR, new_LR, strict=True):
        for t in plan_migration(old_R, new_R, world):
            slots += 1
            if t.src != t.dst:
                (intra if node_of_rank[t.src] == node_of_rank[t.dst] else inter)[t.dst] += b
    return intra, inter, slots


def slot_tensors(w: ExpertWeights) -> list[torch.Tensor]:
    """Per-slot tensors (leading dim = local slot) that define an expert: data, scales and
    biases (gpt-oss)."""
    ts = [w.w13.data, w.w2.data]
    ts += [t for t in (w.w13.scale, w.w2.scale, w.b13, w.b2) if t is not None]
    return ts


def checksum_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """int64 [n]: a position-weighted sum of each row's 32-bit words (bytes where a row is not
    a whole number of words) over all tensors; exact, and any changed word changes it."""
    n = tensors[0].shape[0]
    out = torch.zeros(n, dtype=torch.long, device=tensors[0].device)
    for t in tensors:
        b = as_wire(t).reshape(n, -1).view(torch.uint8)
        b = (b.view(torch.int32) if b.shape[1] % 4 == 0 else b).long()
        pos = torch.arange(1, b.shape[1] + 1, device=b.device) % 65521
        out += (b * pos).sum(1) + b.sum(1) * 31
    return out


def slot_checksums(w: ExpertWeights) -> torch.Tensor:
    """int64 [S]: `checksum_rows` of every local slot's data and scales."""
    return checksum_rows(slot_tensors(w))


@dataclass(frozen=True)
class StagedLayer:
    """This rank's changed slots of one layer, filled and verified, not yet applied.

    local_slots    local index of each changed slot
    rows           per changed slot, its tensors (as `slot_tensors` lists them) in wire dtype
    num_transfers  transfers of the layer's plan (all ranks)
    """

    local_slots: tuple[int, ...]
    rows: tuple[tuple[torch.Tensor, ...], ...]
    num_transfers: int


def stage_layers(ws: list[ExpertWeights], old_LR: list[list[int]], new_LR: list[list[int]],
                 rank: int, world: int, group=None) -> list[StagedLayer]:
    """Fill and verify this rank's changed slots of the given layers; the weights are only
    read. One all-gather of checksums and one batch of point-to-point transfers for all the
    layers that change (collective over `group`: every rank passes the same placements)."""
    plans = [plan_migration(o, n, world) for o, n in zip(old_LR, new_LR)]
    moving = [l for l, p in enumerate(plans) if p]
    out = [StagedLayer((), (), 0) for _ in plans]
    if not moving:
        return out
    per = len(old_LR[0]) // world
    base = rank * per
    # checksums of every slot before, gathered so each rank can verify what it received
    mine = torch.stack([slot_checksums(ws[l]) for l in moving])  # [M, S]
    if world > 1:
        all_sums = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(all_sums, mine, group=group)
        before = torch.cat(all_sums, 1).cpu()  # [M, R]
    else:
        before = mine.cpu()
    staged: list[dict[int, list[torch.Tensor]]] = [{} for _ in moving]
    ops = []
    for m, l in enumerate(moving):
        tensors = slot_tensors(ws[l])
        for t in plans[l]:
            if t.src == rank and t.dst != rank:
                for x in tensors:
                    ops.append(dist.P2POp(dist.isend, as_wire(x[t.src_slot - base]).clone(),
                                          t.dst, group))
            if t.dst == rank:
                if t.src == rank:
                    staged[m][t.dst_slot - base] = [as_wire(x[t.src_slot - base]).clone()
                                                    for x in tensors]
                else:
                    bufs = [torch.empty_like(as_wire(x[0])) for x in tensors]
                    staged[m][t.dst_slot - base] = bufs
                    for b in bufs:
                        ops.append(dist.P2POp(dist.irecv, b, t.src, group))
    if ops:
        wait_works(dist.batch_isend_irecv(ops))
    for m, l in enumerate(moving):
        local = tuple(sorted(staged[m]))
        after = mine[m].cpu().clone()  # unchanged slots keep their bytes
        if local:
            rows = [torch.stack([staged[m][i][j] for i in local])
                    for j in range(len(staged[m][local[0]]))]
            after[list(local)] = checksum_rows(rows).cpu()
        _verify(after, before[m], old_LR[l], new_LR[l], rank, base)
        out[l] = StagedLayer(local, tuple(tuple(staged[m][i]) for i in local), len(plans[l]))
    return out


def _verify(after_S, before_R, old_R, new_R, rank, base) -> None:
    """Every local slot must carry its new logical expert's pre-migration checksum."""
    first = {}
    for s, e in enumerate(old_R):
        first.setdefault(e, s)
    for i in range(after_S.shape[0]):
        e = new_R[base + i]
        if e not in first or int(after_S[i]) != int(before_R[first[e]]):
            raise RuntimeError(f"rank {rank} slot {base + i}: checksum after migration does not "
                               f"match logical expert {e} (stale or corrupt slot)")


def apply_staged(w: ExpertWeights, staged: StagedLayer) -> None:
    """Copy the staged slots into the weights in use (in place, on the current stream; a
    buffer staged on a side stream is marked used here so the allocator keeps it until then)."""
    tensors = slot_tensors(w)
    for i, row in zip(staged.local_slots, staged.rows):
        for x, v in zip(tensors, row):
            if v.is_cuda:
                v.record_stream(torch.cuda.current_stream(v.device))
            x[i].copy_(v.view(x.dtype).view(x[i].shape))


def migrate_layer(w: ExpertWeights, old_R: list[int], new_R: list[int], rank: int, world: int,
                  group=None) -> int:
    """Apply one layer's migration in place on this rank's weights; returns the transfers of
    the layer's plan (all ranks)."""
    (staged,) = stage_layers([w], [old_R], [new_R], rank, world, group)
    apply_staged(w, staged)
    return staged.num_transfers
