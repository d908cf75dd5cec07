"""The W4A8 grouped GEMM on fp8 tensor cores: e2m1 weights (two a byte, low nibble first) with
an e8m0 scale per 32 columns, times fp8 e4m3 activations with an fp32 scale per 128 columns;
contiguous and masked layouts, as `epmoe.kernels.grouped_gemm`.

The decode is a bit shuffle, exact for every code: an e2m1 code (sign e1 e0 m) placed with e1 e0
m on e4m3's bits 4..2 and its sign on bit 7 is an e4m3 number worth exactly the code's value x
2**-6 (e2m1's subnormal 0.5 lands on e4m3's subnormal 4 x 2**-9). On the GPU one 32-bit
operation handles four bytes (inline PTX, `pack=4`), so a weight costs about one integer
operation instead of the ~10 of a decode to bf16. Each group of 32 columns is then one fp8
MMA (K = 32, fp32 out) scaled by its e8m0 scale, and by the activation scale x 2**6 (per
group below BLOCK_M 128; at 128 once per 128 columns, on the 4 groups' sum). The operands are
swapped (acc^T = W A^T), so BLOCK_M, the tokens' side, can be 16 for a decode batch's few rows
per expert (`w4a8_block_m`). Against the bf16 route (`kernel='pointer'`) on one H200 at
DeepSeek-V4-Flash's shapes: 3.4-4.1x faster for decode batches (there on par with fp8_block),
1.4-1.6x for prefill (there 2.4-2.8x behind fp8_block; BENCHMARKS.md section 13).
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET, e8m0_to_fp32, grouped_tile, store_tile

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.quant import QWeight  # noqa: E402

_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bn, w, s in ((128, 8, 3), (128, 4, 4), (256, 8, 3), (64, 4, 4), (128, 8, 4),
                             (64, 4, 3))]


def _prune(configs, named_args, **kwargs):
    """Tiny problems (unit tests, decode) are launch-bound: skip the tuning sweep."""
    return configs if named_args["N"] * named_args["K"] >= 1024 * 1024 else configs[:1]


def _maybe_autotune(fn):
    if INTERPRET:
        return fn
    return triton.autotune(configs=_CONFIGS, key=["N", "K", "MASKED", "BLOCK_M", "A_GATHER"],
                           prune_configs_by={"early_config_prune": _prune})(fn)


# e2m1 nibbles -> e4m3 bytes worth the code x 2**-6, four bytes per 32-bit op: the low nibble's
# sign (bit 3) to bit 7 and its magnitude (bits 2..0) to bits 4..2; the high nibble's the same.
_LOW = tl.constexpr("{ .reg .b32 t; and.b32 t, $1, 0x07070707; shl.b32 t, t, 2;"
                    " and.b32 $0, $1, 0x08080808; shl.b32 $0, $0, 4; or.b32 $0, $0, t; }")
_HIGH = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 2; and.b32 t, t, 0x1C1C1C1C;"
                     " and.b32 $0, $1, 0x80808080; or.b32 $0, $0, t; }")


@triton.jit
def _codes_e4m3(p, HIGH: tl.constexpr, ASM: tl.constexpr):
    """uint8 bytes -> e4m3 bits of their low (or high) nibbles' e2m1 values x 2**-6."""
    if ASM:
        return tl.inline_asm_elementwise(_HIGH if HIGH else _LOW, "=r,r", [p], dtype=tl.uint8,
                                         is_pure=True, pack=4)
    if HIGH:
        return ((p >> 2) & 0x1C) | (p & 0x80)
    return ((p & 7) << 2) | ((p & 8) << 4)


@triton.jit
def _decode(p, ASM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Codes [BLOCK_N, 16] bytes -> e4m3 [BLOCK_N, 32] in column order, values x 2**-6."""
    w = tl.reshape(tl.join(_codes_e4m3(p, False, ASM), _codes_e4m3(p, True, ASM)), (BLOCK_N, 32))
    return w.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _group(p, a, words, g: tl.constexpr, INTERP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Group g of a 128-column block: one fp8 MMA, scaled by the rows' 2**(s - 127)."""
    w = _decode(p, not INTERP, BLOCK_N)
    if INTERP:  # the interpreter's fp8 dot: through fp32 (exact products)
        d = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)))
    else:
        d = tl.dot(w, tl.trans(a))
    return d * e8m0_to_fp32((words >> (8 * g)) & 255)[:, None]


