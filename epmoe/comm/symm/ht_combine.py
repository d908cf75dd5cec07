"""symm-ht combine: the expert rank reduces each received token's rows in fp32 (k order) and
sends one bf16 row per (token, rank) back; the source sums <= W partial rows in fp32 in rank
order and casts once. That is all2all's numerics (experts' weighted sum per token, bf16 on the
wire, rank-ordered fp32 sum, one cast), so both agree bit for bit on the same expert outputs.
Region `ht_comb` of the HT arena (see `ht_dispatch.py`).

The send half is two kernels, as the dispatch's halves are split by what they touch:
  combine_reduce  local, every SM by default (`recv_sms`: the K-row unpermute-and-sum that a
                  separate kernel does before DeepEP's combine): per received token, its
                  partial row, stored straight into this rank's own `ht_comb` slot when the
                  token is its own, else into a local staging row
  combine_push    24 CTAs by default (`num_sms`: they write to peers): wait for the peers'
                  acks, copy the staged rows to their sources' `ht_comb`, publish ready
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import HT_COMBINE, RankArena  # noqa: E402
from epmoe.comm.symm.ht_dispatch import HTReceived  # noqa: E402
from epmoe.comm.symm.ht_shape import HTShape  # noqa: E402
from epmoe.comm.symm.options import SymmOptions, grid  # noqa: E402
from epmoe.comm.symm.sum_back import sum_back  # noqa: E402
from epmoe.comm.symm.sync import USE_TIMER, epoch, finish_send, wait_acks  # noqa: E402
from epmoe.comm.symm.tiles import (ksum, num_items, row_cols, rows_per_step,  # noqa: E402
                                   work_item)

OP_C = tl.constexpr(HT_COMBINE)


@triton.jit
def _combine_reduce_kernel(arena_ptr, y_ptr, inv_ptr, w_ptr, src_tok_ptr, info_ptr, part_ptr,
                           me, COMB: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
                           K: tl.constexpr, D: tl.constexpr, CK: tl.constexpr,
                           BT: tl.constexpr, PRE_ROUND: tl.constexpr):
    """A work item: BT received tokens x one chunk of CK columns, their K row chunks (K
    independent [BT, CK] loads, in flight together) weighted and summed in k order (`ksum`),
    stored to the own ht_comb slot (this rank's tokens: nobody else reads that slot, and this
    rank's previous combine_recv of the same buffer ran before on its stream) or staged."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    NC: tl.constexpr = (D + CK - 1) // CK
    buf = epoch(arena_ptr, OP_C) % 2
    n_total = tl.load(info_ptr)
    own_p = (arena_ptr + COMB).to(tl.pointer_type(tl.bfloat16))
    for it in range(pid, num_items(n_total, BT, NC), G):
        n, cols, cm = work_item(it, BT, CK, NC, D)
        nm = n < n_total
        n64 = n.to(tl.int64)
        st = tl.load(src_tok_ptr + n64, mask=nm, other=0)
        acc = ksum(y_ptr, inv_ptr, w_ptr, n64, nm, n64, 0, cols, cm, D, K, K, True, True,
                   PRE_ROUND)
        own = own_p + ((buf * W + me) * TMAX + st % TMAX).to(tl.int64) * D
        dst = tl.where(st // TMAX == me, own, part_ptr + n64 * D)
        tl.store(dst[:, None] + cols[None, :], acc.to(tl.bfloat16),
                 mask=nm[:, None] & cm[None, :])


@triton.jit
def _combine_push_kernel(arena_ptr, delta_ptr, part_ptr, src_tok_ptr, info_ptr, me, limit,
                         COMB: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
                         D: tl.constexpr, CH: tl.constexpr, BT: tl.constexpr,
                         USE_TIMER: tl.constexpr):
    """A step: BT staged partial rows (whole rows, one load) of other ranks' tokens, copied
    to their sources."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    e = epoch(arena_ptr, OP_C)
    buf = e % 2
    ok = wait_acks(arena_ptr, OP_C, e - 2, limit, W, USE_TIMER)
    if ok != 0:
        n_total = tl.load(info_ptr)
        cols = tl.arange(0, CH)
        cm = cols < D
        for n0 in range(pid * BT, n_total, G * BT):
            n = n0 + tl.arange(0, BT)
            n64 = n.to(tl.int64)
            nm = n < n_total
            st = tl.load(src_tok_ptr + n64, mask=nm, other=0)
            nm = nm & (st // TMAX != me)
            m2 = nm[:, None] & cm[None, :]
            row = tl.load(part_ptr + n64[:, None] * D + cols[None, :], mask=m2)
            peer = arena_ptr + tl.multiple_of(
                tl.load(delta_ptr + st // TMAX, mask=nm, other=0), 128)  # wide stores
            dst = (peer + COMB).to(tl.pointer_type(tl.bfloat16)) \
                + ((buf * W + me) * TMAX + st % TMAX).to(tl.int64) * D
            tl.store(dst[:, None] + cols[None, :], row, mask=m2)
    finish_send(arena_ptr, delta_ptr, OP_C, e, me, W)


def combine_send(arena: RankArena, shape: HTShape, y_MD: torch.Tensor, recv: HTReceived,
                 opts: SymmOptions) -> None:
    """y_MD bf16 [M, D]: the experts' rows of the layout this rank received (unweighted)."""
    if y_MD.dtype != torch.bfloat16 or y_MD.dim() != 2 or y_MD.shape[1] != shape.hidden:
        raise ValueError(f"expert output must be bf16 [M, {shape.hidden}] rows of the "
                         f"contiguous layout, got {y_MD.dtype} {tuple(y_MD.shape)}")
    d, tmax = shape.hidden, max(1, shape.max_tokens)
    comb = arena.layout.offset("ht_comb")
    part = torch.empty((shape.world * tmax, d), dtype=torch.bfloat16, device=y_MD.device)
    _combine_reduce_kernel[(grid(opts, y_MD.device, recv=True),)](
        arena.base, y_MD.contiguous(), recv.inv_NK, recv.w_NK, recv.src_tok_N, recv.info_I,
        part, arena.rank, COMB=comb, TMAX=tmax, W=shape.world, K=shape.top_k, D=d,
        CK=opts.chunk(d), BT=opts.tile(16), PRE_ROUND=INTERPRET, num_warps=opts.warps(),
        enable_fp_fusion=False)  # mul then add, as the reference (no FMA)
    _combine_push_kernel[(grid(opts, y_MD.device),)](
        arena.base, arena.peer_delta_W, part, recv.src_tok_N, recv.info_I, arena.rank,
        opts.spin_limit, COMB=comb, TMAX=tmax, W=shape.world, D=d, CH=row_cols(d),
        BT=opts.tile(rows_per_step(row_cols(d), 2)), USE_TIMER=USE_TIMER,
        num_warps=opts.warps())


def combine_recv(arena: RankArena, shape: HTShape, msg_TW: torch.Tensor,
                 opts: SymmOptions) -> torch.Tensor:
    """-> bf16 [T, D]: this rank's tokens, partial sums of the ranks they went to (msg_TW)."""
    return sum_back(arena, HT_COMBINE, "ht_comb", msg_TW, None, True, shape.hidden,
                    shape.max_tokens, opts)
