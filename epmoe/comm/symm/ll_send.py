"""symm-ll's send kernel (the dispatch's first half; the arena regions and the two ways a
token travels are described in `ll_dispatch.py`). Per step of BT tokens the whole rows load
together and are quantized once (fp8: per 128 columns, `epmoe.quant`'s rule), then:

- direct (STAGED False): first one vector of system-scope atomics per SA tokens takes each
  (token, k) pair's row at its expert's rank (kept in a [T, K] scratch of destination words,
  `_dest`, with the row's meta written there); then each slot k is its own [BT] loads (a pick
  out of a [BT, KP] tile is a cross-thread reduction per slot and field, which measured
  slower) and stores: its row straight into that rank's masked layout, with its
  destination's message (rows there) — a rank holding several of a token's slots gets the
  same message several times, cheaper than finding the first;
- staged (STAGED True): no atomics; every (token, slot) pair of the step is one lane of
  [BT, KP] tiles, the first slot of a token on each rank sending (`_send_staged`: each field
  one store over all lanes, the rows a [BT, KP, CH] broadcast) — the row into that rank's
  staging region at [me][t] and one message (its local experts there); the receive takes
  the rows. (The same store for the direct way measured slower for bf16 and at 128-256
  tokens: BENCHMARKS.md 26.)
"""

from __future__ import annotations

from epmoe.kernels._common import round_bf16, round_e4m3

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import LL_DISPATCH  # noqa: E402
from epmoe.comm.symm.sync import finish_send, peer_bases, send_epoch, wait_acks  # noqa: E402
from epmoe.comm.symm.tiles import span  # noqa: E402

OP_D = tl.constexpr(LL_DISPATCH)


