"""Expert replica placement: which logical expert each physical slot holds, per MoE layer.

`rebalance(weight_LE, num_replicas, ...)` turns per-expert load statistics into a `Placement`:
replica counts (every logical expert >= 1 replica, `num_replicas` slots in all) and an
assignment of replicas to GPUs (`num_replicas // num_gpus` slots each; slot s lives on GPU
s // slots_per_gpu). The objective is the max GPU load, a replica carrying load w_e / cnt_e.

Policies (decision table):

| policy         | replica counts                  | packing onto GPUs                           |
|----------------|---------------------------------|---------------------------------------------|
| "hierarchical" | groups -> nodes, then per node  | per node: LPT + swap refinement             |
| "global"       | greedy max(w/cnt) over layer    | LPT onto least-loaded GPU + swap refinement |
| "auto"         | per layer, the best of global, hierarchical (if valid) and DeepSeek EPLB  |

`deepseek_rebalance` reimplements DeepSeek EPLB (hierarchical when num_groups % num_nodes == 0,
else global) and is the baseline: "auto" takes it as one candidate, so its max GPU load is
never higher, layer by layer. Everything runs vectorized over layers (numpy, fp64; the DeepSeek
baseline in fp32 like the original). `rebalance_incremental` moves as few slots as it can.

Shapes: L layers, E logical experts, R physical slots (replicas), G GPUs, S slots per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

POLICIES = ("auto", "global", "hierarchical")


@dataclass(frozen=True)
class Placement:
    """Replica placement for L layers. Slot s of a layer lives on GPU s // slots_per_gpu."""

    phy2log: torch.Tensor  # int64 [L, R]: logical expert held by each physical slot
    log2phy: torch.Tensor  # int64 [L, E, max_replicas]: slots of each expert, ascending, -1 pad
    logcnt: torch.Tensor  # int64 [L, E]: replica count per logical expert (>= 1)
    num_gpus: int

    @classmethod
    def from_phy2log(cls, phy2log_LR, num_experts: int, num_gpus: int) -> Placement:
        p = np.asarray(phy2log_LR, dtype=np.int64)
        L, R = p.shape
        cnt = _counts(p, num_experts)
        order = np.argsort(p, axis=1, kind="stable")  # slots grouped by expert, ascending
        start = np.cumsum(cnt, 1) - cnt
        e_sorted = np.take_along_axis(p, order, 1)
        occ = np.arange(R)[None, :] - np.take_along_axis(start, e_sorted, 1)
        log2phy = np.full((L, num_experts, max(int(cnt.max()), 1)), -1, np.int64)
        log2phy[np.arange(L)[:, None], e_sorted, occ] = order
        return cls(torch.from_numpy(p.copy()), torch.from_numpy(log2phy),
                   torch.from_numpy(cnt), num_gpus)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_experts(self) -> int:
        return self.logcnt.shape[1]

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    def gpu_loads(self, weight_LE) -> torch.Tensor:
        """fp64 [L, G]: load per GPU, an expert's load split evenly over its replicas."""
        return torch.from_numpy(_gpu_loads(_as_f64(weight_LE), self.phy2log.numpy(),
                                           self.logcnt.numpy(), self.num_gpus))

    def balancedness(self, weight_LE) -> torch.Tensor:
        """fp64 [L]: mean / max GPU load (1.0 = perfect; a layer with no load counts as 1.0)."""
        return torch.from_numpy(_balancedness(self.gpu_loads(weight_LE).numpy()))


def rebalance(weight_LE, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
              *, policy: str = "auto") -> Placement:
    """Place `num_replicas` slots per layer on `num_gpus` GPUs for the load `weight_LE` [L, E]."""
    w = _as_f64(weight_LE)
    hier_ok = _validate(w, num_replicas, num_groups, num_nodes, num_gpus)
    if policy not in POLICIES:
        raise ValueError(f"policy ({policy!r}) must be one of {POLICIES}")
    if policy == "hierarchical" and not hier_ok:
        _check_hierarchical(w.shape[1], num_groups, num_nodes)
    E = w.shape[1]
    if policy == "global":
        return Placement.from_phy2log(_ours_global(w, num_replicas, num_gpus), E, num_gpus)
    if policy == "hierarchical":
        return Placement.from_phy2log(
            _ours_hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus), E, num_gpus)
    cands = [_ours_global(w, num_replicas, num_gpus),
             _deepseek(w, num_replicas, num_groups, num_nodes, num_gpus)]
    max_CL = np.stack([_max_load(w, c, num_gpus) for c in cands])
    best_L = max_CL.argmin(0)  # first minimum: ours wins ties
    phy2log = np.stack(cands)[best_L, np.arange(w.shape[0])]
    return Placement.from_phy2log(phy2log, E, num_gpus)


