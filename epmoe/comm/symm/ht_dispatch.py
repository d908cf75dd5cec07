"""symm-ht dispatch: straight into the experts' contiguous layout (the combine is in
`ht_combine.py`). Plain functions over a `RankArena` and tensors (the backend in `ht.py` and the
tests call the same ones). Regions of the HT arena (`HTShape.layout`), per buffer b in {0, 1}
(b = epoch % 2) and source rank s:

  ht_rows   [2][W][TMAX] rows of ROW_W int32 words: data words, then scale words
  ht_meta   [2][W][TMAX] MW words: source token t, local expert e_k (-1: not here), pos_k, w_k
  ht_counts [2][W] CW words: tokens s sent me, then pairs per local expert
  ht_comb   [2][W][TMAX] bf16 [D]: rank s's fp32-reduced partial sum for my token t

The kernels, one rank's view (every CTA loop is persistent: grid = num_sms, receive
halves recv_sms; a step moves whole rows of BT tokens, see `tiles.py`):
  dispatch_send  wait ack[s] >= e-2 (buffer b free) -> per step: BT rows, their routing and
                 meta loaded at once, stored once per destination (+ counts from CTA 0) ->
                 last CTA releases ready[me] = e at every destination
  dispatch_recv  wait ready[s] >= e -> layout from the counts (groups aligned) -> per step: BT
                 received rows and their meta loaded at once, each row stored to the layout
                 rows of its local experts; row -> expert by expert groups -> last CTA: seq =
                 e, releases ack[me] = e at every source
  combine_send   (ht_combine.py, two kernels) per received token: fp32 sum_k w_k * y[row_k]
                 (the K row loads independent: in flight together), one bf16 cast, on every
                 SM into the own ht_comb slot or a staging row; then on num_sms CTAs: wait
                 ack >= e-2, staged rows to their sources' ht_comb[b][me][t] -> ready
  combine_recv   (sum_back.py) wait ready -> per token: fp32 sum over the ranks it went to,
                 in rank order, one cast -> seq, ack
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.kernels._common import INTERPRET, next_pow2

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import HT_DISPATCH, RankArena  # noqa: E402
from epmoe.comm.symm.ht_shape import HTShape, RowFormat, max_rows  # noqa: E402
from epmoe.comm.symm.options import SymmOptions, grid  # noqa: E402
from epmoe.comm.symm.route import SendRoute  # noqa: E402
from epmoe.comm.symm.sync import (USE_TIMER, epoch, finish_recv,  # noqa: E402
                                  finish_send, peer_ptr, wait_acks, wait_ready)
from epmoe.comm.symm.tiles import row_cols, rows_per_step  # noqa: E402
from epmoe.layout import ContiguousLayout  # noqa: E402
from epmoe.quant import QTensor  # noqa: E402

OP_D = tl.constexpr(HT_DISPATCH)


# --------------------------------------------------------------------------------------------
@triton.jit
def _dispatch_send_kernel(arena_ptr, delta_ptr, x_ptr, s_ptr, ids_ptr, w_ptr, pos_ptr,
                          msg_ptr, total_ptr, T, me, limit,
                          ROWS: tl.constexpr, META: tl.constexpr, CNT: tl.constexpr,
                          TMAX: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                          K: tl.constexpr, KP: tl.constexpr, E_L: tl.constexpr,
                          EP: tl.constexpr, DW: tl.constexpr, SW: tl.constexpr,
                          CH: tl.constexpr, BSW: tl.constexpr, ROW_W: tl.constexpr,
                          MW: tl.constexpr, CW: tl.constexpr, BT: tl.constexpr,
                          USE_TIMER: tl.constexpr):
    """A step: BT tokens' whole rows (one load), routing and meta loaded with them, then the
    rows, scales and meta stored once per destination rank."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    e = epoch(arena_ptr, OP_D)
    buf = e % 2
    ok = wait_acks(arena_ptr, OP_D, e - 2, limit, W, USE_TIMER)
    if ok != 0:
        cols = tl.arange(0, CH)
        cm = cols < DW
        scols = tl.arange(0, BSW)
        kk = tl.arange(0, KP)
        km = kk < K
        for t0 in range(pid * BT, T, G * BT):
            t = t0 + tl.arange(0, BT)
            tm = t < T
            t64 = t.to(tl.int64)
            m2 = tm[:, None] & km[None, :]
            row = tl.load(x_ptr + t64[:, None] * DW + cols[None, :], mask=tm[:, None] & cm[None, :])
            if SW > 0:
                srow = tl.load(s_ptr + t64[:, None] * SW + scols[None, :],
                               mask=tm[:, None] & (scols < SW)[None, :])
            ids = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=-1)
            ids = ids.to(tl.int32)
            wk = tl.load(w_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=0.0)
            pos = tl.load(pos_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=0)
            for d in tl.static_range(W):
                m = tl.load(msg_ptr + t64 * W + d, mask=tm, other=-1)  # own [BT] load: no pick
                sent = m >= 0
                slot = ((buf * W + me) * TMAX + m).to(tl.int64)
                peer = peer_ptr(arena_ptr, delta_ptr, d)
                dst = (peer + ROWS).to(tl.pointer_type(tl.int32)) + slot * ROW_W
                far = sent & (me != d)  # the own rows stay in x: the receive reads them there
                tl.store(dst[:, None] + cols[None, :], row, mask=far[:, None] & cm[None, :])
                if SW > 0:
                    tl.store(dst[:, None] + DW + scols[None, :], srow,
                             mask=far[:, None] & (scols < SW)[None, :])
                meta = (peer + META).to(tl.pointer_type(tl.int32)) + slot * MW
                on_d = (ids >= d * E_L) & (ids < (d + 1) * E_L)
                mk = sent[:, None] & km[None, :]
                tl.store(meta, t, mask=sent)
                tl.store(meta[:, None] + 1 + kk[None, :], tl.where(on_d, ids - d * E_L, -1),
                         mask=mk)
                tl.store(meta[:, None] + 1 + K + kk[None, :], tl.where(on_d, pos, 0), mask=mk)
                wmeta = (meta + 1 + 2 * K).to(tl.pointer_type(tl.float32))
                tl.store(wmeta[:, None] + kk[None, :], tl.where(on_d, wk, 0.0), mask=mk)
        if pid == 0:
            ee = tl.arange(0, EP)
            for d in tl.static_range(W):
                peer = peer_ptr(arena_ptr, delta_ptr, d)
                cnt = (peer + CNT).to(tl.pointer_type(tl.int32)) + (buf * W + me) * CW
                tl.store(cnt, tl.load(total_ptr + E_L * W + d))
                tl.store(cnt + 1 + ee, tl.load(total_ptr + d * E_L + ee, mask=ee < E_L),
                         mask=ee < E_L)
    finish_send(arena_ptr, delta_ptr, OP_D, e, me, W)


