"""symm-ll combine: each expert row goes back to its source as bf16 (per token and k, into
`ll_comb[epoch % 2][t][k]` of the source's arena); the source sums w_k * y_k over k in k order
in fp32 and casts once (the masked layout's `gather_masked_reduce` semantics). The last CTA of
combine_send empties `ll_slots` and releases this rank's masked region to every peer (the ack
the next dispatch waits for). Regions: see `ll_dispatch.py`.
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET, next_pow2, round_bf16

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import LL_COMBINE, LL_DISPATCH, RankArena  # noqa: E402
from epmoe.comm.symm.ll_dispatch import LLShape  # noqa: E402
from epmoe.comm.symm.options import SymmOptions, grid  # noqa: E402
from epmoe.comm.symm.sync import (C_DONE_RECV, C_DONE_SEND, C_READY, C_SEQ, USE_TIMER,  # noqa: E402
                                  arrive_last, ctrl_ptr, no_error, peer_ptr, signal, wait_all)

OP_D = tl.constexpr(LL_DISPATCH)
OP_C = tl.constexpr(LL_COMBINE)


@triton.jit
def _combine_send_kernel(arena_ptr, delta_ptr, y_ptr, counts_ptr, me, limit,
                         SLOTS: tl.constexpr, META: tl.constexpr, COMB: tl.constexpr,
                         TMAX: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
                         E_L: tl.constexpr, EP: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
                         BD: tl.constexpr, BT: tl.constexpr, USE_TIMER: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    e_d = tl.load(ctrl_ptr(arena_ptr, C_SEQ + OP_D))  # the dispatch this combine answers
    e = tl.load(ctrl_ptr(arena_ptr, C_SEQ + OP_C)) + 1
    buf = e % 2
    ok = wait_all(arena_ptr, C_READY + 4 * W + OP_C * W, e - 2, 2 * OP_C, limit, W, USE_TIMER)
    if ok != 0:
        cols = tl.arange(0, BD)
        cm = cols < D
        meta_p = (arena_ptr + META).to(tl.pointer_type(tl.int32))
        for le in range(pid, E_L, G):
            cnt = tl.minimum(tl.load(counts_ptr + le), C)
            for c0 in range(0, cnt, BT):
                c = c0 + tl.arange(0, BT)
                rm = c < cnt
                row = (le * C + c).to(tl.int64)
                meta = tl.load(meta_p + row, mask=rm, other=0)
                src = meta // (TMAX * K)
                y = tl.load(y_ptr + row[:, None] * D + cols[None, :],
                            mask=rm[:, None] & cm[None, :])
                peer = arena_ptr + tl.load(delta_ptr + src, mask=rm, other=0)
                dst = (peer + COMB).to(tl.pointer_type(tl.bfloat16)) \
                    + (buf * TMAX * K + meta % (TMAX * K)).to(tl.int64) * D
                tl.store(dst[:, None] + cols[None, :], y, mask=rm[:, None] & cm[None, :])
    if arrive_last(arena_ptr, C_DONE_SEND + OP_C, G) != 0:
        ee = tl.arange(0, EP)
        tl.store((arena_ptr + SLOTS).to(tl.pointer_type(tl.int32)) + ee, 0, mask=ee < E_L)
        tl.debug_barrier()
        if no_error(arena_ptr) != 0:
            for d in tl.static_range(W):  # masked region free again, then the rows are there
                signal(ctrl_ptr(peer_ptr(arena_ptr, delta_ptr, d),
                                C_READY + 4 * W + OP_D * W + me), e_d)
            for d in tl.static_range(W):
                signal(ctrl_ptr(peer_ptr(arena_ptr, delta_ptr, d), C_READY + OP_C * W + me), e)


@triton.jit
def _combine_recv_kernel(arena_ptr, delta_ptr, out_ptr, ids_ptr, w_ptr, T, me, limit,
                         COMB: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
                         K: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
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
            for k in tl.static_range(K):  # k order: a fixed fp32 summation order
                v = tl.load(ids_ptr + t64 * K + k, mask=tm, other=-1) >= 0
                wk = tl.load(w_ptr + t64 * K + k, mask=tm, other=0.0)
                y = tl.load(comb + ((buf * TMAX + t64) * K + k)[:, None] * D + cols[None, :],
                            mask=v[:, None] & cm[None, :], other=0.0).to(tl.float32)
                acc = tl.where(v[:, None], acc + wk[:, None] * y, acc)
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


# --------------------------------------------------------------------------------------------
def _consts(arena: RankArena, shape: LLShape) -> dict:
    bd = next_pow2(shape.hidden)
    return dict(COMB=arena.layout.offset("ll_comb"), TMAX=max(1, shape.max_tokens),
                W=shape.world, K=shape.top_k, D=shape.hidden, BD=bd,
                BT=64 if INTERPRET else max(1, min(4, 8192 // bd)), USE_TIMER=USE_TIMER,
                num_warps=1 if INTERPRET else 8,
                enable_fp_fusion=False)  # mul then add, as the reference (no FMA)


def combine_send(arena: RankArena, shape: LLShape, y_ECD: torch.Tensor, counts_E: torch.Tensor,
                 opts: SymmOptions) -> None:
    """y_ECD bf16 [E_L, C, D]: the experts' rows (unweighted), counts_E from dispatch_recv."""
    want = (shape.num_local_experts, shape.capacity, shape.hidden)
    if y_ECD.dtype != torch.bfloat16 or tuple(y_ECD.shape) != want:
        raise ValueError(f"expert output must be bf16 {list(want)} (the masked batch's shape), "
                         f"got {y_ECD.dtype} {list(y_ECD.shape)}")
    lay = arena.layout
    _combine_send_kernel[(grid(opts, y_ECD.device),)](
        arena.base, arena.peer_delta_W, y_ECD.contiguous(), counts_E, arena.rank,
        opts.spin_limit, SLOTS=lay.offset("ll_slots"), META=lay.offset("ll_meta"),
        E_L=shape.num_local_experts, EP=next_pow2(shape.num_local_experts), C=shape.capacity,
        **_consts(arena, shape))


def combine_recv(arena: RankArena, shape: LLShape, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, opts: SymmOptions) -> torch.Tensor:
    """-> bf16 [T, D]: sum_k w_k * y_k in fp32 (k order), cast once."""
    t = topk_ids_TK.shape[0]
    out = torch.empty((t, shape.hidden), dtype=torch.bfloat16, device=topk_ids_TK.device)
    _combine_recv_kernel[(grid(opts, out.device),)](
        arena.base, arena.peer_delta_W, out, topk_ids_TK.contiguous(),
        topk_weights_TK.float().contiguous(), t, arena.rank, opts.spin_limit,
        PRE_ROUND=INTERPRET, **_consts(arena, shape))
    return out