def deepseek_rebalance(weight_LE, num_replicas: int, num_groups: int, num_nodes: int,
                       num_gpus: int) -> Placement:
    """DeepSeek EPLB's algorithm (the baseline): hierarchical if num_groups % num_nodes == 0."""
    w = _as_f64(weight_LE)
    _validate(w, num_replicas, num_groups, num_nodes, num_gpus)
    return Placement.from_phy2log(_deepseek(w, num_replicas, num_groups, num_nodes, num_gpus),
                                  w.shape[1], num_gpus)


def rebalance_incremental(weight_LE, old: Placement, num_groups: int, num_nodes: int,
                          num_gpus: int) -> tuple[Placement, int]:
    """Re-place for a new load, moving few slots; returns (placement, number of slots changed).

    Per layer: target counts are the greedy ones, unless the old counts reach the same max
    replica load (then they stay). A slot keeps its expert while that expert still needs the
    replica (the copies on the least-loaded GPUs stay); freed slots take the missing replicas,
    heaviest first, onto the least-loaded GPU with a free slot. A layer whose max GPU load
    would not drop keeps its old placement. num_groups / num_nodes are validated as in
    `rebalance`; the refill itself is node-unaware.
    """
    w = _as_f64(weight_LE)
    if old.num_gpus != num_gpus:
        raise ValueError(f"num_gpus ({num_gpus}) must equal old.num_gpus ({old.num_gpus}): "
                         f"an incremental rebalance keeps the GPU count")
    if tuple(w.shape) != (old.num_layers, old.num_experts):
        raise ValueError(f"weight_LE shape {tuple(w.shape)} must be (num_layers, num_experts) "
                         f"= {(old.num_layers, old.num_experts)} of the old placement")
    _validate(w, old.num_slots, num_groups, num_nodes, num_gpus)
    L, E = w.shape
    R, S = old.num_slots, old.slots_per_gpu
    old_p, old_cnt = old.phy2log.numpy(), old.logcnt.numpy()
    cnt, _ = _greedy_counts(w, R)
    keep_old = (w / old_cnt).max(1) <= (w / cnt).max(1) * (1 + 1e-12)
    cnt = np.where(keep_old[:, None], old_cnt, cnt)
    # keep a slot while its expert still needs the copy; copies on light GPUs first
    gpu_load = _gpu_loads(w, old_p, cnt, num_gpus)  # kept slots carry the new per-copy load
    slot_load = np.repeat(gpu_load, S, axis=1)
    order = np.lexsort((slot_load, old_p), axis=-1)  # by expert, then GPU load
    e_sorted = np.take_along_axis(old_p, order, 1)
    start = np.cumsum(old_cnt, 1) - old_cnt
    occ = np.empty_like(old_p)
    np.put_along_axis(occ, order, np.arange(R)[None, :] - np.take_along_axis(start, e_sorted, 1), 1)
    keep = occ < np.take_along_axis(cnt, old_p, 1)
    per_copy = w / cnt
    kept_load = np.where(keep, np.take_along_axis(per_copy, old_p, 1), 0.0)
    bin_load = kept_load.reshape(L, num_gpus, S).sum(-1)
    bin_free = (~keep).reshape(L, num_gpus, S).sum(-1)
    has = _counts((np.arange(R) // S * E + old_p).reshape(L, R), num_gpus * E, keep)
    has = has.reshape(L, num_gpus, E)
    # the missing replicas, heaviest first, padded to the same count per layer
    kept_cnt = _counts(old_p, E, keep)
    need = cnt - kept_cnt
    num_new = need.sum(1)
    N = int(num_new.max())
    if N == 0:
        return old, 0
    items_e = np.zeros((L, N), np.int64)
    items_valid = np.arange(N)[None, :] < num_new[:, None]
    items_e[items_valid] = np.repeat(np.tile(np.arange(E), L), need.ravel())
    items_load = np.where(items_valid, np.take_along_axis(per_copy, items_e, 1), -1.0)
    o = np.argsort(-items_load, axis=1, kind="stable")
    items_e, items_load = np.take_along_axis(items_e, o, 1), np.take_along_axis(items_load, o, 1)
    items_valid = np.take_along_axis(items_valid, o, 1)
    gpu_BN, _ = _lpt(items_load, items_e, bin_load, bin_free, has, valid_BN=items_valid)
    new_p = old_p.copy()
    for l in range(L):  # match each layer's new replicas to its free slots, GPU by GPU
        free_slots = np.flatnonzero(~keep[l])  # ascending, hence grouped by GPU
        v = items_valid[l]
        new_p[l, free_slots] = items_e[l, v][np.argsort(gpu_BN[l, v], kind="stable")]
    better = _max_load(w, new_p, num_gpus, cnt) < _max_load(w, old_p, num_gpus, old_cnt)
    new_p = np.where(better[:, None], new_p, old_p)
    return Placement.from_phy2log(new_p, E, num_gpus), int((new_p != old_p).sum())


# ---------------------------------------------------------------------------------------------
# validation


def _as_f64(weight_LE) -> np.ndarray:
    w = weight_LE.detach().cpu().double().numpy() if isinstance(weight_LE, torch.Tensor) \
        else np.asarray(weight_LE, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"weight_LE must be 2-D [num_layers, num_experts], got shape "
                         f"{tuple(w.shape)}; stack per-layer loads into one tensor")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weight_LE must be finite and >= 0 (token counts per expert); "
                         "clean NaN/inf/negative entries first")
    return w


def _validate(w, num_replicas, num_groups, num_nodes, num_gpus) -> bool:
    """Check the arguments; returns whether the hierarchical policy applies."""
    E = w.shape[1]
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups),
                    ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} ({v!r}) must be a positive int")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) must be divisible by num_gpus "
                         f"({num_gpus}): every GPU holds the same number of slots; use a "
                         f"multiple of {num_gpus}")
    if num_replicas < E:
        raise ValueError(f"num_replicas ({num_replicas}) must be >= num_experts ({E}): every "
                         f"logical expert needs a slot; add redundant slots")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes}): "
                         f"every node has the same number of GPUs")
    hier = num_groups % num_nodes == 0
    if hier:
        _check_hierarchical(E, num_groups, num_nodes)
    return hier


