"""symm-ll combine: each expert row goes back to its source as bf16 (per token and k, into
`ll_comb[epoch % 2][t][k]` of the source's arena); the source sums w_k * y_k over k in k order
in fp32 and casts once (the masked layout's `gather_masked_reduce` semantics). The last CTA of
combine_send empties `ll_slots` and releases this rank's masked region to every peer (the ack
the next dispatch waits for). Regions: see `ll_dispatch.py`.
"""

from __future__ import annotations

from epmoe.kernels._common import next_pow2

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import LL_COMBINE, LL_DISPATCH, RankArena  # noqa: E402
from epmoe.comm.symm.ll_dispatch import LLShape  # noqa: E402
from epmoe.comm.symm.options import SymmOptions, grid  # noqa: E402
from epmoe.comm.symm.sum_back import sum_back  # noqa: E402
from epmoe.comm.symm.sync import (C_DONE_SEND, C_NUM_OPS, C_READY, C_SEQ, USE_TIMER,  # noqa: E402
                                  arrive_last, ctrl_ptr, epoch, publish, wait_acks)
from epmoe.comm.symm.tiles import num_items, work_item  # noqa: E402


OP_D = tl.constexpr(LL_DISPATCH)
OP_C = tl.constexpr(LL_COMBINE)


@triton.jit
def _combine_send_kernel(arena_ptr, delta_ptr, y_ptr, counts_ptr, me, limit,
                         SLOTS: tl.constexpr, META: tl.constexpr, COMB: tl.constexpr,
                         TMAX: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
                         E_L: tl.constexpr, EP: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
                         CK: tl.constexpr, BT: tl.constexpr, USE_TIMER: tl.constexpr):
    """A work item: BT expert rows x one chunk of CK columns, copied to their sources."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    NC: tl.constexpr = (D + CK - 1) // CK
    e_d = tl.load(ctrl_ptr(arena_ptr, C_SEQ + OP_D))  # the dispatch this combine answers
    e = epoch(arena_ptr, OP_C)
    buf = e % 2
    ok = wait_acks(arena_ptr, OP_C, e - 2, limit, W, USE_TIMER)
    if ok != 0:
        # the rows of all experts as one list (expert after expert): equal shares per CTA
        ee = tl.arange(0, EP)
        cnt = tl.minimum(tl.load(counts_ptr + ee, mask=ee < E_L, other=0), C)
        incl = tl.cumsum(cnt, axis=0)
        total = tl.sum(cnt, axis=0)
        meta_p = (arena_ptr + META).to(tl.pointer_type(tl.int32))
        for it in range(pid, num_items(total, BT, NC), G):
            f, cols, cm = work_item(it, BT, CK, NC, D)
            fm = f < total
            le = tl.sum((f[:, None] >= incl[None, :]).to(tl.int32), axis=1)
            first = tl.sum(tl.where(ee[None, :] < le[:, None], cnt[None, :], 0), axis=1)
            row = (le * C + f - first).to(tl.int64)
            y = tl.load(y_ptr + row[:, None] * D + cols[None, :], mask=fm[:, None] & cm[None, :])
            meta = tl.load(meta_p + row, mask=fm, other=0)
            peer = arena_ptr + tl.multiple_of(
                tl.load(delta_ptr + meta // (TMAX * K), mask=fm, other=0), 128)
            dst = (peer + COMB).to(tl.pointer_type(tl.bfloat16)) \
                + (buf * TMAX * K + meta % (TMAX * K)).to(tl.int64) * D
            tl.store(dst[:, None] + cols[None, :], y, mask=fm[:, None] & cm[None, :])
    if arrive_last(arena_ptr, C_DONE_SEND + OP_C, G) != 0:
        ee = tl.arange(0, EP)
        tl.store((arena_ptr + SLOTS).to(tl.pointer_type(tl.int32)) + ee, 0, mask=ee < E_L)
        tl.debug_barrier()
        # the masked region is free again (the next dispatch may fill it), then the rows are
        # at their sources
        publish(arena_ptr, delta_ptr, C_READY + C_NUM_OPS * W + OP_D * W + me, e_d, W)
        publish(arena_ptr, delta_ptr, C_READY + OP_C * W + me, e, W)


# --------------------------------------------------------------------------------------------
def _consts(arena: RankArena, shape: LLShape, opts: SymmOptions) -> dict:
    d = shape.hidden
    return dict(COMB=arena.layout.offset("ll_comb"), TMAX=max(1, shape.max_tokens),
                W=shape.world, K=shape.top_k, D=d,
                CK=opts.chunk(d), USE_TIMER=USE_TIMER, num_warps=opts.warps())


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
        BT=opts.tile(16), **_consts(arena, shape, opts))


def combine_recv(arena: RankArena, shape: LLShape, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, opts: SymmOptions) -> torch.Tensor:
    """-> bf16 [T, D]: sum_k w_k * y_k in fp32 (k order), cast once."""
    return sum_back(arena, LL_COMBINE, "ll_comb", topk_ids_TK, topk_weights_TK, False,
                    shape.hidden, shape.max_tokens, opts)
