"""Grouped GEMM y = x @ w[e].T for the bf16 and fp8_block recipes on TMA descriptors.

One kernel, both layouts. Operands come through host-side tensor descriptors (TMA on Hopper:
bulk async copies into swizzled shared memory, zero fill out of bounds, no address math in
registers): A [M, K] (contiguous) or [E, C, K] (masked), B viewed as [E*N, K]. Tiles are
ordered in groups of GROUP_M M-tiles that sweep all N tiles (the programs in flight share A rows
and one expert's weights in L2); PERSISTENT runs one program per SM over a grid-stride loop.

Contiguous layout: the number of M tiles is read on the device from offsets_E1[E] (no host
sync; rows past it are padding that a no-sync worst-case layout adds) and each tile's expert
from row_expert_M at its first row (BLOCK_M divides the alignment). Masked layout: tiles past
an expert's count are skipped.

fp8_block (1x128 activation scales x 128x128 weight scales): each K block of 128 is one dot
from a zero accumulator, promoted in fp32 with the per-row scale a_s * b_s (b_s is one number
per 128 columns, so a BLOCK_N of 256 runs as two 128-wide halves, SPLIT_N=2, each with a
scalar weight scale: the promotion is one FMA per element). WARP_SPEC asks Triton's automatic
warp specialization for the K loop (loads in a producer partition).

Under the CPU interpreter dots run in fp32 and outputs are pre-rounded (see _common).
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.kernels._common import INTERPRET, round_bf16

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402


@dataclass(frozen=True)
class GemmConfig:
    """Launch configuration of the TMA grouped GEMM (see module doc)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4
    group_m: int = 8
    persistent: bool = True
    tma_store: bool = False
    warp_spec: bool = False


# Tuned on one H200 (triton 3.6, 2026-12-01) at DeepSeek-V3 shapes (32 experts, 4096 tokens x
# top-8; GEMM1 N=4096 K=7168, GEMM2 N=7168 K=2048) by `python -m epmoe.bench.kernel_tune`:
# fp8_block 128x128, 8 warps, 4 stages, TMA store: 2307 / 1313 us (next: the same with a
# pointer store 2518 / 1353, warp-specialized 2329 / 1345, 128x256 halves 3077 / 1599);
# bf16 128x256, 8 warps, 3 stages, TMA store: 3081 / 1632 us (pointer store 3176 / 1682).
# Keyed by recipe; BLOCK_M is reduced to the layout's alignment when that is smaller.
TUNED = {
    "fp8_block": GemmConfig(128, 128, 8, 4, tma_store=True),
    "bf16": GemmConfig(128, 256, 8, 3, tma_store=True),
}


