"""Tile helpers shared by the symm kernels.

Every copy kernel moves whole rows: a CTA step takes `BT` rows x the row rounded up to a power
of two (`row_cols`), so one load puts ~64 KB in flight, and does every load of the step before
its first store (stores may alias loads, so nothing after a store is hoisted above it).
A per-slot index (one column of a [T, K] table) is its own [BT] load, never picked out of a
[BT, KP] tile: that pick is a cross-thread reduction, a barrier per slot and field.

The reducing kernels (both combines) hold K (or W) row tiles at once, so a whole row per slot
would not fit the registers (8 x 7168 bf16 per token: the compiler spills or serialises the
loads). They split rows into column chunks (`chunk_cols`, 1024 columns on GPU) and take
(token block, chunk) work items: every slot's [BT, chunk] load of an item is independent, so
all K are in flight together (~64 KB per CTA at BT = 4, K = 8).
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET, next_pow2, round_bf16

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

TILE_ELEMS = 16384  # elements of 4 bytes per step and CTA on GPU (64 KB)
NUM_WARPS = 16  # per CTA on GPU: one CTA per SM, so the warps are what hides latency
CHUNK_COLS = 1024  # columns per work item of the reducing kernels on GPU


def row_cols(n: int) -> int:
    """Columns of a row tile: the whole row, rounded up to a power of two."""
    return next_pow2(max(1, n))


def rows_per_step(cols: int, elem_bytes: int = 4) -> int:
    """Default rows per step: ~TILE_ELEMS x 4 bytes per tile (1 for rows larger than that)."""
    return max(1, TILE_ELEMS * 4 // (cols * elem_bytes))


def chunk_cols(n: int) -> int:
    """Columns per work item of a reducing kernel: CHUNK_COLS on GPU (the whole row when it is
    narrower), the whole row under the interpreter (its cost is per program step)."""
    return row_cols(n) if INTERPRET else min(row_cols(n), CHUNK_COLS)


def warps() -> int:
    return 1 if INTERPRET else NUM_WARPS


@triton.jit
def num_items(n, BT: tl.constexpr, NC: tl.constexpr):
    """Work items of a chunked kernel over n rows: row blocks of BT x NC column chunks."""
    return (n + BT - 1) // BT * NC


@triton.jit
def work_item(it, BT: tl.constexpr, CK: tl.constexpr, NC: tl.constexpr, D: tl.constexpr):
    """Work item `it` -> (its BT rows, its CK columns, their mask < D). Items run chunk-fastest,
    so neighbouring CTAs take the chunks of one row block (its index loads hit in L2)."""
    cols = (it % NC) * CK + tl.arange(0, CK)
    return (it // NC) * BT + tl.arange(0, BT), cols, cols < D


@triton.jit
def span(P: tl.constexpr, n):
    """(arange(P), its mask < n): a tile axis of P >= n lanes."""
    r = tl.arange(0, P)
    return r, r < n


@triton.jit
def source_block(blk, ntok, ss, W: tl.constexpr, BT: tl.constexpr):
    """Block `blk` of BT tokens when the sources' tokens (ntok [WP] int32, 0 past W; ss =
    arange(WP)) are taken one source after another -> (source, its tokens t [BT], t < ntok of
    the source)."""
    nb = (ntok + BT - 1) // BT
    incl = tl.cumsum(nb, axis=0)
    src = tl.sum(((blk >= incl) & (ss < W)).to(tl.int32), axis=0)
    t = (blk - tl.sum(tl.where(ss < src, nb, 0), axis=0)) * BT + tl.arange(0, BT)
    return src, t, t < tl.sum(tl.where(ss == src, ntok, 0), axis=0)


@triton.jit
def ksum(ptr, idx_ptr, w_ptr, n64, nm, row0, rstride, cols, cm, D, S: tl.constexpr,
         ISTRIDE: tl.constexpr, INDIRECT: tl.constexpr, HAS_W: tl.constexpr,
         PRE_ROUND: tl.constexpr):
    """sum_s w[n, s] * rows[row(n, s), cols] in fp32 -> [BT, CK] for BT tokens n64 (nm: in
    range) and S slots (ptr: bf16 rows of D columns), bit for bit the sequential
    `acc = 0; acc = acc + w_s * y_s` in slot order.

    idx_ptr [*, ISTRIDE] int32 per token, slot s in column s: >= 0 marks a valid slot;
    INDIRECT: it is the row itself, else the row is row0 + s * rstride (row0 [BT] int64).
    w_ptr [*, ISTRIDE] fp32 weights (HAS_W; else 1). An invalid slot loads 0 with w = 0 and adds +0.

    Every per-slot index and weight is its own [BT] load (no reduction over a slot tile: a
    cross-thread reduction puts a barrier between the slots' row loads, which then cannot be
    in flight together), and each slot's rows are a [BT, CK] load of their own; the fold is
    written out slot by slot (a `tl.sum` over a slot axis would let the compiler pick the
    order: a tree across threads for some layouts, which changes the bits). Callers launch
    with enable_fp_fusion=False (mul then add, no FMA), as the reference. Under the
    interpreter PRE_ROUND rounds to bf16 (its cast truncates)."""
    acc = tl.zeros((n64.shape[0], cols.shape[0]), dtype=tl.float32)
    for s in tl.static_range(S):
        ik = tl.load(idx_ptr + n64 * ISTRIDE + s, mask=nm, other=-1)
        v = ik >= 0
        if INDIRECT:
            rk = ik.to(tl.int64)
        else:
            rk = row0 + s * rstride
        if HAS_W:
            wk = tl.load(w_ptr + n64 * ISTRIDE + s, mask=nm & v, other=0.0)
        else:
            wk = tl.where(v, 1.0, 0.0)
        y = tl.load(ptr + rk[:, None] * D + cols[None, :], mask=v[:, None] & cm[None, :],
                    other=0.0)
        acc = acc + wk[:, None] * y.to(tl.float32)
    acc = acc + 0.0
    if PRE_ROUND:
        acc = round_bf16(acc)
    return acc


__all__ = ["chunk_cols", "ksum", "source_block", "span", "num_items", "work_item", "row_cols",
           "rows_per_step", "warps",
           "CHUNK_COLS", "TILE_ELEMS", "NUM_WARPS"]
