"""symm-ll's send kernel (the dispatch's first half; the arena regions and the two ways a
token travels are described in `ll_dispatch.py`). Per step of BT tokens the whole rows load
together and are quantized once (fp8: per 128 columns, `epmoe.quant`'s rule), then each slot k
of each token is its own [BT] loads (a pick out of a [BT, KP] tile is a cross-thread reduction
per slot and field) and stores:

- direct (STAGED False): first one vector of system-scope atomics per SA tokens takes each
  (token, k) pair's row at its expert's rank (kept in a [T, K] scratch with the row's meta
  written there); then each row goes straight into that rank's masked layout, K stores per
  token, each with its destination's message (rows there) — a rank holding several of a
  token's slots gets the same message several times, cheaper than finding the first;
- staged (STAGED True): no atomics; a slot sends when no earlier slot of its token is on the
  same rank (a reduction over the token's slot tile: measured cheaper than reloading the
  earlier slots, whose masked loads chain) — the row into that rank's staging region at
  [me][t] and one message (its local experts there); the receive takes the rows.
"""

from __future__ import annotations

from epmoe.kernels._common import round_bf16, round_e4m3

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import LL_DISPATCH  # noqa: E402
from epmoe.comm.symm.sync import finish_send, peer_ptr, send_epoch, wait_acks  # noqa: E402
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


@triton.jit
def _take_rows(arena_ptr, delta_ptr, ids_ptr, slot_ptr, T, me, pid, G, SLOTS: tl.constexpr,
               META: tl.constexpr, TMAX: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
               E_L: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, SA: tl.constexpr):
    """Direct: the rows of this CTA's (token, k) pairs at their experts' ranks (SA tokens per
    vector of system-scope atomics: one round trip for a decode batch) -> slot_TK (-1: none),
    and each row's meta there."""
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
        base = arena_ptr + tl.load(delta_ptr + d)
        le = ids - d * E_L
        slot = tl.atomic_add((base + SLOTS).to(tl.pointer_type(tl.int32)) + le, 1,
                             mask=valid, sem="relaxed", scope="sys")
        valid = valid & (slot < C)
        tl.store((base + META).to(tl.pointer_type(tl.int32)) + le * C + slot,
                 (me * TMAX + t[:, None]) * K + kk[None, :], mask=valid)
        tl.store(slot_ptr + t64[:, None] * K + kk[None, :], tl.where(valid, slot, -1), mask=m2)
    tl.debug_barrier()  # the slots this CTA took, CTA-wide


@triton.jit(do_not_specialize=["T", "me", "limit"])
def _dispatch_send_kernel(arena_ptr, delta_ptr, x_ptr, ids_ptr, w_ptr, slot_ptr, msg_ptr,
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
            _take_rows(arena_ptr, delta_ptr, ids_ptr, slot_ptr, T, me, pid, G, SLOTS, META,
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
                slot2 = tl.load(slot_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=-1)
                d2 = tl.where(slot2 >= 0, ids2 // E_L, -1)
                v2 = (ids2 - d2 * E_L) * C + slot2
            if FP8:
                q, sc = _quantize_rows(x, BT, CH, POW2, PRE_ROUND)
                q = q.to(tl.float8e4nv)
            else:
                if PRE_ROUND:
                    x = round_bf16(x)
                q = x.to(tl.bfloat16)
            hit = tl.zeros((BT, WP), dtype=tl.int32)
            for k in tl.static_range(K):
                idk = tl.load(ids_ptr + t64 * K + k, mask=tm, other=-1).to(tl.int32)
                if STAGED:  # the first of the token's slots on its rank sends
                    vk = idk >= 0
                    dk = tl.where(vk, idk // E_L, 0)
                    if k > 0:
                        dup = tl.sum(((d2 == dk[:, None]) & (kk[None, :] < k)).to(tl.int32),
                                     axis=1)
                        vk = vk & (dup == 0)
                    rk = me * TMAX + t64  # my token t's staging row there
                    srow, sstride = rk * NG, 1
                else:
                    sk = tl.load(slot_ptr + t64 * K + k, mask=tm, other=-1)
                    vk = sk >= 0
                    dk = tl.where(vk, idk // E_L, 0)
                    lek = idk - dk * E_L
                    rk = (lek * C + sk).to(tl.int64)
                    srow, sstride = lek.to(tl.int64) * NG * C + sk, C  # [E_L][G][C]
                hit = hit | ((dd[None, :] == dk[:, None]) & vk[:, None]).to(tl.int32)
                pk = peer_ptr(arena_ptr, delta_ptr, dk)
                m2k = vk[:, None] & cm[None, :]
                if FP8:
                    dst = (pk + (STAGE if STAGED else DATA)).to(tl.pointer_type(tl.float8e4nv))
                    tl.store((dst + rk * D)[:, None] + cols[None, :], q, mask=m2k)
                    sdst = (pk + (SSTAGE if STAGED else SCALE)).to(tl.pointer_type(tl.float32))
                    tl.store((sdst + srow)[:, None] + g[None, :].to(tl.int64) * sstride, sc,
                             mask=vk[:, None] & gm[None, :])
                else:
                    dst = (pk + (STAGE if STAGED else DATA)).to(tl.pointer_type(tl.bfloat16))
                    tl.store((dst + rk * D)[:, None] + cols[None, :], q, mask=m2k)
                # the message of (me, t) at rank dk: epoch, per slot there its expert or row
                # (-1: elsewhere), weights
                here = (d2 == dk[:, None]) & m2
                msg = (pk + MSG).to(tl.pointer_type(tl.int32)) + (me * TMAX + t64) * MW
                mk = vk[:, None] & km[None, :]
                tl.store(msg, e, mask=vk)
                tl.store(msg[:, None] + 1 + kk[None, :], tl.where(here, v2, -1), mask=mk)
                tl.store((msg + 1 + K).to(tl.pointer_type(tl.float32))[:, None] + kk[None, :],
                         tl.where(here, w2, 0.0), mask=mk)
            tl.store(msg_ptr + t64[:, None] * W + dd[None, :],
                     tl.where(hit != 0, t[:, None], -1), mask=tm[:, None] & (dd < W)[None, :])
        if pid == 0:
            for d in tl.static_range(W):
                tl.store((peer_ptr(arena_ptr, delta_ptr, d) + NTOK).to(tl.pointer_type(tl.int32))
                         + me, T)
    finish_send(arena_ptr, delta_ptr, OP_D, e, me, W)


__all__ = ["_dispatch_send_kernel"]