def _check_hierarchical(E, num_groups, num_nodes) -> None:
    if E % num_groups:
        raise ValueError(f"num_experts ({E}) must be divisible by num_groups ({num_groups}) "
                         f"for the hierarchical policy; pass the model's n_group")
    if num_groups % num_nodes:
        raise ValueError(f"num_groups ({num_groups}) must be divisible by num_nodes "
                         f"({num_nodes}) for the hierarchical policy; use policy='global'")


# ---------------------------------------------------------------------------------------------
# building blocks, vectorized over a batch B of rows (layers, or layers x nodes)


def _counts(idx_BN, num_bins, mask_BN=None) -> np.ndarray:
    """int64 [B, num_bins]: how often each value occurs per row (only where mask_BN)."""
    B = idx_BN.shape[0]
    flat = (idx_BN + np.arange(B)[:, None] * num_bins).ravel()
    wts = None if mask_BN is None else mask_BN.ravel().astype(np.int64)
    return np.bincount(flat, wts, minlength=B * num_bins).astype(np.int64).reshape(B, num_bins)


def _gpu_loads(w, phy2log, cnt, num_gpus) -> np.ndarray:
    L, R = phy2log.shape
    slot = np.take_along_axis(w / cnt, phy2log, 1)
    return slot.reshape(L, num_gpus, R // num_gpus).sum(-1)


def _max_load(w, phy2log, num_gpus, cnt=None) -> np.ndarray:
    if cnt is None:
        cnt = _counts(phy2log, w.shape[1])
    return _gpu_loads(w, phy2log, cnt, num_gpus).max(1)


def _balancedness(load_LG) -> np.ndarray:
    mx = load_LG.max(1)
    return np.where(mx > 0, load_LG.mean(1) / np.where(mx > 0, mx, 1), 1.0)


def _greedy_counts(w_BN, num_slots):
    """Give each extra slot to the expert of largest load/count; (counts, extra expert ids)."""
    B, N = w_BN.shape
    rows = np.arange(B)
    cnt = np.ones((B, N), np.int64)
    extra = np.empty((B, num_slots - N), np.int64)
    for i in range(num_slots - N):
        e = (w_BN / cnt.astype(w_BN.dtype)).argmax(1)
        extra[:, i] = e
        cnt[rows, e] += 1
    return cnt, extra


def _lpt(load_BN, expert_BN, bin_load_BG, bin_free_BG, has_BGE=None, valid_BN=None):
    """Assign items (each row sorted by load, descending) to the least-loaded bin with room
    (first such bin on ties). With `has_BGE` (copies of each expert per bin), a bin already
    holding the item's expert is taken only if every bin with room holds it.
    Returns (bin, rank in bin), [B, N] each."""
    B, N = load_BN.shape
    G = bin_load_BG.shape[1]
    rows = np.arange(B)
    key = np.where(bin_free_BG > 0, bin_load_BG, np.inf).astype(load_BN.dtype)
    free = bin_free_BG.copy()
    used = np.zeros_like(free)
    bin_BN = np.full((B, N), -1, np.int64)
    rank_BN = np.full((B, N), -1, np.int64)
    penalty = (load_BN.clip(min=0).sum(1) + bin_load_BG.sum(1) + 1.0)[:, None]
    for i in range(N):
        r = rows if valid_BN is None else rows[valid_BN[:, i]]
        if has_BGE is None:
            g = key[r].argmin(1) if valid_BN is not None else key.argmin(1)
        else:
            e = expert_BN[r, i]
            g = (key[r] + penalty[r] * (has_BGE[r, :, e] > 0)).argmin(1)
            has_BGE[r, g, e] += 1
        flat = r * G + g
        bin_BN[r, i] = g
        rank_BN[r, i] = used.ravel()[flat]
        used.ravel()[flat] += 1
        free.ravel()[flat] -= 1
        key.ravel()[flat] = np.where(free.ravel()[flat] > 0, key.ravel()[flat] + load_BN[r, i],
                                     np.inf)
    return bin_BN, rank_BN


def _round_match(load_BN, expert_BN, num_bins):
    """Pack items (rows sorted by (load desc, expert)) into `num_bins` bins of N/num_bins:
    round k hands items k*G..k*G+G-1 out, heaviest to the lightest bin, so every bin gets one
    per round and max - min load stays <= the largest item. The copies of an expert that
    straddles into a round go first to the lightest bins not yet holding it.
    Returns the bin of each item [B, N]."""
    B, N = load_BN.shape
    G = num_bins
    rows = np.arange(B)[:, None]
    pos = np.arange(G)[None, :]
    bin_load = np.zeros((B, G))
    has = np.zeros((B, G, int(expert_BN.max()) + 1), np.int16)
    bin_BN = np.empty((B, N), np.int64)
    for k in range(N // G):
        ld, ex = load_BN[:, k * G:(k + 1) * G], expert_BN[:, k * G:(k + 1) * G]
        order = np.argsort(bin_load, axis=1, kind="stable")
        if k:
            e0 = ex[:, :1]
            m = (ex == e0).cumprod(1).sum(1, keepdims=True)  # run of the straddling expert
            held = has[rows, pos, e0] > 0  # [B, G]
            if held.any():
                first = np.argsort(bin_load + 1e300 * held, axis=1, kind="stable")
                chosen = np.zeros((B, G), bool)
                np.put_along_axis(chosen, first, pos < m, 1)
                rest = np.argsort(bin_load + 1e300 * chosen, axis=1, kind="stable")
                order = np.where(pos < m, first, np.take_along_axis(rest, (pos - m) % G, 1))
        bin_BN[:, k * G:(k + 1) * G] = order
        bin_load[rows, order] += ld
        has[rows, order, ex] += 1
    return bin_BN


def _refine(load_BGS, expert_BGS, num_experts, sweeps=8, num_pairs=4, polish=6,
            num_partners=8):
    """Lower the max bin load by swapping one item pair between two bins, in place.

    A swap moves load d > 0 from the heavier bin h to the lighter bin l; it is taken only if
    both new loads stay below the old load of h (so the sorted load vector strictly drops)
    and it puts no second copy of an expert on either bin. `sweeps` rounds pair the q-th
    heaviest bin with the q-th lightest (q < num_pairs, all pairs at once); then `polish`
    rounds try the max bin against the `num_partners` lightest bins."""
    B, G, S = load_BGS.shape
    if G < 2:
        return
    flat = (np.arange(B)[:, None, None] * G + np.arange(G)[None, :, None]) * num_experts
    cnt = np.bincount((flat + expert_BGS).ravel(), minlength=B * G * num_experts)
    E = num_experts
    cnt = cnt.reshape(B, G, E)
    cnt_flat = cnt.reshape(-1)  # a view: swaps update both
    I, J = np.repeat(np.arange(S), S), np.tile(np.arange(S), S)

    def best(rows, h, l):  # rows [n], h, l [n, Q] -> (new max [n, Q, S*S], load of h [n, Q])
        rq = rows[:, None]
        xh, xl = load_BGS[rq, h], load_BGS[rq, l]
        lh, ll = xh.sum(-1), xl.sum(-1)
        d = xh[:, :, I] - xl[:, :, J]
        new_max = np.maximum(lh[..., None] - d, ll[..., None] + d)
        base = rq * G
        l_has = cnt_flat[((base + l)[..., None] * E + expert_BGS[rq, h])] > 0  # l holds h's item
        h_has = cnt_flat[((base + h)[..., None] * E + expert_BGS[rq, l])] > 0
        bad = (d <= 1e-12 * lh[..., None]) | l_has[:, :, I] | h_has[:, :, J]
        np.putmask(new_max, bad, np.inf)
        return new_max, lh

    def swap(rows, h, l, k):  # one swap per (rows, h, l), item pair k of I x J
        i, j = I[k], J[k]
        xi, xj = load_BGS[rows, h, i], load_BGS[rows, l, j]
        ei, ej = expert_BGS[rows, h, i], expert_BGS[rows, l, j]
        load_BGS[rows, h, i], load_BGS[rows, l, j] = xj, xi
        expert_BGS[rows, h, i], expert_BGS[rows, l, j] = ej, ei
        cnt[rows, h, ei] -= 1
        cnt[rows, l, ej] -= 1
        cnt[rows, h, ej] += 1
        cnt[rows, l, ei] += 1

    active = np.arange(B)
    Q = max(1, min(G // 2, num_pairs))
    for _ in range(sweeps):
        if active.size == 0:
            break
        order = np.argsort(load_BGS[active].sum(-1), axis=1, kind="stable")
        h, l = order[:, ::-1][:, :Q], order[:, :Q]
        new_max, lh = best(active, h, l)
        k = new_max.argmin(-1)
        ok = np.take_along_axis(new_max, k[..., None], -1)[..., 0] < lh * (1 - 1e-12)
        rr, qq = np.nonzero(ok)
        swap(active[rr], h[rr, qq], l[rr, qq], k[rr, qq])
        active = active[ok[:, 0]]  # go on while the heaviest bin still drops
    active = np.arange(B)
    P = min(num_partners, G - 1)
    for _ in range(polish):
        if active.size == 0:
            break
        bl = load_BGS[active].sum(-1)
        order = np.argsort(bl, axis=1, kind="stable")
        h, l = order[:, -1:].repeat(P, 1), order[:, :P]
        new_max, lh = best(active, h, l)
        n = active.size
        k = new_max.reshape(n, -1).argmin(1)
        ok = new_max.reshape(n, -1)[np.arange(n), k] < lh[:, 0] * (1 - 1e-12)
        q, k = np.divmod(k, S * S)
        r = np.arange(n)[ok]
        swap(active[r], h[r, 0], l[r, q[r]], k[r])
        active = active[ok]


def _pack_ours(w_BN, cnt_BN, num_bins):
    """Replicas of each row -> slot order [B, R] (bin-major): round matching, then swaps."""
    B, N = w_BN.shape
    R = int(cnt_BN[0].sum())
    S = R // num_bins
    expert = np.repeat(np.tile(np.arange(N), B), cnt_BN.ravel()).reshape(B, R)
    load = np.take_along_axis(w_BN / cnt_BN, expert, 1)
    o = np.lexsort((expert, -load), axis=-1)
    expert, load = np.take_along_axis(expert, o, 1), np.take_along_axis(load, o, 1)
    bin_ = _round_match(load, expert, num_bins)
    o = np.argsort(bin_, axis=1, kind="stable")  # bin-major slots
    load_BGS = np.take_along_axis(load, o, 1).reshape(B, num_bins, S)
    expert_BGS = np.take_along_axis(expert, o, 1).reshape(B, num_bins, S)
    _refine(load_BGS, expert_BGS, N)
    return expert_BGS.reshape(B, R)


def _ours_global(w, num_replicas, num_gpus):
    cnt, _ = _greedy_counts(w, num_replicas)
    return _pack_ours(w, cnt, num_gpus)


def _group_to_nodes(w, num_groups, num_nodes, pack):
    """Pack expert groups onto nodes; returns mlog2log [L, E] (node-major expert order)."""
    L, E = w.shape
    gs, gpn = E // num_groups, num_groups // num_nodes
    gw = w.reshape(L, num_groups, gs).sum(-1)
    node, rank = pack(gw, num_nodes)
    log2mlog = (((node * gpn + rank) * gs)[:, :, None] + np.arange(gs)).reshape(L, E)
    return np.argsort(log2mlog, axis=1)


def _ours_hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus):
    L, E = w.shape
    mlog2log = _group_to_nodes(w, num_groups, num_nodes, _deepseek_pack)
    w_node = np.take_along_axis(w, mlog2log, 1).reshape(L * num_nodes, E // num_nodes)
    cnt, _ = _greedy_counts(w_node, num_replicas // num_nodes)
    p = _pack_ours(w_node, cnt, num_gpus // num_nodes)  # node-local expert ids
    p = (p.reshape(L, num_nodes, -1) + (np.arange(num_nodes) * (E // num_nodes))[:, None])
    return np.take_along_axis(mlog2log, p.reshape(L, -1), 1)


# ---------------------------------------------------------------------------------------------
# DeepSeek EPLB (baseline), fp32 like the original


def _deepseek_pack(weight_BN, num_packs):
    """Sort descending; each item to the lightest pack that still has room (first on ties)."""
    B, N = weight_BN.shape
    if N == num_packs:
        return np.broadcast_to(np.arange(N), (B, N)).copy(), np.zeros((B, N), np.int64)
    o = np.argsort(-weight_BN, axis=1, kind="stable")
    ws = np.take_along_axis(weight_BN, o, 1)
    b_s, r_s = _lpt(ws, None, np.zeros((B, num_packs), weight_BN.dtype),
                    np.full((B, num_packs), N // num_packs))
    pack, rank = np.empty_like(b_s), np.empty_like(r_s)
    np.put_along_axis(pack, o, b_s, 1)
    np.put_along_axis(rank, o, r_s, 1)
    return pack, rank


def _deepseek(w64, num_replicas, num_groups, num_nodes, num_gpus):
    if num_groups % num_nodes:
        num_groups = num_nodes = 1  # DeepSeek's global policy
    w = w64.astype(np.float32)
    L, E = w.shape
    mlog2log = _group_to_nodes(w, num_groups, num_nodes, _deepseek_pack)
    w_node = np.take_along_axis(w, mlog2log, 1).reshape(L * num_nodes, E // num_nodes)
    cnt, extra = _greedy_counts(w_node, num_replicas // num_nodes)
    phy2mlog = np.concatenate([np.broadcast_to(np.arange(w_node.shape[1]), w_node.shape), extra],
                              axis=1)  # replicas in DeepSeek's order: originals, then extras
    tokens = np.take_along_axis(w_node / cnt.astype(np.float32), phy2mlog, 1)
    pack, rank = _deepseek_pack(tokens, num_gpus // num_nodes)
    slot = pack * (num_replicas // num_gpus) + rank
    p = np.empty_like(phy2mlog)
    np.put_along_axis(p, slot, phy2mlog, 1)
    p = p.reshape(L, num_nodes, -1) + (np.arange(num_nodes) * (E // num_nodes))[:, None]
    return np.take_along_axis(mlog2log, p.reshape(L, -1), 1)