@triton.jit
def _quantize_rows(x, P: tl.constexpr, CH: tl.constexpr, POW2: tl.constexpr,
                   PRE_ROUND: tl.constexpr):
    """fp32 [P, CH] -> (fp8 codes as fp32 [P, CH], scales [P, CH // 128]): epmoe.quant's rule
    per 128 columns (amax >= 1e-10, scale = amax / 448, or its power-of-two ceiling)."""
    xg = tl.reshape(x, (P, CH // 128, 128))
    amax = tl.maximum(tl.max(tl.abs(xg), axis=2), 1e-10)
    s = tl.math.div_rn(amax, 448.0)
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        e8 = ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (e8 << 23).to(tl.float32, bitcast=True)
    q = tl.math.div_rn(xg, s[:, :, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if PRE_ROUND:
        q = round_e4m3(q)
    return tl.reshape(q, (P, CH)), s


ROW_BITS = tl.constexpr(24)  # a destination word: rank base // 128 << ROW_BITS | row + 1
ROW_SPAN = tl.constexpr(1 << ROW_BITS.value)


@triton.jit
def _dest(word):
    """A destination word of `_take_rows` -> (the rank's arena base - mine, its row there
    (le * C + slot), taken): one load per slot in the send's loop instead of a slot's row
    and then its rank's base, a second memory round trip after the previous slot's stores."""
    low = word & (ROW_SPAN - 1)
    return (word >> ROW_BITS) * 128, (low - 1).to(tl.int32), low != 0


@triton.jit
def _take_rows(arena_ptr, delta_ptr, ids_ptr, dest_ptr, T, me, pid, G, SLOTS: tl.constexpr,
               META: tl.constexpr, TMAX: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
               E_L: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, SA: tl.constexpr):
    """Direct: the rows of this CTA's (token, k) pairs at their experts' ranks (SA tokens per
    vector of system-scope atomics: one round trip for a decode batch) -> dest_TK (`_dest`:
    the rank's base and the row there in one word, 0: none), and each row's meta there."""
    kk, km = span(KP, K)
    jj = tl.arange(0, SA)
    steps = (T + G * BT - 1) // (G * BT)
    for s0 in range(0, steps, SA // BT):  # this CTA's tokens, as the copy steps take them
        t = pid * BT + (s0 + jj // BT) * G * BT + jj % BT
        m2 = (t < T)[:, None] & km[None, :]
        t64 = t.to(tl.int64)
        ids = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=-1).to(tl.int32)
        valid = ids >= 0
        d = tl.where(valid, ids // E_L, 0)
        delta = tl.load(delta_ptr + d)
        base = arena_ptr + delta
        le = ids - d * E_L
        slot = tl.atomic_add((base + SLOTS).to(tl.pointer_type(tl.int32)) + le, 1,
                             mask=valid, sem="relaxed", scope="sys")
        valid = valid & (slot < C)
        tl.store((base + META).to(tl.pointer_type(tl.int32)) + le * C + slot,
                 (me * TMAX + t[:, None]) * K + kk[None, :], mask=valid)
        dest = (delta // 128) * ROW_SPAN + (le * C + slot + 1)
        tl.store(dest_ptr + t64[:, None] * K + kk[None, :], tl.where(valid, dest, 0), mask=m2)
    tl.debug_barrier()  # the slots this CTA took, CTA-wide


@triton.jit
def _send_staged(arena_ptr, delta_ptr, q, sc, d2, v2, w2, m2, t64, me, e, STAGE: tl.constexpr,
                 SSTAGE: tl.constexpr, MSG: tl.constexpr, MW: tl.constexpr,
                 TMAX: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, WP: tl.constexpr,
                 NG: tl.constexpr, NGP: tl.constexpr, D: tl.constexpr, CH: tl.constexpr,
                 FP8: tl.constexpr, BT: tl.constexpr):
    """Staged: every (token, slot) pair of the step as one lane of [BT, KP] tiles, the first
    slot of each token on a rank sending (the row into that rank's staging row [me][t], the
    scales, one message), each field one store over all lanes -> hit [BT, WP] (token t went
    to rank d). A loop over the slots paid a reduction and a load per slot."""
    kk, km = span(KP, K)
    cols, cm = span(CH, D)
    g, gm = span(NGP, NG)
    dd = tl.arange(0, WP)
    dup = tl.max(((d2[:, None, :] == d2[:, :, None])
                  & (kk[None, None, :] < kk[None, :, None])).to(tl.int32), axis=2)
    v3 = (d2 >= 0) & (dup == 0)
    dk3 = tl.where(v3, d2, 0)
    pk3 = arena_ptr + tl.load(delta_ptr + dk3, mask=v3, other=0) // 128 * 128
    row3 = me * TMAX + t64[:, None] + tl.zeros((BT, KP), dtype=tl.int64)  # my token t there
    m3 = v3[:, :, None] & cm[None, None, :]
    if FP8:
        dst = (pk3 + STAGE).to(tl.pointer_type(tl.float8e4nv))
        tl.store((dst + row3 * D)[:, :, None] + cols[None, None, :],
                 tl.broadcast_to(q[:, None, :], (BT, KP, CH)), mask=m3)
        sdst = (pk3 + SSTAGE).to(tl.pointer_type(tl.float32)) + row3 * NG
        tl.store(sdst[:, :, None] + g[None, None, :], tl.broadcast_to(sc[:, None, :],
                 (BT, KP, NGP)), mask=v3[:, :, None] & gm[None, None, :])
    else:
        dst = (pk3 + STAGE).to(tl.pointer_type(tl.bfloat16))
        tl.store((dst + row3 * D)[:, :, None] + cols[None, None, :],
                 tl.broadcast_to(q[:, None, :], (BT, KP, CH)), mask=m3)
    # the message of (me, t) at each rank: epoch, per slot there its local expert (-1:
    # elsewhere), weights
    here = (d2[:, None, :] == dk3[:, :, None]) & m2[:, None, :]
    msg = (pk3 + MSG).to(tl.pointer_type(tl.int32)) + (me * TMAX + t64[:, None]) * MW
    mk = v3[:, :, None] & km[None, None, :]
    tl.store(msg, e, mask=v3)
    tl.store(msg[:, :, None] + 1 + kk[None, None, :], tl.where(here, v2[:, None, :], -1),
             mask=mk)
    tl.store((msg + 1 + K).to(tl.pointer_type(tl.float32))[:, :, None] + kk[None, None, :],
             tl.where(here, w2[:, None, :], 0.0), mask=mk)
    return tl.max(((dd[None, None, :] == dk3[:, :, None]) & v3[:, :, None]).to(tl.int32),
                  axis=1)


@triton.jit(do_not_specialize=["T", "me", "limit"])
def _dispatch_send_kernel(arena_ptr, delta_ptr, x_ptr, ids_ptr, w_ptr, dest_ptr, msg_ptr,
                          counts_ptr, T, me, limit, SLOTS: tl.constexpr, DATA: tl.constexpr,
                          SCALE: tl.constexpr, META: tl.constexpr, MSG: tl.constexpr,
                          MW: tl.constexpr, STAGE: tl.constexpr, SSTAGE: tl.constexpr,
                          NTOK: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
                          WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                          E_L: tl.constexpr, EP: tl.constexpr, C: tl.constexpr,
                          D: tl.constexpr, CH: tl.constexpr, NG: tl.constexpr,
                          NGP: tl.constexpr, FP8: tl.constexpr, STAGED: tl.constexpr,
                          POW2: tl.constexpr, PRE_ROUND: tl.constexpr, BT: tl.constexpr,
                          SA: tl.constexpr, USE_TIMER: tl.constexpr):
    """The send (see the module docstring); msg_TW [T, W] = t where token t went to a rank,
    else -1; counts_E zeroed for a staged receive, which raises each per row it takes."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    e = send_epoch(arena_ptr, OP_D)
    if pid == 0:
        ee = tl.arange(0, EP)
        tl.store(counts_ptr + ee, 0, mask=ee < E_L)
    ok = wait_acks(arena_ptr, OP_D, e - 1, limit, W, USE_TIMER)
    if ok != 0:
        if not STAGED:
            _take_rows(arena_ptr, delta_ptr, ids_ptr, dest_ptr, T, me, pid, G, SLOTS, META,
                       TMAX, K, KP, E_L, C, BT, SA)
        kk, km = span(KP, K)
        dd = tl.arange(0, WP)
        cols, cm = span(CH, D)
        g, gm = span(NGP, NG)
        for t0 in range(pid * BT, T, G * BT):
            t = t0 + tl.arange(0, BT)
            tm = t < T
            t64 = t.to(tl.int64)
            x = tl.load(x_ptr + t64[:, None] * D + cols[None, :], mask=tm[:, None] & cm[None, :],
                        other=0.0).to(tl.float32)
            m2 = tm[:, None] & km[None, :]
            ids2 = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=-1)
            ids2 = ids2.to(tl.int32)
            w2 = tl.load(w_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=0.0)
            if STAGED:  # the message names the local experts; the receive takes the rows
                d2 = tl.where(ids2 >= 0, ids2 // E_L, -1)
                v2 = ids2 - d2 * E_L
            else:  # the message names the rows taken above
                _, v2, taken2 = _dest(tl.load(dest_ptr + t64[:, None] * K + kk[None, :],
                                              mask=m2, other=0))
                d2 = tl.where(taken2, ids2 // E_L, -1)
            if FP8:
                q, sc = _quantize_rows(x, BT, CH, POW2, PRE_ROUND)
                q = q.to(tl.float8e4nv)
            else:
                if PRE_ROUND:
                    x = round_bf16(x)
                q = x.to(tl.bfloat16)
                sc = tl.zeros((BT, NGP), dtype=tl.float32)  # no scales (unused)
            if STAGED:
                hit = _send_staged(arena_ptr, delta_ptr, q, sc, d2, v2, w2, m2, t64, me, e,
                                   STAGE, SSTAGE, MSG, MW, TMAX, K, KP, WP, NG, NGP, D, CH,
                                   FP8, BT)
            else:
                hit = tl.zeros((BT, WP), dtype=tl.int32)
                for k in tl.static_range(K):  # each slot's row into its masked layout
                    idk = tl.load(ids_ptr + t64 * K + k, mask=tm, other=-1).to(tl.int32)
                    delta, rk32, vk = _dest(tl.load(dest_ptr + t64 * K + k, mask=tm, other=0))
                    dk = tl.where(vk, idk // E_L, 0)
                    lek = rk32 // C
                    rk = rk32.to(tl.int64)
                    hit = hit | ((dd[None, :] == dk[:, None]) & vk[:, None]).to(tl.int32)
                    pk = arena_ptr + delta
                    m2k = vk[:, None] & cm[None, :]
                    if FP8:
                        dst = (pk + DATA).to(tl.pointer_type(tl.float8e4nv))
                        tl.store((dst + rk * D)[:, None] + cols[None, :], q, mask=m2k)
                        sdst = (pk + SCALE).to(tl.pointer_type(tl.float32)) \
                            + lek.to(tl.int64) * NG * C + (rk32 - lek * C)  # [E_L][G][C]
                        tl.store(sdst[:, None] + g[None, :].to(tl.int64) * C, sc,
                                 mask=vk[:, None] & gm[None, :])
                    else:
                        dst = (pk + DATA).to(tl.pointer_type(tl.bfloat16))
                        tl.store((dst + rk * D)[:, None] + cols[None, :], q, mask=m2k)
                    # the message of (me, t) at rank dk: epoch, per slot there its row (-1:
                    # elsewhere), weights
                    here = (d2 == dk[:, None]) & m2
                    msg = (pk + MSG).to(tl.pointer_type(tl.int32)) + (me * TMAX + t64) * MW
                    mk = vk[:, None] & km[None, :]
                    tl.store(msg, e, mask=vk)
                    tl.store(msg[:, None] + 1 + kk[None, :], tl.where(here, v2, -1), mask=mk)
                    tl.store((msg + 1 + K).to(tl.pointer_type(tl.float32))[:, None]
                             + kk[None, :], tl.where(here, w2, 0.0), mask=mk)
            tl.store(msg_ptr + t64[:, None] * W + dd[None, :],
                     tl.where(hit != 0, t[:, None], -1), mask=tm[:, None] & (dd < W)[None, :])
        if pid == 0:  # my token count at every rank: one vector of stores
            peers, dw = peer_bases(arena_ptr, delta_ptr, W)
            tl.store((peers + NTOK).to(tl.pointer_type(tl.int32)) + me,
                     tl.zeros((WP,), dtype=tl.int32) + T, mask=dw < W)
    finish_send(arena_ptr, delta_ptr, OP_D, e, me, W)


__all__ = ["_dispatch_send_kernel"]
