"""symm-ht dispatch, the send role: this rank's rows to every peer, chunk by chunk, each chunk
published as it lands (`ht_dispatch.py` has the regions, the receive role and the launch).

A destination d's slots (the tokens sent to d, in token order: `route.tok_WT[d]`) are cut into
chunks of CK slots; send CTA c of G takes chunks c, c + G, c + 2G, ... (round j: chunk
c + jG of every peer), and after each round releases its progress word at every peer,
`ht_prog[me][c] = epoch << 32 | rounds done` (one fence per round; word GMAX - 1 says the
whole send landed). A receiver that needs chunk
q of source s waits for `ht_prog[s][q % G] >= epoch << 32 | q // G + 1`, so it can place the
first chunks in the experts' layout while later ones are still on the link. CTA 0 first
writes the counts (with G and CK: a receive follows the sender's) and releases
ready[me] = epoch: the receivers size the layout from
them before any row lands. Values are epoch-tagged and only grow: nothing is reset, a CUDA
graph replays them.
"""

from __future__ import annotations

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import HT_DISPATCH  # noqa: E402
from epmoe.comm.symm.sync import (C_DONE_SEND, C_READY, C_SEQ_SEND,  # noqa: E402
                                  arrive_last, ctrl_ptr, fence_release, no_error, peer_bases,
                                  peer_ptr, publish, signal, wait_acks)

OP_D = tl.constexpr(HT_DISPATCH)
ALL_ROUNDS = tl.constexpr(0x7FFFFFFF)  # the low half of a progress word: every round landed


@triton.jit
def progress(e, rounds):
    """The int64 value of a progress word: epoch in the high half, rounds in the low."""
    return (e.to(tl.int64) << 32) | rounds.to(tl.int64)


@triton.jit
def _publish_round(arena_ptr, delta_ptr, PROG: tl.constexpr, GMAX: tl.constexpr, value, me,
                   c, W: tl.constexpr):
    """Release this CTA's progress word at every peer (after a CTA barrier, one fence)."""
    peers, dd = peer_bases(arena_ptr, delta_ptr, W)
    tl.debug_barrier()
    if no_error(arena_ptr) != 0:
        fence_release()
        signal((peers + PROG).to(tl.pointer_type(tl.int64)) + me * GMAX + c, value,
               (dd < W) & (dd != me))


@triton.jit
def finish_send_rows(arena_ptr, delta_ptr, PROG: tl.constexpr, GMAX: tl.constexpr, e, me,
                     W: tl.constexpr, n):
    """Last of the `n` send CTAs: send_seq = e here, and `ht_prog[me][GMAX - 1]` = epoch << 32 |
    every round at every peer (all of this send landed: a receive that sees it skips the
    per-chunk waits for this source)."""
    if arrive_last(arena_ptr, C_DONE_SEND + OP_D, n) != 0:
        tl.store(ctrl_ptr(arena_ptr, C_SEQ_SEND + OP_D), e)
        every = tl.full((), ALL_ROUNDS, dtype=tl.int32)
        _publish_round(arena_ptr, delta_ptr, PROG, GMAX, progress(e, every), me, GMAX - 1, W)


