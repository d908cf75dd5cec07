"""Our packing: replica counts and the assignment of replicas to GPUs (numpy, fp64, vectorized
over a batch B of rows: layers, or layers x nodes).

- `greedy_counts`: each extra slot to the expert of largest load / replicas.
- `pack_ours`: round matching (every bin takes one item per round, heaviest item to the
  lightest bin, so max - min bin load stays <= the largest item), then `refine`: pairwise swaps
  between bins that strictly lower the heavier bin and never co-locate two copies of an expert.
- `lpt`: least-loaded-bin-with-room assignment (the incremental mode's refill).
"""

from __future__ import annotations

import numpy as np

from epmoe.eplb.placement import counts

def greedy_counts(w_BN, num_slots):
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


def lpt(load_BN, expert_BN, bin_load_BG, bin_free_BG, has_BGE=None, valid_BN=None):
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


def round_match(load_BN, expert_BN, num_bins):
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


def refine(load_BGS, expert_BGS, num_experts, sweeps=8, num_pairs=4, polish=6,
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


def pack_ours(w_BN, cnt_BN, num_bins):
    """Replicas of each row -> slot order [B, R] (bin-major): round matching, then swaps."""
    B, N = w_BN.shape
    R = int(cnt_BN[0].sum())
    S = R // num_bins
    expert = np.repeat(np.tile(np.arange(N), B), cnt_BN.ravel()).reshape(B, R)
    load = np.take_along_axis(w_BN / cnt_BN, expert, 1)
    o = np.lexsort((expert, -load), axis=-1)
    expert, load = np.take_along_axis(expert, o, 1), np.take_along_axis(load, o, 1)
    bin_ = round_match(load, expert, num_bins)
    o = np.argsort(bin_, axis=1, kind="stable")  # bin-major slots
    load_BGS = np.take_along_axis(load, o, 1).reshape(B, num_bins, S)
    expert_BGS = np.take_along_axis(expert, o, 1).reshape(B, num_bins, S)
    refine(load_BGS, expert_BGS, N)
    return expert_BGS.reshape(B, R)


def refine_placement(w_LE, phy2log_LR, num_gpus, num_nodes=1):
    """A placement's slots after `refine` swaps between GPUs of the same node (all GPUs when
    num_nodes = 1), so a node keeps its experts; the max GPU load never rises."""
    L, R = phy2log_LR.shape
    cnt = counts(phy2log_LR, w_LE.shape[1])
    load = np.take_along_axis(w_LE / cnt, phy2log_LR, 1)
    shape = (L * num_nodes, num_gpus // num_nodes, R // num_gpus)
    load_BGS, expert_BGS = load.reshape(shape).copy(), phy2log_LR.reshape(shape).copy()
    refine(load_BGS, expert_BGS, w_LE.shape[1])
    return expert_BGS.reshape(L, R)
