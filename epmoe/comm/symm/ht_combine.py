"""symm-ht combine: the expert rank reduces each received token's rows in fp32 (k order) and
sends one bf16 row per (token, rank) back; the source sums <= W partial rows in fp32 in rank
order and casts once. That is all2all's numerics (experts' weighted sum per token, bf16 on the
wire, rank-ordered fp32 sum, one cast), so both agree bit for bit on the same expert outputs.
Regions `ht_comb`, `ht_cdone` and `ht_csum` of the HT arena (see `ht_dispatch.py`).

One kernel, up to three roles by arrival (`sync.take_role`):
  reduce  the first CTAs to start, every SM but the push's by default (`recv_sms`: the K-row
          unpermute-and-sum that a separate kernel does before DeepEP's combine): per
          received token, its partial row, stored straight into this rank's own `ht_comb`
          slot when the token is its own, else into a local staging row; each finished work
          item counts into its token block's done word (`ht_cdone`, release at GPU scope)
  push    the next 24 CTAs by default (`num_sms`: they write to peers): wait for the peers'
          acks, then block by block, as soon as a block's items are done, copy its staged
          rows to their sources' `ht_comb`, and count every row of the block, pushed or own,
          into its source's landing counter (`ht_csum[b][me][t // SB]`, one release per block)
  sum     (the receive: `recv_sms` CTAs) per block of SB own tokens, wait until each rank's
          counter holds the rows that rank owes it, sum them in rank order, cast once; the
          call's last CTA zeroes the counters (so they need no epoch: the next use of
          buffer b waits for this call's ack)
Split (the loopback world, run rank by rank): reduce + push in `combine_send`, the sum in
`combine_recv`. Pipelined (real ranks, `SymmOptions.pipelined`): all three in one kernel, so
the source sums a token block as soon as its rows have landed, while the rest is still on
the link; its last CTA ends the call (seq, acks), after every CTA has read the epoch.
Every done word counts NC (column chunks) per call, words without tokens included, so all
hold the same sum before a call (kept in the control block, advanced by the grid's last CTA)
and a block is reduced exactly when its word reaches that sum + NC: nothing is reset, and
calls with other column chunks or block sizes may share the arena.
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET
from epmoe.kernels.launcher import Launcher

from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import (CTRL_CDONE_ARRIVE, CTRL_CDONE_SUM, HT_COMBINE,  # noqa: E402
                                   LOCAL_PHASE, RankArena)
from epmoe.comm.symm.ht_dispatch import HTReceived  # noqa: E402
from epmoe.comm.symm.ht_shape import HTShape  # noqa: E402
from epmoe.comm.symm.options import SymmOptions, device_sms, grid  # noqa: E402
from epmoe.comm.symm.sync import (C_DONE_RECV, USE_TIMER, arrive_last, ctrl_ptr,  # noqa: E402
                                  end_call, epoch, fence_release, take_role, wait_acks,
                                  wait_geq)
from epmoe.comm.symm.tiles import (ksum, num_items, row_cols, rows_per_step,  # noqa: E402
                                   work_item)

OP_C = tl.constexpr(HT_COMBINE)
LOCAL = tl.constexpr(LOCAL_PHASE)
C_SUM = tl.constexpr(CTRL_CDONE_SUM)
C_ARRIVE = tl.constexpr(CTRL_CDONE_ARRIVE)
SPLIT, PIPELINED = 0, 1  # the send kernel's MODE
PIPE = tl.constexpr(PIPELINED)


@triton.jit
def _reduce_items(arena_ptr, y_ptr, inv_ptr, w_ptr, src_tok_ptr, part_ptr, done_ptr, n_total,
                  me, c, G, e, COMB: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
                  K: tl.constexpr, D: tl.constexpr, CK: tl.constexpr, BT: tl.constexpr,
                  NWORDS: tl.constexpr, BR: tl.constexpr, PRE_ROUND: tl.constexpr):
    """The reduce role, CTA c of G. A work item: BT received tokens x one chunk of CK
    columns, their K row chunks (K independent [BT, CK] loads, in flight together) weighted
    and summed in k order (`ksum`), stored to the own ht_comb slot (this rank's tokens: nobody
    else reads that slot, and this rank's previous combine_recv of the same buffer ran before
    on its stream) or staged; then the block's done word += 1 (release, GPU scope). Every
    other word of the region gets its NC at once: every word counts NC per call, whatever
    the block size or NC of other calls on this arena."""
    NC: tl.constexpr = (D + CK - 1) // CK
    buf = e % 2
    own_p = (arena_ptr + COMB).to(tl.pointer_type(tl.bfloat16))
    for it in range(c, num_items(n_total, BT, NC), G):
        n, cols, cm = work_item(it, BT, CK, NC, D)
        nm = n < n_total
        n64 = n.to(tl.int64)
        st = tl.load(src_tok_ptr + n64, mask=nm, other=-1)
        nm = nm & (st >= 0)  # -1: a token whose rows timed out (no source to send back to)
        acc = ksum(y_ptr, inv_ptr, w_ptr, n64, nm, n64, 0, cols, cm, D, K, K, True, True,
                   PRE_ROUND)
        own = own_p + ((buf * W + me) * TMAX + st % TMAX).to(tl.int64) * D
        dst = tl.where(st // TMAX == me, own, part_ptr + n64 * D)
        tl.store(dst[:, None] + cols[None, :], acc.to(tl.bfloat16),
                 mask=nm[:, None] & cm[None, :])
        tl.debug_barrier()
        tl.atomic_add(done_ptr + it // NC, 1, sem="release", scope="gpu")
    rr = tl.arange(0, BR)
    for b0 in range((n_total + BT - 1) // BT + c * BR, NWORDS, G * BR):
        b = b0 + rr
        tl.atomic_add(done_ptr + b, NC, mask=b < NWORDS, sem="relaxed", scope="gpu")


@triton.jit
def _push_rows(arena_ptr, delta_ptr, part_ptr, src_tok_ptr, done_ptr, target, n_total, me, c,
               G, e, limit, COMB: tl.constexpr, CSUM: tl.constexpr, SB: tl.constexpr,
               NB: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr, D: tl.constexpr,
               CH: tl.constexpr, NC: tl.constexpr, BTR: tl.constexpr, BT: tl.constexpr,
               USE_TIMER: tl.constexpr):
    """The push role, CTA c of G: wait for the peers' acks, then per reduce block (BTR rows,
    in order) wait until its NC items are done (acquire, GPU scope; the block's word reaches
    `target`: what every word held before this call, + NC), copy its staged partial rows of
    other ranks' tokens to their sources in steps of BT whole rows, and release the block:
    one fence, then each of its rows (own tokens' too: the reduce stored those in place)
    counts into its source's landing counter of its token's block."""
    buf = e % 2
    ok = wait_acks(arena_ptr, OP_C, e - 2, limit, W, USE_TIMER)
    if ok != 0:
        cols = tl.arange(0, CH)
        cm = cols < D
        for blk in range(c, (n_total + BTR - 1) // BTR, G):
            ok = ok & wait_geq(done_ptr + blk, target, arena_ptr, LOCAL + OP_C, me, limit,
                               USE_TIMER)
            for n0 in range(blk * BTR, blk * BTR + BTR * ok, BT):  # none after a timeout
                n = n0 + tl.arange(0, BT)
                n64 = n.to(tl.int64)
                nm = n < n_total
                st = tl.load(src_tok_ptr + n64, mask=nm, other=-1)
                nm = nm & (st >= 0) & (st // TMAX != me)
                m2 = nm[:, None] & cm[None, :]
                row = tl.load(part_ptr + n64[:, None] * D + cols[None, :], mask=m2)
                peer = arena_ptr + tl.multiple_of(
                    tl.load(delta_ptr + st // TMAX, mask=nm, other=0), 128)  # wide stores
                dst = (peer + COMB).to(tl.pointer_type(tl.bfloat16)) \
                    + ((buf * W + me) * TMAX + st % TMAX).to(tl.int64) * D
                tl.store(dst[:, None] + cols[None, :], row, mask=m2)
            if ok != 0:
                tl.debug_barrier()
                fence_release()
                n = blk * BTR + tl.arange(0, BTR)
                nm = n < n_total
                st = tl.load(src_tok_ptr + n, mask=nm, other=-1)
                nm = nm & (st >= 0)
                peer = arena_ptr + tl.load(delta_ptr + st // TMAX, mask=nm, other=0)
                cnt = (peer + CSUM).to(tl.pointer_type(tl.int32)) \
                    + (buf * W + me) * NB + (st % TMAX) // SB
                tl.atomic_add(cnt, 1, mask=nm, sem="relaxed", scope="sys")


@triton.jit
def _sum_blocks(arena_ptr, out_ptr, msg_ptr, T, me, c, G, e, limit, COMB: tl.constexpr,
                CSUM: tl.constexpr, SB: tl.constexpr, NB: tl.constexpr, TMAX: tl.constexpr,
                W: tl.constexpr, D: tl.constexpr, CK: tl.constexpr,
                PRE_ROUND: tl.constexpr, USE_TIMER: tl.constexpr):
    """The sum role (the receive), CTA c of G. A work item: SB own tokens (one landing
    counter's block) x one chunk of CK columns; each CTA takes a contiguous run of items
    (block-major), so it waits once per block: until every rank's counter of the block holds
    the rows that rank owes it (msg_TW >= 0: where the tokens went). Then per item the fp32
    sum of the ranks' partial rows in rank order, one bf16 cast. The call's last CTA zeroes
    the counters (`_end_sum`)."""
    NC: tl.constexpr = (D + CK - 1) // CK
    buf = e % 2
    comb = (arena_ptr + COMB).to(tl.pointer_type(tl.bfloat16))
    cnt = (arena_ptr + CSUM).to(tl.pointer_type(tl.int32)) + buf * W * NB
    n_it = num_items(T, SB, NC)
    per = (n_it + G - 1) // G
    ok = tl.full((), 1, dtype=tl.int32)
    waited = tl.full((), -1, dtype=tl.int32)
    for it in range(c * per, tl.minimum(c * per + per, n_it)):
        t, cols, cm = work_item(it, SB, CK, NC, D)
        tm = t < T
        t64 = t.to(tl.int64)
        b = it // NC
        if b != waited:
            for d in tl.static_range(W):
                owed = tl.sum((tl.load(msg_ptr + t64 * W + d, mask=tm, other=-1) >= 0)
                              .to(tl.int32))
                if owed > 0:
                    ok = ok & wait_geq(cnt + d * NB + b, owed, arena_ptr, 2 * OP_C + 1, d,
                                       limit, USE_TIMER)
            waited = b
        if ok != 0:
            acc = ksum(comb, msg_ptr, msg_ptr, t64, tm, buf * W * TMAX + t64, TMAX, cols, cm,
                       D, W, W, False, False, PRE_ROUND)
            tl.store(out_ptr + t64[:, None] * D + cols[None, :], acc.to(tl.bfloat16),
                     mask=tm[:, None] & cm[None, :])


@triton.jit
def _end_sum(arena_ptr, delta_ptr, e, me, CSUM: tl.constexpr, NB: tl.constexpr,
             W: tl.constexpr, BR: tl.constexpr):
    """In the call's last CTA (every sum CTA is past its waits): zero this buffer's landing
    counters, then seq = e and ack[me] = e everywhere (the counters are zero before any
    peer may push into this buffer again: it waits for that ack)."""
    cnt = (arena_ptr + CSUM).to(tl.pointer_type(tl.int32)) + (e % 2) * W * NB
    for i0 in range(0, W * NB, BR):
        i = i0 + tl.arange(0, BR)
        tl.store(cnt + i, 0, mask=i < W * NB)
    tl.debug_barrier()
    end_call(arena_ptr, delta_ptr, OP_C, e, me, W)


@triton.jit(do_not_specialize=["T", "me", "limit"])
def _combine_kernel(arena_ptr, delta_ptr, y_ptr, inv_ptr, w_ptr, src_tok_ptr, info_ptr,
                    part_ptr, out_ptr, msg_ptr, T, me, limit, G_RED, G_PUSH, G_SUM,
                    COMB: tl.constexpr, DONE: tl.constexpr, CSUM: tl.constexpr,
                    SB: tl.constexpr, NB: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
                    K: tl.constexpr, D: tl.constexpr, CK: tl.constexpr, CH: tl.constexpr,
                    BTR: tl.constexpr, BT: tl.constexpr, NWORDS: tl.constexpr,
                    BR: tl.constexpr, MODE: tl.constexpr, PRE_ROUND: tl.constexpr,
                    USE_TIMER: tl.constexpr):
    """G_RED + G_PUSH (+ G_SUM when PIPELINED) CTAs: the first G_RED to start reduce, the next
    G_PUSH push each block of partial rows as soon as it is reduced (so the reduction's HBM
    reads overlap the link), the rest sum the blocks whose rows have landed. A role waits only
    on roles of CTAs that started before it (or on peers), never the other way round."""
    NC: tl.constexpr = (D + CK - 1) // CK
    i = take_role(arena_ptr, OP_C, G_RED + G_PUSH + G_SUM)
    e = epoch(arena_ptr, OP_C)
    done = (arena_ptr + DONE).to(tl.pointer_type(tl.int32))
    before = tl.load(ctrl_ptr(arena_ptr, C_SUM))  # every done word, before this call
    if i < G_RED:
        n_total = tl.load(info_ptr)
        _reduce_items(arena_ptr, y_ptr, inv_ptr, w_ptr, src_tok_ptr, part_ptr, done, n_total,
                      me, i, G_RED, e, COMB, TMAX, W, K, D, CK, BTR, NWORDS, BR, PRE_ROUND)
    elif i < G_RED + G_PUSH:
        n_total = tl.load(info_ptr)
        _push_rows(arena_ptr, delta_ptr, part_ptr, src_tok_ptr, done, before + NC, n_total, me,
                   i - G_RED, G_PUSH, e, limit, COMB, CSUM, SB, NB, TMAX, W, D, CH, NC, BTR,
                   BT, USE_TIMER)
    else:
        _sum_blocks(arena_ptr, out_ptr, msg_ptr, T, me, i - G_RED - G_PUSH, G_SUM, e, limit,
                    COMB, CSUM, SB, NB, TMAX, W, D, CK, PRE_ROUND, USE_TIMER)
    # the last CTA of the grid (every CTA read `before` and `e` as it started) advances the
    # sum, and in one kernel with the sum ends the call: seq = e, ack[me] = e everywhere
    if arrive_last(arena_ptr, C_ARRIVE, G_RED + G_PUSH + G_SUM) != 0:
        tl.store(ctrl_ptr(arena_ptr, C_SUM), before + NC)
        if MODE == PIPE:
            _end_sum(arena_ptr, delta_ptr, e, me, CSUM, NB, W, BR)


@triton.jit(do_not_specialize=["T", "me", "limit"])
def _sum_kernel(arena_ptr, delta_ptr, out_ptr, msg_ptr, T, me, limit, COMB: tl.constexpr,
                CSUM: tl.constexpr, SB: tl.constexpr, NB: tl.constexpr, TMAX: tl.constexpr,
                W: tl.constexpr, D: tl.constexpr, CK: tl.constexpr, PRE_ROUND: tl.constexpr,
                USE_TIMER: tl.constexpr):
    """The sum role as its own launch (split mode), then the call's end (seq, acks)."""
    e = epoch(arena_ptr, OP_C)
    _sum_blocks(arena_ptr, out_ptr, msg_ptr, T, me, tl.program_id(0), tl.num_programs(0), e,
                limit, COMB, CSUM, SB, NB, TMAX, W, D, CK, PRE_ROUND, USE_TIMER)
    if arrive_last(arena_ptr, C_DONE_RECV + OP_C, tl.num_programs(0)) != 0:
        _end_sum(arena_ptr, delta_ptr, e, me, CSUM, NB, W, 1024)


@dataclass(frozen=True)
class HTCombineArgs:
    """What both launches of a combine need besides the arena: the expert rows, what the
    dispatch received, where this rank's tokens went, and the output (bf16 [T, D])."""

    y_MD: torch.Tensor
    recv: HTReceived
    msg_TW: torch.Tensor
    out_TD: torch.Tensor


def prepare(shape: HTShape, y_MD: torch.Tensor, recv: HTReceived,
            msg_TW: torch.Tensor) -> HTCombineArgs:
    """y_MD bf16 [M, D]: the experts' rows of the layout this rank received (unweighted)."""
    if y_MD.dtype != torch.bfloat16 or y_MD.dim() != 2 or y_MD.shape[1] != shape.hidden:
        raise ValueError(f"expert output must be bf16 [M, {shape.hidden}] rows of the "
                         f"contiguous layout, got {y_MD.dtype} {tuple(y_MD.shape)}")
    out = torch.empty((msg_TW.shape[0], shape.hidden), dtype=torch.bfloat16,
                      device=y_MD.device)
    return HTCombineArgs(y_MD.contiguous(), recv, msg_TW.contiguous(), out)


def _consts(arena: RankArena, shape: HTShape, opts: SymmOptions) -> dict:
    """The constexprs the combine kernel and the sum kernel share."""
    lay = arena.layout
    return dict(COMB=lay.offset("ht_comb"), CSUM=lay.offset("ht_csum"), SB=shape.sum_block,
                NB=shape.sum_blocks, TMAX=max(1, shape.max_tokens), W=shape.world,
                D=shape.hidden, CK=opts.chunk(shape.hidden), PRE_ROUND=INTERPRET,
                USE_TIMER=USE_TIMER)


class HTCombine:
    """The combine kernel (one Launcher per MODE) and the split sum's kernel with their
    constants, options and grids bound once (a backend builds it at construction;
    `epmoe.kernels.launcher`)."""

    def __init__(self, arena: RankArena, shape: HTShape, opts: SymmOptions):
        dev, d, lay = arena.base.device, shape.hidden, arena.layout
        self.arena, self.shape = arena, shape
        g_push, g_red = grid(opts, dev), grid(opts, dev, recv=True)
        g_sum = g_red  # pipelined; split: none
        sms = device_sms(dev)
        if sms and opts.recv_sms == 0:  # the roles share the SMs
            g_red = max(1, min(g_red, sms - g_push))
        # mode -> (grid, G_RED, G_PUSH, G_SUM)
        self.grids = {SPLIT: ((g_red + g_push,), g_red, g_push, 0),
                      PIPELINED: ((g_red + g_push + g_sum,), g_red, g_push, g_sum)}
        consts, warps = _consts(arena, shape, opts), opts.warps()
        btr = opts.tile(16)
        bt = min(btr, opts.tile(rows_per_step(row_cols(d), 2)))
        self.send = {mode: Launcher(_combine_kernel, dict(
            consts, DONE=lay.offset("ht_cdone"), K=shape.top_k, CH=row_cols(d), BTR=btr,
            BT=bt, NWORDS=lay.size("ht_cdone") // 4, BR=1024, MODE=mode), num_warps=warps,
            enable_fp_fusion=False)  # mul then add, as the reference
            for mode in (SPLIT, PIPELINED)}
        self.sum = Launcher(_sum_kernel, consts, num_warps=warps, enable_fp_fusion=False)
        self.sum_grid = (grid(opts, dev, recv=True),)

    def combine_send(self, a: HTCombineArgs, mode: int, opts: SymmOptions) -> None:
        """Reduce + push (SPLIT), or reduce + push + sum in one grid (PIPELINED: `a.out_TD`
        holds the result in stream order after it; `combine_recv` is then not launched)."""
        shape, arena = self.shape, self.arena
        part = torch.empty((shape.world * max(1, shape.max_tokens), shape.hidden),
                           dtype=torch.bfloat16, device=a.y_MD.device)
        g, g_red, g_push, g_sum = self.grids[mode]
        r = a.recv
        self.send[mode](g, arena.base, arena.peer_delta_W, a.y_MD, r.inv_NK, r.w_NK,
                        r.src_tok_N, r.info_I, part, a.out_TD, a.msg_TW, a.msg_TW.shape[0],
                        arena.rank, opts.spin_limit, g_red, g_push, g_sum)

    def combine_recv(self, a: HTCombineArgs, opts: SymmOptions) -> torch.Tensor:
        """The sum as its own launch (SPLIT) -> bf16 [T, D]: this rank's tokens, the partial
        sums of the ranks they went to (msg_TW), in rank order."""
        arena = self.arena
        self.sum(self.sum_grid, arena.base, arena.peer_delta_W, a.out_TD, a.msg_TW,
                 a.msg_TW.shape[0], arena.rank, opts.spin_limit)
        return a.out_TD