@triton.jit
def send_rows(arena_ptr, delta_ptr, x_ptr, s_ptr, ids_ptr, w_ptr, pos_ptr, tok_ptr,
              total_ptr, TS, me, c, G, e, limit,
              ROWS: tl.constexpr, META: tl.constexpr, CNT: tl.constexpr, PROG: tl.constexpr,
              GMAX: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
              K: tl.constexpr, KP: tl.constexpr, E_L: tl.constexpr, EP: tl.constexpr,
              DW: tl.constexpr, SW: tl.constexpr, CH: tl.constexpr, BSW: tl.constexpr,
              ROW_W: tl.constexpr, MW: tl.constexpr, CW: tl.constexpr, CK: tl.constexpr,
              BT: tl.constexpr, EVERY_ROUND: tl.constexpr, USE_TIMER: tl.constexpr):
    """Send CTA c of G, epoch e: counts (CTA 0), then rounds of chunks, each a step of BT
    slots: their tokens (tok_ptr [W, TS]), whole rows and routing loaded at once, stored with
    the meta (t, local expert, pos, weight per k) into the peer's buffer e % 2. EVERY_ROUND:
    progress released after each round (a receive runs meanwhile), else once at the end as
    every round (the receive is launched after this send: one fence instead of one a round,
    each of which waits for the CTA's stores in flight)."""
    buf = e % 2
    ok = wait_acks(arena_ptr, OP_D, e - 2, limit, W, USE_TIMER)
    if ok != 0:
        dd = tl.arange(0, WP)
        n_d = tl.load(total_ptr + E_L * W + dd, mask=dd < W, other=0)
        if c == 0:
            ee = tl.arange(0, EP)
            for d in tl.static_range(W):
                if d != me:
                    peer = peer_ptr(arena_ptr, delta_ptr, d)
                    cnt = (peer + CNT).to(tl.pointer_type(tl.int32)) + (buf * W + me) * CW
                    tl.store(cnt, tl.load(total_ptr + E_L * W + d))
                    tl.store(cnt + 1 + ee, tl.load(total_ptr + d * E_L + ee, mask=ee < E_L),
                             mask=ee < E_L)
                    tl.store(cnt + 1 + E_L, G)
                    tl.store(cnt + 2 + E_L, CK)
            tl.debug_barrier()
            publish(arena_ptr, delta_ptr, C_READY + OP_D * W + me, e, W)
        n_far = tl.max(tl.where((dd < W) & (dd != me), n_d, 0), axis=0)
        cols = tl.arange(0, CH)
        cm = cols < DW
        scols = tl.arange(0, BSW)
        kk = tl.arange(0, KP)
        km = kk < K
        for q in range(c, (n_far + CK - 1) // CK, G):
            for d in tl.static_range(W):
                nd = tl.load(total_ptr + E_L * W + d)
                if (d != me) & (q * CK < nd):
                    peer = peer_ptr(arena_ptr, delta_ptr, d)
                    end = tl.minimum(nd, q * CK + CK)
                    m = q * CK + tl.arange(0, BT)
                    t_next = tl.load(tok_ptr + d * TS + m, mask=m < end, other=0)
                    for m0 in range(q * CK, q * CK + CK, BT):
                        m = m0 + tl.arange(0, BT)
                        mm = m < end
                        t = t_next
                        t64 = t.to(tl.int64)
                        # the next step's tokens now: their load overlaps this step's rows
                        t_next = tl.load(tok_ptr + d * TS + m + BT, mask=m + BT < end, other=0)
                        m2 = mm[:, None] & km[None, :]
                        row = tl.load(x_ptr + t64[:, None] * DW + cols[None, :],
                                      mask=mm[:, None] & cm[None, :])
                        if SW > 0:
                            srow = tl.load(s_ptr + t64[:, None] * SW + scols[None, :],
                                           mask=mm[:, None] & (scols < SW)[None, :])
                        ids = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=m2,
                                      other=-1).to(tl.int32)
                        wk = tl.load(w_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=0.0)
                        pos = tl.load(pos_ptr + t64[:, None] * K + kk[None, :], mask=m2,
                                      other=0)
                        slot = ((buf * W + me) * TMAX + m).to(tl.int64)
                        dst = (peer + ROWS).to(tl.pointer_type(tl.int32)) + slot * ROW_W
                        tl.store(dst[:, None] + cols[None, :], row, mask=mm[:, None] & cm[None, :])
                        if SW > 0:
                            tl.store(dst[:, None] + DW + scols[None, :], srow,
                                     mask=mm[:, None] & (scols < SW)[None, :])
                        meta = (peer + META).to(tl.pointer_type(tl.int32)) + slot * MW
                        on_d = (ids >= d * E_L) & (ids < (d + 1) * E_L)
                        tl.store(meta, t, mask=mm)
                        tl.store(meta[:, None] + 1 + kk[None, :],
                                 tl.where(on_d, ids - d * E_L, -1), mask=m2)
                        tl.store(meta[:, None] + 1 + K + kk[None, :], tl.where(on_d, pos, 0),
                                 mask=m2)
                        wmeta = (meta + 1 + 2 * K).to(tl.pointer_type(tl.float32))
                        tl.store(wmeta[:, None] + kk[None, :], tl.where(on_d, wk, 0.0), mask=m2)
            if EVERY_ROUND:
                _publish_round(arena_ptr, delta_ptr, PROG, GMAX, progress(e, q // G + 1), me,
                               c, W)
        if not EVERY_ROUND:
            every = tl.full((), ALL_ROUNDS, dtype=tl.int32)
            _publish_round(arena_ptr, delta_ptr, PROG, GMAX, progress(e, every), me, c, W)


__all__ = ["send_rows", "finish_send_rows", "progress"]
