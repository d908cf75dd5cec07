"""symm-ll combine: the expert rank reduces each source token's rows here in fp32 (k order,
weighted: the rows and weights are in the token's message, see `ll_dispatch.py`) and sends one
bf16 row per (token, rank) back, into `ll_comb[epoch % 2][me][t]` of the source; the source
sums <= W partial rows in fp32 in rank order and casts once. That is symm-ht's and all2all's
numerics, and W rows per token cross back instead of K (at ep 2 with top-8: a quarter of the
bytes). The last CTA of combine_send empties `ll_slots` and releases this rank's masked region
and messages to every peer (the ack the next dispatch waits for).
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET, next_pow2
from epmoe.kernels.launcher import Launcher

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import LL_COMBINE, LL_DISPATCH, RankArena  # noqa: E402
from epmoe.comm.symm.ll_dispatch import LLShape  # noqa: E402
from epmoe.comm.symm.options import LL_SMS, SymmOptions, grid  # noqa: E402
from epmoe.comm.symm.sum_back import SumBack  # noqa: E402
from epmoe.comm.symm.sync import (C_DONE_SEND, C_NUM_OPS, C_READY, USE_TIMER,  # noqa: E402
                                  arrive_last, epoch, publish2, send_epoch, wait_acks)
from epmoe.comm.symm.tiles import ksum, source_block  # noqa: E402

OP_D = tl.constexpr(LL_DISPATCH)
OP_C = tl.constexpr(LL_COMBINE)


@triton.jit(do_not_specialize=["me", "limit"])
def _combine_send_kernel(arena_ptr, delta_ptr, y_ptr, me, limit, SLOTS: tl.constexpr,
                         MSG: tl.constexpr, MW: tl.constexpr, NTOK: tl.constexpr,
                         COMB: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
                         WP: tl.constexpr, K: tl.constexpr,
                         E_L: tl.constexpr, EP: tl.constexpr, D: tl.constexpr,
                         CK: tl.constexpr, BT: tl.constexpr, PRE_ROUND: tl.constexpr,
                         USE_TIMER: tl.constexpr):
    """A work item: BT messages (source, token) of one source x one chunk of CK columns, over
    the tokens each source dispatched (ll_ntok); a current message's K row chunks (independent
    loads, in flight together) weighted and summed in k order (`ksum`), stored at its
    source."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    NC: tl.constexpr = (D + CK - 1) // CK
    e_d = send_epoch(arena_ptr, OP_D) - 1  # the dispatch this combine answers
    e = epoch(arena_ptr, OP_C)
    buf = e % 2
    ss = tl.arange(0, WP)
    # the sources' token counts, in flight with the wait (they came with the dispatch that
    # this rank's receive already waited for)
    ntok = tl.minimum(tl.load((arena_ptr + NTOK).to(tl.pointer_type(tl.int32)) + ss,
                              mask=ss < W, other=0), TMAX)
    ok = wait_acks(arena_ptr, OP_C, e - 2, limit, W, USE_TIMER)
    if ok != 0:
        msg = (arena_ptr + MSG).to(tl.pointer_type(tl.int32))
        nblk = tl.sum((ntok + BT - 1) // BT, axis=0)  # the sources' token blocks in turn
        for it in range(pid, nblk * NC, G):
            src, t, nm = source_block(it // NC, ntok, ss, W, BT)
            n64 = (src * TMAX + t).to(tl.int64)
            nm = nm & (tl.load(msg + n64 * MW, mask=nm, other=0) == e_d)  # current only
            cols = (it % NC) * CK + tl.arange(0, CK)
            cm = cols < D
            acc = ksum(y_ptr, msg + 1, (msg + 1 + K).to(tl.pointer_type(tl.float32)), n64, nm,
                       n64, 0, cols, cm, D, K, MW, True, True, PRE_ROUND)
            peer = arena_ptr + tl.multiple_of(tl.load(delta_ptr + src), 128)
            dst = (peer + COMB).to(tl.pointer_type(tl.bfloat16)) \
                + ((buf * W + me) * TMAX + t).to(tl.int64) * D
            tl.store(dst[:, None] + cols[None, :], acc.to(tl.bfloat16),
                     mask=nm[:, None] & cm[None, :])
    if arrive_last(arena_ptr, C_DONE_SEND + OP_C, G) != 0:
        ee = tl.arange(0, EP)
        tl.store((arena_ptr + SLOTS).to(tl.pointer_type(tl.int32)) + ee, 0, mask=ee < E_L)
        tl.debug_barrier()
        # the masked region and the messages are free again (the next dispatch may fill
        # them), then the partial sums are at their sources
        publish2(arena_ptr, delta_ptr, C_READY + C_NUM_OPS * W + OP_D * W + me, e_d,
                 C_READY + OP_C * W + me, e, W)


class LLCombine:
    """The combine's send kernel and its sum (`sum_back`) with their constants bound once."""

    def __init__(self, arena: RankArena, shape: LLShape, opts: SymmOptions):
        lay, e_l = arena.layout, shape.num_local_experts
        self.arena, self.shape = arena, shape
        self.send = Launcher(_combine_send_kernel, dict(
            SLOTS=lay.offset("ll_slots"), MSG=lay.offset("ll_msg"), MW=shape.msg_words,
            NTOK=lay.offset("ll_ntok"), COMB=lay.offset("ll_comb"),
            TMAX=max(1, shape.max_tokens), W=shape.world, WP=next_pow2(shape.world),
            K=shape.top_k, E_L=e_l, EP=next_pow2(e_l), D=shape.hidden,
            CK=opts.chunk(shape.hidden), BT=opts.tile(16), PRE_ROUND=INTERPRET,
            USE_TIMER=USE_TIMER), num_warps=opts.warps(),
            enable_fp_fusion=False)  # mul then add, as the reference (no FMA)
        self.send_grid = (grid(opts, arena.base.device, send_default=LL_SMS),)
        self.sum = SumBack(arena, LL_COMBINE, "ll_comb", shape.hidden, shape.max_tokens,
                           shape.world, opts)

    def combine_send(self, y_ECD: torch.Tensor, opts: SymmOptions) -> None:
        """y_ECD bf16 [E_L, C, D]: the experts' rows (unweighted) of the masked batch."""
        shape = self.shape
        want = (shape.num_local_experts, shape.capacity, shape.hidden)
        if y_ECD.dtype != torch.bfloat16 or tuple(y_ECD.shape) != want:
            raise ValueError(f"expert output must be bf16 {list(want)} (the masked batch's "
                             f"shape), got {y_ECD.dtype} {list(y_ECD.shape)}")
        a = self.arena
        self.send(self.send_grid, a.base, a.peer_delta_W, y_ECD.contiguous(), a.rank,
                  opts.spin_limit)

    def combine_recv(self, msg_TW: torch.Tensor, opts: SymmOptions) -> torch.Tensor:
        """-> bf16 [T, D]: this rank's tokens, the partial sums of the ranks they went to
        (msg_TW, from dispatch_send) in rank order, in fp32, cast once."""
        return self.sum(msg_TW, opts)


__all__ = ["LLCombine"]