@triton.jit
def _dispatch_recv_kernel(arena_ptr, delta_ptr, x_ptr, s_ptr, xo_ptr, so_ptr,
                          row_expert_ptr, inv_ptr,
                          wo_ptr, src_tok_ptr, info_ptr, align, me, limit,
                          ROWS: tl.constexpr, META: tl.constexpr, CNT: tl.constexpr,
                          TMAX: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                          K: tl.constexpr, KP: tl.constexpr, E_L: tl.constexpr,
                          EP: tl.constexpr, M_MAX: tl.constexpr, DW: tl.constexpr,
                          SW: tl.constexpr, CH: tl.constexpr, BSW: tl.constexpr,
                          ROW_W: tl.constexpr, MW: tl.constexpr, CW: tl.constexpr,
                          BT: tl.constexpr, BR: tl.constexpr, USE_TIMER: tl.constexpr):
    """A step: BT received tokens (whole rows, one load, with their meta), each row stored to
    the layout rows of its local experts (one [BT, KP, CH] store of the same registers). The
    own rank's rows are read from its wire rows x / s, never staged in the arena."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    e = epoch(arena_ptr, OP_D)
    buf = e % 2
    ok = wait_ready(arena_ptr, OP_D, e, limit, W, USE_TIMER)
    if ok != 0:
        s = tl.arange(0, WP)
        ee = tl.arange(0, EP)
        sm = s < W
        em = ee < E_L
        cnt_p = (arena_ptr + CNT).to(tl.pointer_type(tl.int32)) + (buf * W + s) * CW
        nmsg = tl.minimum(tl.load(cnt_p, mask=sm, other=0), TMAX)
        cnt = tl.load(cnt_p[:, None] + 1 + ee[None, :], mask=sm[:, None] & em[None, :],
                      other=0)
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
        cols = tl.arange(0, CH)
        cm = cols < DW
        scols = tl.arange(0, BSW)
        for n0 in range(pid * BT, n_total, G * BT):
            n = n0 + tl.arange(0, BT)
            nm = n < n_total
            n64 = n.to(tl.int64)
            # received tokens lie source after source: n's source and its index there
            src = tl.sum(((n[:, None] >= incl_s[None, :]) & sm[None, :]).to(tl.int32), axis=1)
            first = tl.sum(tl.where(s[None, :] == src[:, None], excl_s[None, :], 0), axis=1)
            slot = ((buf * W + src) * TMAX + n - first).to(tl.int64)
            meta = (arena_ptr + META).to(tl.pointer_type(tl.int32)) + slot * MW
            t = tl.load(meta, mask=nm, other=0)
            own = src == me
            t64 = t.to(tl.int64)
            # the row as [BT, 1, CH]: stored to its K layout rows by one [BT, KP, CH] store
            staged = (arena_ptr + ROWS).to(tl.pointer_type(tl.int32)) + slot * ROW_W
            rows = tl.where(own, x_ptr + t64 * DW, staged)
            row = tl.load(rows[:, None, None] + cols[None, None, :],
                          mask=nm[:, None, None] & cm[None, None, :])
            if SW > 0:
                srows = tl.where(own, s_ptr + t64 * SW, staged + DW)
                srow = tl.load(srows[:, None, None] + scols[None, None, :],
                               mask=nm[:, None, None] & (scols < SW)[None, None, :])
            pm = nm[:, None] & km[None, :]
            le = tl.load(meta[:, None] + 1 + kk[None, :], mask=pm, other=-1)
            pos = tl.load(meta[:, None] + 1 + K + kk[None, :], mask=pm, other=0)
            wk = tl.load((meta + 1 + 2 * K).to(tl.pointer_type(tl.float32))[:, None]
                         + kk[None, :], mask=pm, other=0.0)
            valid = pm & (le >= 0) & (le < E_L)
            r = tl.load(rb + src[:, None] * E_L + le, mask=valid, other=0) + pos
            valid = valid & (r >= 0) & (r < M_MAX)
            r64 = r.to(tl.int64)[:, :, None]
            tl.store(xo_ptr + r64 * DW + cols[None, None, :], row,
                     mask=valid[:, :, None] & cm[None, None, :])
            if SW > 0:
                tl.store(so_ptr + r64 * SW + scols[None, None, :], srow,
                         mask=valid[:, :, None] & (scols < SW)[None, None, :])
            tl.store(inv_ptr + n64[:, None] * K + kk[None, :], tl.where(valid, r, -1), mask=pm)
            tl.store(wo_ptr + n64[:, None] * K + kk[None, :], tl.where(valid, wk, 0.0), mask=pm)
            tl.store(src_tok_ptr + n64, src * TMAX + t, mask=nm)
        # slots past the received tokens: no row, no source
        tail = tl.arange(0, BR)
        for n0 in range(n_total + pid * BR, W * TMAX, G * BR):
            n = (n0 + tail).to(tl.int64)
            nm = n < W * TMAX
            tl.store(src_tok_ptr + n, -1, mask=nm)
            m2 = nm[:, None] & km[None, :]
            tl.store(inv_ptr + n[:, None] * K + kk[None, :], -1, mask=m2)
            tl.store(wo_ptr + n[:, None] * K + kk[None, :], 0.0, mask=m2)
        # row -> local expert for every row: expert e on the first counts[e] rows of its
        # group, -1 on the group's padding and past the last group (stores only)
        rr = tl.arange(0, BR)
        for le in range(pid, E_L, G):
            start = tl.load(info_ptr + 2 + E_L + le)
            used = tl.load(info_ptr + 2 + le)
            end = start + (used + align - 1) // align * align
            for r0 in range(start, end, BR):
                r = r0 + rr
                tl.store(row_expert_ptr + r, tl.where(r - start < used, le, -1), mask=r < end)
        for r0 in range(m_used + pid * BR, M_MAX, G * BR):
            r = r0 + rr
            tl.store(row_expert_ptr + r, -1, mask=r < M_MAX)
    finish_recv(arena_ptr, delta_ptr, OP_D, e, me, W)


# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HTReceived:
    """What a rank keeps between its dispatch receive and its combine (all on the device).

    inv_NK     int32 [W*TMAX, K] layout row of (received token n, slot k); -1: not here / n >= N
    w_NK       fp32 [W*TMAX, K] the top-k weights of those slots (0 where -1)
    src_tok_N  int32 [W*TMAX] source rank * TMAX + source token of received token n (-1 past N)
    info_I     int32: N, M used, counts_E [E_L], offsets_E1 [E_L + 1], row bases [W][E_L],
               tokens received up to each source [W]
    """

    inv_NK: torch.Tensor
    w_NK: torch.Tensor
    src_tok_N: torch.Tensor
    info_I: torch.Tensor


def _consts(arena: RankArena, shape: HTShape, opts: SymmOptions) -> dict:
    lay = arena.layout
    e_l = shape.num_local_experts
    dw, sw = shape.data_bytes // 4, shape.scale_bytes // 4
    return dict(ROWS=lay.offset("ht_rows"), META=lay.offset("ht_meta"),
                CNT=lay.offset("ht_counts"), TMAX=max(1, shape.max_tokens), W=shape.world,
                WP=next_pow2(shape.world), K=shape.top_k, KP=next_pow2(shape.top_k), E_L=e_l,
                EP=next_pow2(e_l), DW=dw, SW=sw, CH=row_cols(dw), BSW=next_pow2(max(sw, 1)),
                ROW_W=shape.row_words, MW=shape.meta_words, CW=shape.count_words,
                USE_TIMER=USE_TIMER, num_warps=opts.warps())


def _words(x: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Wire rows as int32 words: (data [T, DW], scales [T, SW]; the data again if none)."""
    data = x.data.contiguous().view(torch.int32)
    return data, data if x.scale is None else x.scale.contiguous().view(torch.int32)


