"""symm-ht combine: the expert rank reduces each received token's rows in fp32 (k order) and
sends one bf16 row per (token, rank) back; the source sums <= W partial rows in fp32 in rank
order and casts once. That is all2all's numerics (experts' weighted sum per token, bf16 on the
wire, rank-ordered fp32 sum, one cast), so both agree bit for bit on the same expert outputs.
Region `ht_comb` of the HT arena (see `ht_dispatch.py`).

The send half is one kernel with two roles by arrival (`sync.take_role`):
  reduce  the first CTAs to start, every SM but the push's by default (`recv_sms`: the K-row
          unpermute-and-sum that a separate kernel does before DeepEP's combine): per
          received token, its partial row, stored straight into this rank's own `ht_comb`
          slot when the token is its own, else into a local staging row; each finished work
          item counts into its token block's done word (`ht_cdone`, release at GPU scope)
  push    the other 24 CTAs by default (`num_sms`: they write to peers): wait for the peers'
          acks, then block by block, as soon as a block's items are done, copy its staged
          rows to their sources' `ht_comb`; the last publishes ready
so the reduction's reads of the expert rows overlap the partial rows' trip over the link.
Every done word counts NC (column chunks) per call, words without tokens included, so all
hold the same sum before a call (kept in the control block, advanced by the grid's last CTA)
and a block is reduced exactly when its word reaches that sum + NC: nothing is reset, and
calls with other column chunks or block sizes may share the arena.
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import (CTRL_CDONE_ARRIVE, CTRL_CDONE_SUM, HT_COMBINE,  # noqa: E402
                                   LOCAL_PHASE, RankArena)
from epmoe.comm.symm.ht_dispatch import HTReceived  # noqa: E402
from epmoe.comm.symm.ht_shape import HTShape  # noqa: E402
from epmoe.comm.symm.options import SymmOptions, device_sms, grid  # noqa: E402
from epmoe.comm.symm.sum_back import sum_back  # noqa: E402
from epmoe.comm.symm.sync import (USE_TIMER, arrive_last, ctrl_ptr, epoch,  # noqa: E402
                                  finish_send_of, take_role, wait_acks, wait_geq)
from epmoe.comm.symm.tiles import (ksum, num_items, row_cols, rows_per_step,  # noqa: E402
                                   work_item)

OP_C = tl.constexpr(HT_COMBINE)
LOCAL = tl.constexpr(LOCAL_PHASE)
C_SUM = tl.constexpr(CTRL_CDONE_SUM)
C_ARRIVE = tl.constexpr(CTRL_CDONE_ARRIVE)


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
               G, e, limit, COMB: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
               D: tl.constexpr, CH: tl.constexpr, NC: tl.constexpr, BTR: tl.constexpr,
               BT: tl.constexpr, USE_TIMER: tl.constexpr):
    """The push role, CTA c of G: wait for the peers' acks, then per reduce block (BTR rows,
    in order) wait until its NC items are done (acquire, GPU scope; the block's word reaches
    `target`: what every word held before this call, + NC), and copy its staged partial rows
    of other ranks' tokens to their sources in steps of BT whole rows."""
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