@triton.jit
def _tile_coords(tile, grid_m, grid_n, GROUP_M: tl.constexpr):
    width = GROUP_M * grid_n
    first_m = (tile // width) * GROUP_M
    size = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (tile % width) % size, (tile % width) // size


@triton.jit
def _dot_nt(a, b, INTERP: tl.constexpr):
    if INTERP:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    return tl.dot(a, tl.trans(b))


@triton.jit
def _store_tile(c_desc, c_ptr, acc, e, row0, rows, row_mask, n0, N, stride_cm, bias_ptr,
                stride_b, MASKED: tl.constexpr, TMA_STORE: tl.constexpr,
                PRE_ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                BN: tl.constexpr):
    if HAS_BIAS:  # the expert's fp32 bias row, added before the one bf16 rounding
        offs_b = n0 + tl.arange(0, BN)
        acc += tl.load(bias_ptr + e.to(tl.int64) * stride_b + offs_b, mask=offs_b < N,
                       other=0.0)[None, :]
    if PRE_ROUND:
        acc = round_bf16(acc)
    out = acc.to(tl.bfloat16)
    if TMA_STORE:
        if MASKED:
            c_desc.store([e, row0, n0], tl.reshape(out, (1, BLOCK_M, BN)))
        else:
            c_desc.store([row0, n0], out)
    else:
        offs_n = n0 + tl.arange(0, BN)
        ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(ptrs, out, mask=row_mask[:, None] & (offs_n < N)[None, :])


@triton.jit
def _gemm_tma_kernel(
        a_desc, b_desc, c_desc, c_ptr, as_ptr, bs_ptr, row_expert_ptr, counts_ptr, offsets_ptr,
        bias_ptr, a_ptr, arow_ptr, M, N, K, E, stride_am, stride_as_m, stride_as_g,
        stride_bs_e, stride_bs_n, stride_bs_k,
        stride_cm, stride_b, FP8: tl.constexpr, MASKED: tl.constexpr, A_PACKED: tl.constexpr,
        HAS_BIAS: tl.constexpr, A_GATHER: tl.constexpr,
        INTERP: tl.constexpr, TMA_STORE: tl.constexpr, WARP_SPEC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_N: tl.constexpr, GROUP_M: tl.constexpr):
    BN: tl.constexpr = BLOCK_N // SPLIT_N
    grid_n = tl.cdiv(N, BLOCK_N)
    if MASKED:  # M = capacity C; expert e owns rows [e*C, e*C + counts[e])
        grid_m = tl.cdiv(M, BLOCK_M)
        per_e = grid_m * grid_n
        num_tiles = E * per_e
    else:  # rows past offsets[E] are padding of a worst-case (no-sync) layout
        grid_m = tl.cdiv(tl.minimum(tl.load(offsets_ptr + E), M), BLOCK_M)
        num_tiles = grid_m * grid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    zero_m = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        if MASKED:
            e = tile // per_e
            pid_m, pid_n = _tile_coords(tile % per_e, grid_m, grid_n, GROUP_M)
            row0 = pid_m * BLOCK_M
            local = row0 + tl.arange(0, BLOCK_M)
            run = row0 < tl.load(counts_ptr + e)
            rows = e * M + local
            row_mask = local < M
            rows_s = e * M + tl.minimum(local, M - 1)
        else:
            pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP_M)
            row0 = pid_m * BLOCK_M
            rows = row0 + tl.arange(0, BLOCK_M)
            # a tile that is all padding (alignment > BLOCK_M) computes expert 0 into padding
            e = tl.maximum(tl.load(row_expert_ptr + row0), 0)
            run = row0 < M
            row_mask = rows < M
            rows_s = tl.minimum(rows, M - 1)
        if run:
            n0 = pid_n * BLOCK_N
            b_row = e * N + n0
            if A_GATHER:  # row m (masked: (e, c)) is A's row arow[m]; rows past the count
                # (contiguous: arow < 0, padding) read row 0 (their outputs are any value) and
                # load nothing
                offs_k = tl.arange(0, BLOCK_K)
                arow = tl.load(arow_ptr + rows_s)
                if MASKED:
                    live = local < tl.load(counts_ptr + e)
                else:
                    live = row_mask & (arow >= 0)
                a_rows = tl.where(live, arow, 0).to(tl.int64)
                a_at = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
                as_row = as_ptr + a_rows * stride_as_m
            else:
                as_row = as_ptr + rows_s.to(tl.int64) * stride_as_m
            bs_at = bs_ptr + e.to(tl.int64) * stride_bs_e + (n0 // 128) * stride_bs_n
            acc0 = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
            acc1 = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
            for kb in tl.range(0, k_tiles, warp_specialize=WARP_SPEC):
                k0 = kb * BLOCK_K
                if A_GATHER:
                    a = tl.load(a_at + k0, mask=live[:, None] & (offs_k < K - k0)[None, :],
                                other=0.0)
                elif MASKED:
                    a = tl.reshape(a_desc.load([e, row0, k0]), (BLOCK_M, BLOCK_K))
                else:
                    a = a_desc.load([row0, k0])
                b0 = b_desc.load([b_row, k0])
                if FP8:
                    if A_PACKED:  # UE8M0 exponents, four a word
                        word = tl.load(as_row + (kb // 4) * stride_as_g)
                        bits = ((word >> (8 * (kb % 4))) & 255) << 23
                        a_s = tl.where(bits == 0, 0x400000, bits).to(tl.float32, bitcast=True)
                    else:
                        a_s = tl.load(as_row + kb * stride_as_g)
                    # the weight scale as a broadcast vector load (one address): a scalar
                    # load here has raced in Triton's software pipeliner (tritonbench #1163)
                    s0 = a_s * tl.load(bs_at + kb * stride_bs_k + zero_m)
                    acc0 += _dot_nt(a, b0, INTERP) * s0[:, None]
                    if SPLIT_N == 2:
                        b1 = b_desc.load([b_row + BN, k0])
                        s1 = a_s * tl.load(bs_at + stride_bs_n + kb * stride_bs_k + zero_m)
                        acc1 += _dot_nt(a, b1, INTERP) * s1[:, None]
                else:
                    if INTERP:
                        acc0 = tl.dot(a.to(tl.float32), tl.trans(b0.to(tl.float32)), acc0)
                    else:
                        acc0 = tl.dot(a, tl.trans(b0), acc0)
                    if SPLIT_N == 2:
                        b1 = b_desc.load([b_row + BN, k0])
                        if INTERP:
                            acc1 = tl.dot(a.to(tl.float32), tl.trans(b1.to(tl.float32)), acc1)
                        else:
                            acc1 = tl.dot(a, tl.trans(b1), acc1)
            _store_tile(c_desc, c_ptr, acc0, e, row0, rows, row_mask, n0, N, stride_cm,
                        bias_ptr, stride_b, MASKED, TMA_STORE, INTERP, HAS_BIAS, BLOCK_M, BN)
            if SPLIT_N == 2:
                _store_tile(c_desc, c_ptr, acc1, e, row0, rows, row_mask, n0 + BN, N,
                            stride_cm, bias_ptr, stride_b, MASKED, TMA_STORE, INTERP,
                            HAS_BIAS, BLOCK_M, BN)


def num_sms(device) -> int:
    if INTERPRET:
        return 4  # a few programs, so the interpreter exercises the grid-stride loop
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_supported(x_data: torch.Tensor, w_data: torch.Tensor, recipe: str) -> bool:
    """Recipes and strides the TMA kernel takes (16-byte aligned rows and bases)."""
    if recipe not in ("bf16", "fp8_block"):
        return False
    k_bytes = x_data.shape[-1] * x_data.element_size()
    return (k_bytes % 16 == 0 and x_data.is_contiguous() and w_data.is_contiguous()
            and x_data.data_ptr() % 16 == 0 and w_data.data_ptr() % 16 == 0)


def launch_tma(x, w, out, row_expert, counts, offsets, m: int, num_e: int, masked: bool,
               block_m: int, cfg: GemmConfig, bias=None, rows_EC=None) -> None:
    """out [M, N] (contiguous) / [E, C, N] (masked) bf16 <- x (QTensor) @ w (QWeight)
    (+ bias [E, N] fp32 of each row's expert). rows_EC: int32 [E, C] (masked) / [M]
    (contiguous, -1 on padding): row (e, c) / m is x's row rows_EC[...] (x [R, K]: read by
    pointer loads, not TMA)."""
    e_w, n, k = w.shape
    fp8 = w.recipe == "fp8_block"
    block_k = 128 if fp8 else 64
    block_n = cfg.block_n if n > 64 or INTERPRET else 64
    split = 2 if block_n == 256 and fp8 else 1
    bn = block_n // split
    a = x.data
    if rows_EC is not None:  # [E, C] masked, [M] contiguous
        a_desc = None
    elif masked:
        a_desc = TensorDescriptor(a, [num_e, m, k], [m * k, k, 1], [1, block_m, block_k])
    else:
        a_desc = TensorDescriptor(a, [m, k], [k, 1], [block_m, block_k])
    b_desc = TensorDescriptor(w.data, [e_w * n, k], [k, 1], [bn, block_k])
    if masked:
        c_desc = TensorDescriptor(out, [num_e, m, n], [m * n, n, 1], [1, block_m, bn])
    else:
        c_desc = TensorDescriptor(out, [m, n], [n, 1], [block_m, bn])
    s = x.scale
    if fp8:
        if s.dim() == 3:
            s = s.reshape(-1, s.shape[2])
        ss, bs = (s.stride(0), s.stride(1)), w.scale.stride()
    else:
        s, ss, bs = out, (0, 0), (0, 0, 0)
    grid_m = triton.cdiv(m, block_m)
    tiles = grid_m * triton.cdiv(n, block_n) * (num_e if masked else 1)
    progs = min(tiles, num_sms(out.device)) if cfg.persistent else tiles
    _gemm_tma_kernel[(max(progs, 1),)](
        a_desc, b_desc, c_desc, out, s, w.scale if fp8 else out, row_expert, counts, offsets,
        bias if bias is not None else out, a, rows_EC if rows_EC is not None else counts, m,
        n, k, num_e, a.stride(0), ss[0], ss[1], bs[0], bs[1], bs[2], n,
        bias.stride(0) if bias is not None else 0,
        FP8=fp8, MASKED=masked, A_PACKED=fp8 and x.scale_fmt == "ue8m0_packed",
        HAS_BIAS=bias is not None, A_GATHER=rows_EC is not None,
        INTERP=INTERPRET, TMA_STORE=cfg.tma_store, WARP_SPEC=cfg.warp_spec and not INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_N=split,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


__all__ = ["GemmConfig", "TUNED", "launch_tma", "tma_supported", "num_sms"]