@_maybe_autotune
@triton.jit
def _w4a8_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, row_expert_ptr, counts_ptr, bias_ptr, arow_ptr,
        M, N, K, GRID_M, stride_am, stride_as_m, stride_as_g,
        stride_be, stride_bn, stride_bs_e, stride_bs_n, stride_bs_k, stride_cm, stride_b,
        MASKED: tl.constexpr, HAS_BIAS: tl.constexpr, A_GATHER: tl.constexpr,
        INTERP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        GROUP_M: tl.constexpr):
    run, e64, rows, rows64, row_mask, offs_n, offs_nl = grouped_tile(
        row_expert_ptr, counts_ptr, arow_ptr, M, N, GRID_M, MASKED, A_GATHER, BLOCK_M, BLOCK_N,
        GROUP_M)
    if run:
        # Swapped operands, acc^T [BLOCK_N, BLOCK_M] = W A^T: the decoded weights are the MMA's
        # A operand (from registers), each thread's accumulator rows are a couple of weight
        # rows (a couple of e8m0 scales), and a decode batch's few rows per expert fill the
        # MMA's N side. Per 128 columns: 4 groups of 32, 16 bytes of codes per weight row each.
        a_ptrs = a_ptr + rows64[:, None] * stride_am + tl.arange(0, 32)[None, :]
        b_ptrs = (b_ptr + e64 * stride_be + offs_nl[:, None] * stride_bn
                  + tl.arange(0, 16)[None, :])
        ws_ptrs = bs_ptr + e64 * stride_bs_e + offs_nl * stride_bs_n  # int32: 4 groups a word
        as_row = as_ptr + rows64 * stride_as_m
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(0, K // 128):
            a_s = tl.load(as_row + kb * stride_as_g) * 64.0  # 64: the shuffle's 2**-6
            words = tl.load(ws_ptrs + kb)
            if BLOCK_M >= 128:  # the 4 groups summed first, a_s applied once (1.25 vs 2
                part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # ops an element;
                for g in tl.static_range(4):  # 0.87x at 96 rows an expert, BENCHMARKS 13)
                    part += _group(tl.load(b_ptrs + g * 16), tl.load(a_ptrs + g * 32), words,
                                   g, INTERP, BLOCK_N)
                acc += part * a_s[None, :]
            else:  # a_s on each group: one tile less live (faster below BLOCK_M 128)
                for g in tl.static_range(4):
                    acc += _group(tl.load(b_ptrs + g * 16), tl.load(a_ptrs + g * 32), words,
                                  g, INTERP, BLOCK_N) * a_s[None, :]
            a_ptrs += 128
            b_ptrs += 64
        store_tile(tl.trans(acc), c_ptr, stride_cm, rows, row_mask, offs_n, N, bias_ptr,
                   stride_b, e64, offs_nl, HAS_BIAS, INTERP)


def w4a8_block_m(rows_per_expert: float, cap: int) -> int:
    """BLOCK_M for this kernel: the power of two >= the rows an expert gets (>= 16), at most
    cap. BLOCK_M is the swapped MMA's N side, and every M tile decodes its expert's whole
    weight again: at 3 rows an expert (DeepSeek-V4-Flash, 128 tokens) 16 runs 2.9x faster
    than 128, at 96 rows 128 runs 1.8x faster than 16 (one H200, BENCHMARKS.md section 13)."""
    bm = 16
    while bm < cap and bm < rows_per_expert:
        bm *= 2
    return min(bm, cap)


def launch_w4a8(w: QWeight, a_2d: torch.Tensor, s_2d: torch.Tensor,
                out_2d: torch.Tensor, row_expert, counts, m: int, grid_m: int, num_e: int,
                block_m: int, masked: bool, bias=None, arow=None) -> None:
    """One launch over the tiles of a contiguous (num_e = 1) or masked layout; the operands
    were checked by the grouped GEMM's entry points (K a multiple of 128). arow: output row
    m reads a_2d's row arow[m] (`grouped_tile`)."""
    e, n, k = w.shape
    kwargs = dict(MASKED=masked, HAS_BIAS=bias is not None, A_GATHER=arow is not None,
                  INTERP=INTERPRET, BLOCK_M=block_m, GROUP_M=8)
    if INTERPRET:
        kwargs.update(BLOCK_N=min(256, triton.next_power_of_2(n)), num_warps=4)

    def grid(meta):
        return (grid_m * triton.cdiv(n, meta["BLOCK_N"]), 1, num_e)

    scale = w.scale.view(torch.int32)  # [E, N, K / 128]: a word holds 4 groups' e8m0 bytes
    _w4a8_kernel[grid](
        a_2d, s_2d, w.data, scale, out_2d, row_expert, counts,
        bias if bias is not None else out_2d, arow if arow is not None else counts, m, n, k,
        grid_m,
        a_2d.stride(0), s_2d.stride(0), s_2d.stride(1), w.data.stride(0), w.data.stride(1),
        scale.stride(0), scale.stride(1), scale.stride(2), out_2d.stride(0),
        bias.stride(0) if bias is not None else 0, **kwargs)


__all__ = ["launch_w4a8", "w4a8_block_m"]
