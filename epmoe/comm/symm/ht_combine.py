"""symm-ht combine: the expert rank reduces each received token's rows in fp32 (k order) and
sends one bf16 row per (token, rank) back; the source sums <= W partial rows in fp32 in rank
order and casts once. That is all2all's numerics (experts' weighted sum per token, bf16 on the
wire, rank-ordered fp32 sum, one cast), so both agree bit for bit on the same expert outputs.
Region `ht_comb` of the HT arena (see `ht_dispatch.py`).
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET, next_pow2, round_bf16

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import HT_COMBINE, RankArena  # noqa: E402
from epmoe.comm.symm.ht_dispatch import HTReceived, HTShape  # noqa: E402
from epmoe.comm.symm.options import SymmOptions, grid  # noqa: E402
from epmoe.comm.symm.sync import (C_DONE_RECV, C_DONE_SEND, C_READY, C_SEQ, USE_TIMER,  # noqa: E402
                                  arrive_last, ctrl_ptr, no_error, peer_ptr, signal, wait_all)

OP_C = tl.constexpr(HT_COMBINE)


@triton.jit
def _combine_send_kernel(arena_ptr, delta_ptr, y_ptr, inv_ptr, w_ptr, src_tok_ptr, info_ptr,
                         me, limit, COMB: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
                         K: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                         PRE_ROUND: tl.constexpr, USE_TIMER: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    e = tl.load(ctrl_ptr(arena_ptr, C_SEQ + OP_C)) + 1
    buf = e % 2
    ok = wait_all(arena_ptr, C_READY + 4 * W + OP_C * W, e - 2, 2 * OP_C, limit, W, USE_TIMER)
    if ok != 0:
        n_total = tl.load(info_ptr)
        cols = tl.arange(0, BD)
        cm = cols < D
        for n0 in range(pid * BT, n_total, G * BT):
            n = n0 + tl.arange(0, BT)
            nm = n < n_total
            n64 = n.to(tl.int64)
            acc = tl.zeros((BT, BD), dtype=tl.float32)
            for k in tl.static_range(K):
                r = tl.load(inv_ptr + n64 * K + k, mask=nm, other=-1)
                wk = tl.load(w_ptr + n64 * K + k, mask=nm, other=0.0)
                v = r >= 0
                y = tl.load(y_ptr + r.to(tl.int64)[:, None] * D + cols[None, :],
                            mask=v[:, None] & cm[None, :], other=0.0).to(tl.float32)
                acc = tl.where(v[:, None], acc + wk[:, None] * y, acc)
            if PRE_ROUND:
                acc = round_bf16(acc)
            st = tl.load(src_tok_ptr + n64, mask=nm, other=0)
            src = st // TMAX
            t = st % TMAX
            peer = arena_ptr + tl.load(delta_ptr + src, mask=nm, other=0)
            dst = (peer + COMB).to(tl.pointer_type(tl.bfloat16)) \
                + ((buf * W + me) * TMAX + t).to(tl.int64) * D
            tl.store(dst[:, None] + cols[None, :], acc.to(tl.bfloat16),
                     mask=nm[:, None] & cm[None, :])
    if arrive_last(arena_ptr, C_DONE_SEND + OP_C, G) != 0:
        if no_error(arena_ptr) != 0:
            for d in tl.static_range(W):
                signal(ctrl_ptr(peer_ptr(arena_ptr, delta_ptr, d), C_READY + OP_C * W + me), e)


@triton.jit
def _combine_recv_kernel(arena_ptr, delta_ptr, out_ptr, msg_ptr, T, me, limit,
                         COMB: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
                         D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                         PRE_ROUND: tl.constexpr, USE_TIMER: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    e = tl.load(ctrl_ptr(arena_ptr, C_SEQ + OP_C)) + 1
    buf = e % 2
    ok = wait_all(arena_ptr, C_READY + OP_C * W, e, 2 * OP_C + 1, limit, W, USE_TIMER)
    if ok != 0:
        cols = tl.arange(0, BD)
        cm = cols < D
        comb = (arena_ptr + COMB).to(tl.pointer_type(tl.bfloat16))
        for t0 in range(pid * BT, T, G * BT):
            t = t0 + tl.arange(0, BT)
            tm = t < T
            t64 = t.to(tl.int64)
            acc = tl.zeros((BT, BD), dtype=tl.float32)
            for d in tl.static_range(W):  # rank order: a fixed fp32 summation order
                sent = tl.load(msg_ptr + t64 * W + d, mask=tm, other=-1) >= 0
                v = tl.load(comb + ((buf * W + d) * TMAX + t64)[:, None] * D + cols[None, :],
                            mask=sent[:, None] & cm[None, :], other=0.0).to(tl.float32)
                acc = tl.where(sent[:, None], acc + v, acc)
            if PRE_ROUND:
                acc = round_bf16(acc)
            tl.store(out_ptr + t64[:, None] * D + cols[None, :], acc.to(tl.bfloat16),
                     mask=tm[:, None] & cm[None, :])
    if arrive_last(arena_ptr, C_DONE_RECV + OP_C, G) != 0:
        tl.store(ctrl_ptr(arena_ptr, C_SEQ + OP_C), e)
        if no_error(arena_ptr) != 0:
            for d in tl.static_range(W):
                signal(ctrl_ptr(peer_ptr(arena_ptr, delta_ptr, d),
                                C_READY + 4 * W + OP_C * W + me), e)


def _consts(arena: RankArena, shape: HTShape) -> dict:
    d = shape.hidden
    bd = next_pow2(d)
    return dict(COMB=arena.layout.offset("ht_comb"), TMAX=max(1, shape.max_tokens),
                W=shape.world, D=d, BD=bd, BT=64 if INTERPRET else max(1, 8192 // bd),
                PRE_ROUND=INTERPRET, USE_TIMER=USE_TIMER, num_warps=1 if INTERPRET else 8,
                enable_fp_fusion=False)  # mul then add, as the reference (no FMA)


def combine_send(arena: RankArena, shape: HTShape, y_MD: torch.Tensor, recv: HTReceived,
                 opts: SymmOptions) -> None:
    """y_MD bf16 [M, D]: the experts' rows of the layout this rank received (unweighted)."""
    if y_MD.dtype != torch.bfloat16 or y_MD.dim() != 2 or y_MD.shape[1] != shape.hidden:
        raise ValueError(f"expert output must be bf16 [M, {shape.hidden}] rows of the "
                         f"contiguous layout, got {y_MD.dtype} {tuple(y_MD.shape)}")
    _combine_send_kernel[(grid(opts, y_MD.device),)](
        arena.base, arena.peer_delta_W, y_MD.contiguous(), recv.inv_NK, recv.w_NK,
        recv.src_tok_N, recv.info_I, arena.rank, opts.spin_limit, K=shape.top_k,
        **_consts(arena, shape))


def combine_recv(arena: RankArena, shape: HTShape, msg_TW: torch.Tensor,
                 opts: SymmOptions) -> torch.Tensor:
    """-> bf16 [T, D]: this rank's tokens, partial sums of the ranks they went to (msg_TW)."""
    t = msg_TW.shape[0]
    out = torch.empty((t, shape.hidden), dtype=torch.bfloat16, device=msg_TW.device)
    _combine_recv_kernel[(grid(opts, out.device),)](
        arena.base, arena.peer_delta_W, out, msg_TW, t, arena.rank, opts.spin_limit,
        **_consts(arena, shape))
    return out