def dispatch_send(arena: RankArena, shape: HTShape, x: QTensor, topk_ids_TK: torch.Tensor,
                  topk_weights_TK: torch.Tensor, rt: SendRoute, opts: SymmOptions) -> None:
    """Publish this rank's rows (x: wire-format QTensor [T, D]) to every destination rank."""
    t = x.data.shape[0]
    if t > shape.max_tokens:
        raise ValueError(f"tokens per rank ({t}) exceed the arena's max_tokens_per_rank "
                         f"({shape.max_tokens}); size the CommContext for the run's worst case")
    data, scale = _words(x)
    _dispatch_send_kernel[(grid(opts, data.device),)](
        arena.base, arena.peer_delta_W, data, scale, topk_ids_TK.contiguous(),
        topk_weights_TK.float().contiguous(), rt.pos_TK, rt.msg_TW, rt.total_C, t,
        arena.rank, opts.spin_limit, BT=opts.tile(rows_per_step(row_cols(shape.data_bytes // 4))),
        **_consts(arena, shape, opts))


def dispatch_recv(arena: RankArena, shape: HTShape, fmt: RowFormat, alignment: int,
                  x: QTensor, opts: SymmOptions) -> tuple[QTensor, ContiguousLayout, HTReceived]:
    """Wait for every rank's rows and write them into the contiguous layout (worst-case M).
    x: the wire rows this rank's `dispatch_send` sent (its own rows are read from there)."""
    dev = arena.base.device
    e_l, w, k = shape.num_local_experts, shape.world, shape.top_k
    m = max_rows(shape, alignment)
    n = w * max(1, shape.max_tokens)
    dw, sw = shape.data_bytes // 4, shape.scale_bytes // 4
    xo = torch.empty((m, dw), dtype=torch.int32, device=dev)
    so = torch.empty((m, max(sw, 1)), dtype=torch.int32, device=dev)
    row_expert = torch.empty(m, dtype=torch.int32, device=dev)
    inv = torch.empty((n, k), dtype=torch.int32, device=dev)
    wo = torch.empty((n, k), dtype=torch.float32, device=dev)
    src_tok = torch.empty(n, dtype=torch.int32, device=dev)
    info = torch.empty(3 + 2 * e_l + w * e_l + w, dtype=torch.int32, device=dev)
    data, scale = _words(x)
    _dispatch_recv_kernel[(grid(opts, dev, recv=True),)](
        arena.base, arena.peer_delta_W, data, scale, xo, so, row_expert, inv, wo, src_tok, info, alignment,
        arena.rank, opts.spin_limit, M_MAX=m, BR=1024 if INTERPRET else 2048,
        BT=opts.tile(min(4, rows_per_step(row_cols(dw)))), **_consts(arena, shape, opts))
    scale = None if sw == 0 else so.view(fmt.scale_dtype)[:, :fmt.scale_cols]
    x = QTensor(xo.view(fmt.data_dtype), scale, fmt.recipe, fmt.group, fmt.scale_fmt)
    layout = ContiguousLayout(row_expert_M=row_expert, inv_perm_NK=inv,
                              counts_E=info[2:2 + e_l], offsets_E1=info[2 + e_l:3 + 2 * e_l],
                              alignment=alignment)
    return x, layout, HTReceived(inv, wo, src_tok, info)
