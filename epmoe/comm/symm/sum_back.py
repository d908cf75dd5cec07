"""symm-ll combine's receive: per own token, the fp32 sum of the bf16 partial rows the ranks
it went to sent back (one per rank, pre-reduced by the expert rank), in rank order, cast once.
Rows sit in the arena's combine region, slot-major: [2][W][TMAX] rows, buffer epoch % 2.
`msg_TW` (>= 0: the token went to that rank, so its row came back) is the sender's routing.
(symm-ht's sum is a role of its combine kernel, waiting per token block: `ht_combine.py`.)
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET
from epmoe.kernels.launcher import Launcher

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import RankArena  # noqa: E402
from epmoe.comm.symm.options import SymmOptions, grid  # noqa: E402
from epmoe.comm.symm.sync import USE_TIMER, epoch, finish_recv, wait_ready  # noqa: E402
from epmoe.comm.symm.tiles import ksum, num_items, work_item  # noqa: E402


@triton.jit(do_not_specialize=["T", "me", "limit"])
def _sum_back_kernel(arena_ptr, delta_ptr, out_ptr, msg_ptr, T, me, limit, OP: tl.constexpr,
                     COMB: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr, D: tl.constexpr,
                     CK: tl.constexpr, BT: tl.constexpr, PRE_ROUND: tl.constexpr,
                     USE_TIMER: tl.constexpr):
    """Wait until every source published this epoch, then per work item (BT own tokens x one
    chunk of CK columns) the W row chunks (W independent [BT, CK] loads, in flight together)
    summed in rank order (`ksum`)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    NC: tl.constexpr = (D + CK - 1) // CK
    e = epoch(arena_ptr, OP)
    buf = e % 2
    ok = wait_ready(arena_ptr, OP, e, limit, W, USE_TIMER)
    if ok != 0:
        comb = (arena_ptr + COMB).to(tl.pointer_type(tl.bfloat16))
        for it in range(pid, num_items(T, BT, NC), G):
            t, cols, cm = work_item(it, BT, CK, NC, D)
            tm = t < T
            t64 = t.to(tl.int64)
            acc = ksum(comb, msg_ptr, msg_ptr, t64, tm, buf * W * TMAX + t64, TMAX, cols, cm,
                       D, W, W, False, False, PRE_ROUND)
            tl.store(out_ptr + t64[:, None] * D + cols[None, :], acc.to(tl.bfloat16),
                     mask=tm[:, None] & cm[None, :])
    finish_recv(arena_ptr, delta_ptr, OP, e, me, W)


class SumBack:
    """The sum's kernel with its constants bound once (op, region, sizes, options)."""

    def __init__(self, arena: RankArena, op: int, region: str, hidden: int, max_tokens: int,
                 world: int, opts: SymmOptions):
        self.arena, self.hidden = arena, hidden
        self.kernel = Launcher(_sum_back_kernel, dict(
            OP=op, COMB=arena.layout.offset(region), TMAX=max(1, max_tokens), W=world,
            D=hidden, CK=opts.chunk(hidden), BT=opts.tile(max(2, 32 // world)),
            PRE_ROUND=INTERPRET, USE_TIMER=USE_TIMER), num_warps=opts.warps(),
            enable_fp_fusion=False)  # mul then add, as the reference (no FMA)
        self.grid = (grid(opts, arena.base.device, recv=True),)

    def __call__(self, msg_TW: torch.Tensor, opts: SymmOptions) -> torch.Tensor:
        """-> bf16 [T, hidden]: this rank's tokens, reduced in fp32 and cast once."""
        t = msg_TW.shape[0]
        a = self.arena
        out = torch.empty((t, self.hidden), dtype=torch.bfloat16, device=msg_TW.device)
        self.kernel(self.grid, a.base, a.peer_delta_W, out, msg_TW.contiguous(), t, a.rank,
                    opts.spin_limit)
        return out


__all__ = ["SumBack"]
