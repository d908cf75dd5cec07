"""The receive half of both combines: per own token, the fp32 sum of the bf16 rows its peers
sent back (HT: one partial per rank it went to, in rank order; LL: one row per (token, k),
weighted, in k order), cast once. Rows sit in the arena's combine region, buffer epoch % 2:

  slot-major (HT)  [2][S = W][TMAX] rows       token-major (LL)  [2][TMAX][S = K] rows

`valid_TS` (>= 0: the slot came back) is the sender's own routing (msg_TW / topk_ids_TK).
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import RankArena  # noqa: E402
from epmoe.comm.symm.options import SymmOptions, grid  # noqa: E402
from epmoe.comm.symm.sync import USE_TIMER, epoch, finish_recv, wait_ready  # noqa: E402
from epmoe.comm.symm.tiles import ksum, num_items, work_item  # noqa: E402


@triton.jit(do_not_specialize=["T", "me", "limit"])
def _sum_back_kernel(arena_ptr, delta_ptr, out_ptr, valid_ptr, w_ptr, T, me, limit,
                     OP: tl.constexpr, COMB: tl.constexpr, TMAX: tl.constexpr,
                     W: tl.constexpr, S: tl.constexpr,
                     SLOT_MAJOR: tl.constexpr, HAS_W: tl.constexpr, D: tl.constexpr,
                     CK: tl.constexpr, BT: tl.constexpr, PRE_ROUND: tl.constexpr,
                     USE_TIMER: tl.constexpr):
    """A work item: BT own tokens x one chunk of CK columns, their S row chunks (S independent
    [BT, CK] loads, in flight together) summed in slot order (`ksum`)."""
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
            if SLOT_MAJOR:  # row of slot j: row0 + j * rstride
                acc = ksum(comb, valid_ptr, w_ptr, t64, tm, buf * S * TMAX + t64, TMAX, cols,
                           cm, D, S, S, False, HAS_W, PRE_ROUND)
            else:
                acc = ksum(comb, valid_ptr, w_ptr, t64, tm, (buf * TMAX + t64) * S, 1, cols,
                           cm, D, S, S, False, HAS_W, PRE_ROUND)
            tl.store(out_ptr + t64[:, None] * D + cols[None, :], acc.to(tl.bfloat16),
                     mask=tm[:, None] & cm[None, :])
    finish_recv(arena_ptr, delta_ptr, OP, e, me, W)


def sum_back(arena: RankArena, op: int, region: str, valid_TS: torch.Tensor,
             weights_TS: torch.Tensor | None, slot_major: bool, hidden: int, max_tokens: int,
             opts: SymmOptions) -> torch.Tensor:
    """-> bf16 [T, hidden]: this rank's tokens, reduced in fp32 and cast once."""
    t, s = valid_TS.shape
    out = torch.empty((t, hidden), dtype=torch.bfloat16, device=valid_TS.device)
    w = valid_TS if weights_TS is None else weights_TS.float().contiguous()
    _sum_back_kernel[(grid(opts, out.device, recv=True),)](
        arena.base, arena.peer_delta_W, out, valid_TS.contiguous(), w, t, arena.rank,
        opts.spin_limit, OP=op, COMB=arena.layout.offset(region), TMAX=max(1, max_tokens),
        W=arena.world, S=s, SLOT_MAJOR=slot_major,
        HAS_W=weights_TS is not None, D=hidden,
        CK=opts.chunk(hidden), BT=opts.tile(max(2, 32 // s)), PRE_ROUND=INTERPRET,
        USE_TIMER=USE_TIMER, num_warps=opts.warps(),
        enable_fp_fusion=False)  # mul then add, as the reference (no FMA)
    return out


__all__ = ["sum_back"]
