"""Tile helpers shared by the symm kernels.

Every copy kernel moves whole rows: a CTA step takes `BT` rows x the row rounded up to a power
of two (`row_cols`), so one load puts ~64 KB in flight, and does every load of the step before
its first store (stores may alias loads, so nothing after a store is hoisted above it).
Per-row index vectors that several stores need come from one [BT, KP] tile load and are picked
out per column (`pick`: an integer sum with one non-zero term, exact).
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET, next_pow2, round_bf16

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

TILE_ELEMS = 16384  # elements of 4 bytes per step and CTA on GPU (64 KB)
NUM_WARPS = 8


def row_cols(n: int) -> int:
    """Columns of a row tile: the whole row, rounded up to a power of two."""
    return next_pow2(max(1, n))


def rows_per_step(cols: int, elem_bytes: int = 4) -> int:
    """Default rows per step: ~TILE_ELEMS x 4 bytes per tile (1 for rows larger than that)."""
    return max(1, TILE_ELEMS * 4 // (cols * elem_bytes))


def warps() -> int:
    return 1 if INTERPRET else NUM_WARPS


@triton.jit
def pick(x2, kk, k):
    """Column k of an integer tile x2 [B, KP] (kk = arange(KP)) -> [B]."""
    return tl.sum(tl.where(kk[None, :] == k, x2, 0), axis=1)


@triton.jit
def ksum(y, w, PRE_ROUND: tl.constexpr):
    """sum_k w[b, k] * y[b, k, :] in fp32 -> [B, CH], bit for bit the sequential
    `acc = 0; acc = acc + w_k * y_k` over the valid k (k order; an empty slot has w = 0 and
    y = 0). The slot axis lies in each thread's registers (the warps span the columns), and a
    reduction within a thread folds its elements in index order; adding +0 at the end turns
    the -0 of an all-zero sum that starts at -0 into the +0 the sequential sum has (every other
    step is the same operation on the same values). Under the interpreter, numpy's sum over a
    middle axis is sequential too; PRE_ROUND rounds to bf16 there (its cast truncates)."""
    acc = tl.sum(w[:, :, None] * y.to(tl.float32), axis=1) + 0.0
    if PRE_ROUND:
        acc = round_bf16(acc)
    return acc


__all__ = ["ksum", "pick", "row_cols", "rows_per_step", "warps", "TILE_ELEMS", "NUM_WARPS"]
