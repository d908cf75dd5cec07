"""symm-ht dispatch, the receive role: every rank's rows straight into the experts' contiguous
layout, chunk by chunk as the senders publish them (`ht_send.py` has the progress protocol,
`ht_dispatch.py` the regions and the launch).

Receive CTA c of G: wait for every peer's counts (ready >= epoch; this rank's own come from its
routing table, never from its send) -> the layout (groups aligned) -> the parts that need no
row (slots past the received tokens, row -> expert) -> work items (a step of BT slots of
source s) in step-major order, the order the senders fill them: wait for s's progress word
of the chunk the step lies in, then the step's received tokens (whole rows, one [BT, CH]
load, with their meta) stored to the layout rows of their local experts (a [BT, CH] store
per slot k of the same registers). Items are single steps so that every CTA has work at
small token counts.
A rank's own rows and meta are read from its wire rows and routing, never staged in the arena
(GATHER: the rows are copied once into its own-source slots, and every layout row gets the
arena slot its row lies in instead of the row: `LayoutBatch.rows_M`).
After a timeout the outputs stay well formed and in bounds, so the experts and the combine
run to the caller's sync point (where `check_errors` raises): a peer's counts that never came
give an empty layout; a step whose chunks never landed is dropped (its tokens' slots -1, their
source -1, which the combine skips).
"""

from __future__ import annotations

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import HT_DISPATCH  # noqa: E402
from epmoe.comm.symm.ht_send import ALL_ROUNDS, progress  # noqa: E402
from epmoe.comm.symm.sync import C_READY, ctrl_ptr, ld_acquire, wait_geq  # noqa: E402

OP_D = tl.constexpr(HT_DISPATCH)
ALL = tl.constexpr(ALL_ROUNDS)


@triton.jit
def _pick(v, s, i):
    """v[i] of a [WP] vector as a scalar (v indexed by s)."""
    return tl.sum(tl.where(s == i, v, 0), axis=0)


