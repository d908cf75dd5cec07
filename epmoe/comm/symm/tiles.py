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
def ksum(ptr, row, w, v, cols, cm, D, PRE_ROUND: tl.constexpr):
    """sum_k w[b, k] * rows[row[b, k], :] in fp32 -> [B, CH] (ptr: bf16 rows of D columns;
    row int64 [B, KP]; v: valid slots; cols/cm: the columns and their mask), bit for bit the
    sequential `acc = 0; acc = acc + w_k * y_k` in k order: an invalid slot loads 0 with
    w = 0 and adds +0. The fold is written out slot by slot, each slot's rows a [B, CH] load
    of its own (the KP loads are independent, so they are in flight together): a `tl.sum`
    over a slot axis would let the compiler pick the order (a tree across threads for some
    layouts), which changes the bits. Callers launch with enable_fp_fusion=False (mul then
    add, no FMA), as the reference. Under the interpreter PRE_ROUND rounds to bf16 (its cast
    truncates)."""
    kk = tl.arange(0, row.shape[1])
    acc = tl.zeros((row.shape[0], cols.shape[0]), dtype=tl.float32)
    for k in tl.static_range(row.shape[1]):
        rk = pick(row, kk, k)
        vk = pick(v.to(tl.int32), kk, k) != 0
        wk = tl.sum(tl.where(kk[None, :] == k, w, 0.0), axis=1)  # one non-zero term: exact
        y = tl.load(ptr + rk[:, None] * D + cols[None, :], mask=vk[:, None] & cm[None, :],
                    other=0.0)
        acc = acc + wk[:, None] * y.to(tl.float32)
    acc = acc + 0.0
    if PRE_ROUND:
        acc = round_bf16(acc)
    return acc


__all__ = ["ksum", "pick", "row_cols", "rows_per_step", "warps", "TILE_ELEMS", "NUM_WARPS"]
