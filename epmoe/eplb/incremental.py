"""Incremental re-placement: adapt an old placement to a new load, moving few slots."""

from __future__ import annotations

import numpy as np

from epmoe.eplb.packing import greedy_counts, lpt
from epmoe.eplb.placement import Placement, as_f64, counts, gpu_loads, max_load
from epmoe.eplb.policy import rebalance, validate


def rebalance_incremental(weight_LE, old: Placement, num_groups: int, num_nodes: int,
                          num_gpus: int, mode: str) -> tuple[Placement, int]:
    """Re-place for a new load, moving few slots; returns (placement, number of slots changed).

    Per layer (per layer and node in hierarchical mode, where the old placement must keep every
    group on one node and then each node is re-placed on its own, so groups stay put): target
    counts are the greedy ones, unless the old counts reach the same max replica load (then they
    stay). A slot keeps its expert while that expert still needs the replica (the copies on the
    least-loaded GPUs stay); freed slots take the missing replicas, heaviest first, onto the
    least-loaded GPU with a free slot. A row whose max GPU load would not drop keeps its old
    placement, so no layer's max GPU load rises. Not bound to be as good as `rebalance`.
    """
    w = as_f64(weight_LE)
    if old.num_gpus != num_gpus:
        raise ValueError(f"num_gpus ({num_gpus}) must equal old.num_gpus ({old.num_gpus}): "
                         f"an incremental rebalance keeps the GPU count")
    if tuple(w.shape) != (old.num_layers, old.num_experts):
        raise ValueError(f"weight_LE shape {tuple(w.shape)} must be (num_layers, num_experts) "
                         f"= {(old.num_layers, old.num_experts)} of the old placement")
    validate(w, old.num_slots, num_groups, num_nodes, num_gpus, mode)
    L, E = w.shape
    old_p = old.phy2log.numpy()
    if mode == "global":
        new_p = _incremental_rows(w, old_p, num_gpus)
    else:
        bad = np.flatnonzero(~old.groups_on_nodes(num_groups, num_nodes).numpy())
        if bad.size:
            raise ValueError(f"the old placement splits expert groups over nodes in layers "
                             f"{bad.tolist()}: a hierarchical incremental rebalance keeps "
                             f"groups where they are; run a full rebalance(mode='hierarchical')")
        new_p = _per_node(w, old_p, num_nodes, num_gpus)
    if (new_p == old_p).all():
        return old, 0
    return Placement.from_phy2log(new_p, E, num_gpus), int((new_p != old_p).sum())


def next_placement(weight_LE, old: Placement, num_groups: int, num_nodes: int, num_gpus: int,
                   mode: str, slack: float) -> tuple[Placement, str]:
    """What a rebalance places for `weight_LE` [L, E] coming from `old`: (placement, "full" or
    "incremental"). The incremental one (fewer slots move) when its mean balancedness is
    within `slack` of the full one's (hierarchical mode: only while the old placement keeps
    every group on one node)."""
    new = rebalance(weight_LE, old.num_slots, num_groups, num_nodes, num_gpus, mode)
    if mode == "global" or old.groups_on_nodes(num_groups, num_nodes).all():
        incr, _ = rebalance_incremental(weight_LE, old, num_groups, num_nodes, num_gpus, mode)
        if float(incr.balancedness(weight_LE).mean()) >= \
                float(new.balancedness(weight_LE).mean()) - slack:
            return incr, "incremental"
    return new, "full"


def _per_node(w, old_p, num_nodes, num_gpus):
    """Each node's rows on their own, in node-local expert ids."""
    L, E = w.shape
    R, En = old_p.shape[1], E // num_nodes
    slots_LNS = old_p.reshape(L, num_nodes, R // num_nodes)
    present = np.zeros((L, num_nodes, E), bool)
    present[np.arange(L)[:, None, None], np.arange(num_nodes)[None, :, None], slots_LNS] = True
    experts_LNX = np.argsort(~present, axis=-1, kind="stable")[..., :En]  # ascending ids
    local = np.zeros((L, num_nodes, E), np.int64)
    np.put_along_axis(local, experts_LNX, np.broadcast_to(np.arange(En), experts_LNX.shape), -1)
    w_B = np.take_along_axis(w[:, None, :], experts_LNX, -1).reshape(L * num_nodes, En)
    old_B = np.take_along_axis(local, slots_LNS, -1).reshape(L * num_nodes, -1)
    new_B = _incremental_rows(w_B, old_B, num_gpus // num_nodes)
    return np.take_along_axis(experts_LNX, new_B.reshape(L, num_nodes, -1), -1).reshape(L, R)


def _incremental_rows(w, old_p, num_gpus):
    B, E = w.shape
    R = old_p.shape[1]
    S = R // num_gpus
    old_cnt = counts(old_p, E)
    cnt, _ = greedy_counts(w, R)
    keep_old = (w / old_cnt).max(1) <= (w / cnt).max(1) * (1 + 1e-12)
    cnt = np.where(keep_old[:, None], old_cnt, cnt)
    # keep a slot while its expert still needs the copy; copies on light GPUs first
    gpu_load = gpu_loads(w, old_p, cnt, num_gpus)  # kept slots carry the new per-copy load
    slot_load = np.repeat(gpu_load, S, axis=1)
    order = np.lexsort((slot_load, old_p), axis=-1)  # by expert, then GPU load
    e_sorted = np.take_along_axis(old_p, order, 1)
    start = np.cumsum(old_cnt, 1) - old_cnt
    occ = np.empty_like(old_p)
    np.put_along_axis(occ, order, np.arange(R)[None, :] - np.take_along_axis(start, e_sorted, 1), 1)
    keep = occ < np.take_along_axis(cnt, old_p, 1)
    per_copy = w / cnt
    kept_load = np.where(keep, np.take_along_axis(per_copy, old_p, 1), 0.0)
    bin_load = kept_load.reshape(B, num_gpus, S).sum(-1)
    bin_free = (~keep).reshape(B, num_gpus, S).sum(-1)
    has = counts((np.arange(R) // S * E + old_p).reshape(B, R), num_gpus * E, keep)
    has = has.reshape(B, num_gpus, E)
    # the missing replicas, heaviest first, padded to the same count per row
    need = cnt - counts(old_p, E, keep)
    num_new = need.sum(1)
    N = int(num_new.max())
    if N == 0:
        return old_p
    items_e = np.zeros((B, N), np.int64)
    items_valid = np.arange(N)[None, :] < num_new[:, None]
    items_e[items_valid] = np.repeat(np.tile(np.arange(E), B), need.ravel())
    items_load = np.where(items_valid, np.take_along_axis(per_copy, items_e, 1), -1.0)
    o = np.argsort(-items_load, axis=1, kind="stable")
    items_e, items_load = np.take_along_axis(items_e, o, 1), np.take_along_axis(items_load, o, 1)
    items_valid = np.take_along_axis(items_valid, o, 1)
    gpu_BN, _ = lpt(items_load, items_e, bin_load, bin_free, has, valid_BN=items_valid)
    new_p = old_p.copy()
    for b in range(B):  # match each row's new replicas to its free slots, GPU by GPU
        free_slots = np.flatnonzero(~keep[b])  # ascending, hence grouped by GPU
        v = items_valid[b]
        new_p[b, free_slots] = items_e[b, v][np.argsort(gpu_BN[b, v], kind="stable")]
    better = max_load(w, new_p, num_gpus, cnt) < max_load(w, old_p, num_gpus, old_cnt)
    return np.where(better[:, None], new_p, old_p)