@triton.jit
def recv_rows(arena_ptr, x_ptr, s_ptr, ids_ptr, w_ptr, pos_ptr, tok_ptr, total_ptr, TS,
              xo_ptr, so_ptr, row_expert_ptr, inv_ptr, wo_ptr, src_tok_ptr, info_ptr,
              arow_ptr, align, me, c, G, e, limit,
              ROWS: tl.constexpr, META: tl.constexpr, CNT: tl.constexpr, PROG: tl.constexpr,
              GMAX: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
              K: tl.constexpr, KP: tl.constexpr, E_L: tl.constexpr, EP: tl.constexpr,
              M_MAX: tl.constexpr, DW: tl.constexpr, SW: tl.constexpr, CH: tl.constexpr,
              BSW: tl.constexpr, ROW_W: tl.constexpr, MW: tl.constexpr, CW: tl.constexpr,
              CK: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, GATHER: tl.constexpr,
              USE_TIMER: tl.constexpr):
    buf = e % 2
    ok = tl.full((), 1, dtype=tl.int32)
    for d in tl.static_range(W):
        if d != me:
            ok = ok & wait_geq(ctrl_ptr(arena_ptr, C_READY + OP_D * W + d), e, arena_ptr,
                               2 * OP_D + 1, d, limit, USE_TIMER)
    s = tl.arange(0, WP)
    ee = tl.arange(0, EP)
    sm = s < W
    em = ee < E_L
    own = s == me
    far = sm & (s != me)
    cnt_p = (arena_ptr + CNT).to(tl.pointer_type(tl.int32)) + (buf * W + s) * CW
    nmsg = tl.load(cnt_p, mask=far, other=0) + \
        tl.load(total_ptr + E_L * W + s, mask=own, other=0)
    nmsg = tl.where(ok != 0, tl.minimum(nmsg, TMAX), 0)  # after a timeout: an empty layout
    cnt = tl.load(cnt_p[:, None] + 1 + ee[None, :], mask=far[:, None] & em[None, :],
                  other=0) + \
        tl.load(total_ptr + me * E_L + ee[None, :] + 0 * s[:, None],
                mask=own[:, None] & em[None, :], other=0)
    cnt = tl.where(ok != 0, cnt, 0)
    g_s = tl.maximum(tl.load(cnt_p + 1 + E_L, mask=far, other=1), 1)
    ck_s = tl.maximum(tl.load(cnt_p + 2 + E_L, mask=far, other=CK), 1)  # senders' chunks
    tot = tl.sum(cnt, axis=0)
    aligned = (tot + align - 1) // align * align
    offs_incl = tl.cumsum(aligned, axis=0)
    offs = offs_incl - aligned
    rowbase = offs[None, :] + tl.cumsum(cnt, axis=0) - cnt
    n_total = tl.sum(nmsg, axis=0)
    m_used = tl.sum(aligned, axis=0)
    incl_s = tl.cumsum(nmsg, axis=0)
    excl_s = incl_s - nmsg
    # info: [n_total, m_used, counts_E[E_L], offsets_E1[E_L + 1], rowbase[W][E_L],
    # messages up to source s inclusive [W]]; every CTA writes the same values (benign),
    # then gathers row bases back from it
    tl.store(info_ptr, n_total)
    tl.store(info_ptr + 1, m_used)
    tl.store(info_ptr + 2 + ee, tot, mask=em)
    tl.store(info_ptr + 2 + E_L + ee, offs, mask=em)
    tl.store(info_ptr + 2 + 2 * E_L, m_used)
    rb = info_ptr + 3 + 2 * E_L
    tl.store(rb + s[:, None] * E_L + ee[None, :], rowbase, mask=sm[:, None] & em[None, :])
    tl.store(rb + W * E_L + s, incl_s, mask=sm)
    tl.debug_barrier()
    kk = tl.arange(0, KP)
    km = kk < K
    # what needs no row first (it overlaps the rows still on the link): slots past the
    # received tokens (no row, no source), then row -> local expert for every row (expert
    # e on the first counts[e] rows of its group, -1 on padding and past the last group)
    tail = tl.arange(0, BR)
    for n0 in range(n_total + c * BR, W * TMAX, G * BR):
        n = (n0 + tail).to(tl.int64)
        nm = n < W * TMAX
        tl.store(src_tok_ptr + n, -1, mask=nm)
        m2 = nm[:, None] & km[None, :]
        tl.store(inv_ptr + n[:, None] * K + kk[None, :], -1, mask=m2)
        tl.store(wo_ptr + n[:, None] * K + kk[None, :], 0.0, mask=m2)
    for le in range(c, E_L, G):
        start = tl.load(info_ptr + 2 + E_L + le)
        used = tl.load(info_ptr + 2 + le)
        end = start + (used + align - 1) // align * align
        for r0 in range(start, end, BR):
            r = r0 + tail
            tl.store(row_expert_ptr + r, tl.where(r - start < used, le, -1),
                     mask=(r < end) & (r < M_MAX))
    for r0 in range(m_used + c * BR, M_MAX, G * BR):
        r = r0 + tail
        tl.store(row_expert_ptr + r, -1, mask=r < M_MAX)
    # sources whose whole send already landed (the last send CTA's word): no waits
    progw = (arena_ptr + PROG).to(tl.pointer_type(tl.int64))
    landed = tl.zeros((WP,), dtype=tl.int32)
    every = progress(e, tl.full((), ALL, dtype=tl.int32))
    for d in tl.static_range(W):
        if d != me:
            v = ld_acquire(progw + d * GMAX + GMAX - 1)
            landed = tl.where(s == d, (v >= every).to(tl.int32), landed)
    # items: one step of BT slots of one source, step-major (the order the senders fill
    # them), each waiting for the rounds of the chunks it lies in
    nst = (tl.max(nmsg, axis=0) + BT - 1) // BT
    for i in range(c, nst * W, G):
        m0 = (i // W) * BT
        src = i % W
        ns = _pick(nmsg, s, src)
        if m0 < ns:
            go = tl.full((), 1, dtype=tl.int32)
            if (src != me) & (_pick(landed, s, src) == 0):
                # every chunk of the sender's (its CTAs, its chunk size) the step touches
                g = _pick(g_s, s, src)
                ck = _pick(ck_s, s, src)
                for q in range(m0 // ck, (tl.minimum(m0 + BT, ns) - 1) // ck + 1):
                    go = go & wait_geq(progw + src * GMAX + q % g, progress(e, q // g + 1),
                                       arena_ptr, 2 * OP_D + 1, src, limit, USE_TIMER)
            first = _pick(excl_s, s, src)
            if src == me:
                _place(arena_ptr, x_ptr, s_ptr, ids_ptr, w_ptr, pos_ptr, tok_ptr, TS,
                       xo_ptr, so_ptr, inv_ptr, wo_ptr, src_tok_ptr, arow_ptr, rb, me, src,
                       ns, first, m0, buf, ROWS, META, TMAX, W, K, KP, E_L, M_MAX, DW, SW,
                       CH, BSW, ROW_W, MW, BT, True, GATHER)
            elif go != 0:
                _place(arena_ptr, x_ptr, s_ptr, ids_ptr, w_ptr, pos_ptr, tok_ptr, TS,
                       xo_ptr, so_ptr, inv_ptr, wo_ptr, src_tok_ptr, arow_ptr, rb, me, src,
                       ns, first, m0, buf, ROWS, META, TMAX, W, K, KP, E_L, M_MAX, DW, SW,
                       CH, BSW, ROW_W, MW, BT, False, GATHER)
            else:  # timed out: the step's tokens are not here (nothing reads their rows)
                n = (first + m0 + tl.arange(0, BT)).to(tl.int64)
                nm = (m0 + tl.arange(0, BT)) < ns
                m2 = nm[:, None] & km[None, :]
                tl.store(src_tok_ptr + n, -1, mask=nm)
                tl.store(inv_ptr + n[:, None] * K + kk[None, :], -1, mask=m2)
                tl.store(wo_ptr + n[:, None] * K + kk[None, :], 0.0, mask=m2)


@triton.jit
def _place(arena_ptr, x_ptr, s_ptr, ids_ptr, w_ptr, pos_ptr, tok_ptr, TS, xo_ptr, so_ptr,
           inv_ptr, wo_ptr, src_tok_ptr, arow_ptr, rb, me, src, ns, first, m0, buf,
           ROWS: tl.constexpr, META: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
           K: tl.constexpr, KP: tl.constexpr, E_L: tl.constexpr, M_MAX: tl.constexpr,
           DW: tl.constexpr, SW: tl.constexpr, CH: tl.constexpr, BSW: tl.constexpr,
           ROW_W: tl.constexpr, MW: tl.constexpr, BT: tl.constexpr, OWN: tl.constexpr,
           GATHER: tl.constexpr):
    """One step: source src's slots [m0, m0 + BT) (< ns) into the layout: received token
    n = first + slot. Own rows: token from the routing table, row from the wire rows,
    (local expert, pos, weight) from the routing; a peer's: from its meta and staged row.
    GATHER: no row copied into the layout; each of its layout rows gets the row's arena slot
    (`arow_ptr`), and own rows are copied once into the arena's own-source slots."""
    kk = tl.arange(0, KP)
    km = kk < K
    cols = tl.arange(0, CH)
    cm = cols < DW
    scols = tl.arange(0, BSW)
    m = m0 + tl.arange(0, BT)
    nm = m < ns
    n64 = (first + m).to(tl.int64)
    slot = ((buf * W + src) * TMAX + m).to(tl.int64)
    meta = (arena_ptr + META).to(tl.pointer_type(tl.int32)) + slot * MW
    pm = nm[:, None] & km[None, :]
    if OWN:  # token from the routing table, (expert, pos, weight) from the routing
        t = tl.load(tok_ptr + me * TS + m, mask=nm, other=0)
        t64 = t.to(tl.int64)
        ids = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=pm, other=-1)
        on = (ids >= me * E_L) & (ids < (me + 1) * E_L)
        le = tl.where(on, ids - me * E_L, -1).to(tl.int32)
        pos = tl.load(pos_ptr + t64[:, None] * K + kk[None, :], mask=pm & on, other=0)
        wk = tl.load(w_ptr + t64[:, None] * K + kk[None, :], mask=pm & on, other=0.0)
        rows = x_ptr + t64 * DW
        srows = s_ptr + t64 * SW
    else:  # the peer's meta and staged row
        t = tl.load(meta, mask=nm, other=0)
        t64 = t.to(tl.int64)
        le = tl.load(meta[:, None] + 1 + kk[None, :], mask=pm, other=-1)
        pos = tl.load(meta[:, None] + 1 + K + kk[None, :], mask=pm, other=0)
        wk = tl.load((meta + 1 + 2 * K).to(tl.pointer_type(tl.float32))[:, None]
                     + kk[None, :], mask=pm, other=0.0)
        rows = (arena_ptr + ROWS).to(tl.pointer_type(tl.int32)) + slot * ROW_W
        srows = rows + DW
    # every load of the step first (the rows as [BT, CH], the slots' layout rows as [BT, KP]),
    # then one [BT, CH] store of the same registers per slot k (no [BT, KP, CH] tile: BT rows
    # fit the registers); picking slot k's rows out of the tile is a cross-thread reduction,
    # but only stores follow it
    rm = nm[:, None] & cm[None, :]
    sm = nm[:, None] & (scols < SW)[None, :]
    if OWN or not GATHER:
        row = tl.load(rows[:, None] + cols[None, :], mask=rm)
        if SW > 0:
            srow = tl.load(srows[:, None] + scols[None, :], mask=sm)
    valid = pm & (le >= 0) & (le < E_L)
    r = tl.load(rb + src * E_L + le, mask=valid, other=0) + pos
    valid = valid & (r >= 0) & (r < M_MAX)
    r = tl.where(valid, r, -1)
    tl.store(inv_ptr + n64[:, None] * K + kk[None, :], r, mask=pm)
    tl.store(wo_ptr + n64[:, None] * K + kk[None, :], tl.where(valid, wk, 0.0), mask=pm)
    tl.store(src_tok_ptr + n64, src * TMAX + t, mask=nm)
    if GATHER:  # the layout rows point at the arena slot (own rows: copied there once)
        tl.store(arow_ptr + r, slot.to(tl.int32)[:, None] + 0 * r, mask=valid)
        if OWN:
            dst = (arena_ptr + ROWS).to(tl.pointer_type(tl.int32)) + slot * ROW_W
            tl.store(dst[:, None] + cols[None, :], row, mask=rm)
            if SW > 0:
                tl.store(dst[:, None] + DW + scols[None, :], srow, mask=sm)
    else:
        for k in tl.static_range(K):
            rk = tl.max(tl.where(kk[None, :] == k, r, -1), axis=1).to(tl.int64)
            vk = rk >= 0
            tl.store(xo_ptr + rk[:, None] * DW + cols[None, :], row,
                     mask=vk[:, None] & cm[None, :])
            if SW > 0:
                tl.store(so_ptr + rk[:, None] * SW + scols[None, :], srow,
                         mask=vk[:, None] & (scols < SW)[None, :])


__all__ = ["recv_rows"]