@triton.jit(do_not_specialize=["me", "limit"])
def _combine_send_kernel(arena_ptr, delta_ptr, y_ptr, inv_ptr, w_ptr, src_tok_ptr, info_ptr,
                         part_ptr, me, limit, G_RED, G_PUSH, COMB: tl.constexpr,
                         DONE: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
                         K: tl.constexpr, D: tl.constexpr, CK: tl.constexpr,
                         CH: tl.constexpr, BTR: tl.constexpr, BT: tl.constexpr,
                         NWORDS: tl.constexpr, BR: tl.constexpr, PRE_ROUND: tl.constexpr,
                         USE_TIMER: tl.constexpr):
    """G_RED + G_PUSH CTAs: the first G_RED to start reduce, the rest push each block of
    partial rows as soon as it is reduced (so the reduction's HBM reads overlap the link). The
    push role waits only on reduce CTAs that already run (roles by arrival), never the other
    way round."""
    NC: tl.constexpr = (D + CK - 1) // CK
    i = take_role(arena_ptr, OP_C, G_RED + G_PUSH)
    e = epoch(arena_ptr, OP_C)
    n_total = tl.load(info_ptr)
    done = (arena_ptr + DONE).to(tl.pointer_type(tl.int32))
    before = tl.load(ctrl_ptr(arena_ptr, C_SUM))  # every done word, before this call
    if i < G_RED:
        _reduce_items(arena_ptr, y_ptr, inv_ptr, w_ptr, src_tok_ptr, part_ptr, done, n_total,
                      me, i, G_RED, e, COMB, TMAX, W, K, D, CK, BTR, NWORDS, BR, PRE_ROUND)
    else:
        _push_rows(arena_ptr, delta_ptr, part_ptr, src_tok_ptr, done, before + NC, n_total, me,
                   i - G_RED, G_PUSH, e, limit, COMB, TMAX, W, D, CH, NC, BTR, BT, USE_TIMER)
        finish_send_of(arena_ptr, delta_ptr, OP_C, e, me, W, G_PUSH)
    # the last CTA of the grid (every CTA read `before` as it started) advances the sum
    if arrive_last(arena_ptr, C_ARRIVE, G_RED + G_PUSH) != 0:
        tl.store(ctrl_ptr(arena_ptr, C_SUM), before + NC)


def combine_send(arena: RankArena, shape: HTShape, y_MD: torch.Tensor, recv: HTReceived,
                 opts: SymmOptions) -> None:
    """y_MD bf16 [M, D]: the experts' rows of the layout this rank received (unweighted)."""
    if y_MD.dtype != torch.bfloat16 or y_MD.dim() != 2 or y_MD.shape[1] != shape.hidden:
        raise ValueError(f"expert output must be bf16 [M, {shape.hidden}] rows of the "
                         f"contiguous layout, got {y_MD.dtype} {tuple(y_MD.shape)}")
    d, tmax, dev = shape.hidden, max(1, shape.max_tokens), y_MD.device
    lay = arena.layout
    part = torch.empty((shape.world * tmax, d), dtype=torch.bfloat16, device=dev)
    g_push, g_red = grid(opts, dev), grid(opts, dev, recv=True)
    sms = device_sms(dev)
    if sms and opts.recv_sms == 0:  # the roles share the SMs
        g_red = max(1, min(g_red, sms - g_push))
    btr = opts.tile(16)
    bt = min(btr, opts.tile(rows_per_step(row_cols(d), 2)))
    _combine_send_kernel[(g_red + g_push,)](
        arena.base, arena.peer_delta_W, y_MD.contiguous(), recv.inv_NK, recv.w_NK,
        recv.src_tok_N, recv.info_I, part, arena.rank, opts.spin_limit, g_red, g_push,
        COMB=lay.offset("ht_comb"), DONE=lay.offset("ht_cdone"), TMAX=tmax, W=shape.world,
        K=shape.top_k, D=d, CK=opts.chunk(d), CH=row_cols(d), BTR=btr, BT=bt,
        NWORDS=lay.size("ht_cdone") // 4, BR=1024,
        PRE_ROUND=INTERPRET, USE_TIMER=USE_TIMER, num_warps=opts.warps(),
        enable_fp_fusion=False)  # mul then add, as the reference (no FMA)


def combine_recv(arena: RankArena, shape: HTShape, msg_TW: torch.Tensor,
                 opts: SymmOptions) -> torch.Tensor:
    """-> bf16 [T, D]: this rank's tokens, partial sums of the ranks they went to (msg_TW)."""
    return sum_back(arena, HT_COMBINE, "ht_comb", msg_TW, None, True, shape.hidden,
                    shape.max_tokens, opts)
