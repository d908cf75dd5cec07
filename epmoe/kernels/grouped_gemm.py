"""Grouped GEMM y = x @ w[e].T over the contiguous and the masked expert layouts.

Contiguous: rows [M, K] with row_expert_M; groups are aligned to the layout's alignment, and
BLOCK_M divides it, so each BLOCK_M tile belongs to one expert (read from its first row; a tile
whose first row is padding is all padding and skipped). Masked: x [E, C, K] with counts [E];
tiles past an expert's count are skipped. Recipes (acc fp32, out bf16):

  bf16        bf16 x bf16
  fp8_block   fp8 x fp8, per K block of 128: acc += dot * a_scale[row, kb] * w_scale[n/128, kb]
              (activation scales fp32 any strides, or packed UE8M0 int32)
  mxfp8       fp8 x fp8 with e8m0 scales per 32 on both sides, dequantized to bf16 in-kernel
              (K a multiple of 32: a K step of 128, 64 or 32)
  w4a8_mxfp4  e2m1 weights (two a byte) x e8m0 per 32; fp8 activations, per-128 fp32 scales
              applied to the fp32 partial sums

Names follow DeepGEMM's grammar: m-grouped, nt (w stored [N, K]), contiguous / masked.

Three kernels: bf16 and fp8_block run on the TMA kernel of `epmoe.kernels.gemm_tma` (persistent,
tensor descriptors, tuned configs); w4a8_mxfp4 on `epmoe.kernels.gemm_w4a8` (codes shuffled to
fp8, fp8 MMAs); this file's pointer kernel serves every recipe (mxfp8 and w4a8_mxfp4 decoded to
bf16 in-kernel) and is the `kernel='pointer'` choice for bf16 / fp8_block / w4a8_mxfp4.
Every kernel can read A's rows through an index (`rows_M` / `rows_EC`: a batch's tokens in
place, no copy into the layout first): the TMA kernel by pointer loads, the others as always.
"""

from __future__ import annotations

from epmoe.kernels._common import (INTERPRET, check, e8m0_to_fp32, grouped_tile,
                                     store_tile)
from epmoe.kernels.gemm_tma import TUNED, GemmConfig, launch_tma, tma_supported
from epmoe.kernels.gemm_w4a8 import launch_w4a8

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.layout import ContiguousLayout  # noqa: E402
from epmoe.quant import FP8_DTYPE, QTensor, QWeight  # noqa: E402

_RECIPE_ID = {"bf16": 0, "fp8_block": 1, "mxfp8": 2, "w4a8_mxfp4": 3}
# K granularity per recipe: its scale groups along K (mxfp8's 32 both sides; 128 where an
# activation scale covers 128 columns). gpt-oss's hidden 2880 is 90 x 32, not a multiple of 128.
_K_GROUP = {"bf16": 1, "fp8_block": 128, "mxfp8": 32, "w4a8_mxfp4": 128}


@triton.jit
def _e2m1_to_fp32(c):
    """uint8/int32 codes 0..15 -> fp32: magnitude 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign."""
    c = c.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


# BLOCK_M is fixed by the layout's alignment (128 for the contiguous layout at DeepSeek shapes);
# the autotuner picks BLOCK_N / warps / stages (<= 6 configs; small problems keep the first).
_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bn, w, s in ((128, 8, 4), (128, 8, 3), (256, 8, 3), (128, 4, 4), (64, 4, 4),
                             (256, 8, 4))]


def _prune_configs(configs, named_args, **kwargs):
    """Tiny problems (unit tests, decode) are launch-bound: skip the tuning sweep."""
    n, k = named_args["N"], named_args["K"]
    return configs if n * k >= 1024 * 1024 else configs[:1]


def _maybe_autotune(fn):
    """Autotune BLOCK_N / warps / stages on GPU; the interpreter runs one fixed config."""
    if INTERPRET:
        return fn
    return triton.autotune(configs=_CONFIGS, key=["N", "K", "RECIPE", "MASKED", "BLOCK_M",
                                                       "BLOCK_K", "A_GATHER"],
                           prune_configs_by={"early_config_prune": _prune_configs})(fn)


@_maybe_autotune
@triton.jit
def _grouped_gemm_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, row_expert_ptr, counts_ptr, bias_ptr, arow_ptr,
        M, N, K, GRID_M, stride_am, stride_as_m, stride_as_g,
        stride_be, stride_bn, stride_bs_e, stride_bs_n, stride_bs_k, stride_cm, stride_b,
        RECIPE: tl.constexpr, MASKED: tl.constexpr, A_PACKED: tl.constexpr,
        HAS_BIAS: tl.constexpr, A_GATHER: tl.constexpr,
        DOT_FP32: tl.constexpr, PRE_ROUND: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr):
    run, e64, rows, rows64, row_mask, offs_n, offs_nl = grouped_tile(
        row_expert_ptr, counts_ptr, arow_ptr, M, N, GRID_M, MASKED, A_GATHER, BLOCK_M, BLOCK_N,
        GROUP_M)
    if run:
        offs_k = tl.arange(0, BLOCK_K)
        # Pointers built once, advanced by BLOCK_K per step (no per-element 64-bit math inside)
        a_ptrs = a_ptr + rows64[:, None] * stride_am + offs_k[None, :]
        if RECIPE == 3:  # e2m1 codes: bytes [BLOCK_N, BLOCK_K // 2], low nibble first
            offs_kh = tl.arange(0, BLOCK_K // 2)
            b_ptrs = b_ptr + e64 * stride_be + offs_nl[:, None] * stride_bn + offs_kh[None, :]
        else:
            b_ptrs = b_ptr + e64 * stride_be + offs_nl[:, None] * stride_bn + offs_k[None, :]
        if RECIPE >= 2:
            offs_g = tl.arange(0, BLOCK_K // 32)
            ws_ptrs = (bs_ptr + e64 * stride_bs_e + offs_nl[:, None] * stride_bs_n
                       + offs_g[None, :] * stride_bs_k)
        if RECIPE == 2:
            as2_ptrs = as_ptr + rows64[:, None] * stride_as_m + offs_g[None, :] * stride_as_g
        as_row = as_ptr + rows64 * stride_as_m
        bs_row = bs_ptr + e64 * stride_bs_e + (offs_nl // 128) * stride_bs_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(offs_k < K - k0)[None, :], other=0.0)
            if RECIPE == 3:
                packed = tl.load(b_ptrs).to(tl.int32)
                w = tl.reshape(tl.join(_e2m1_to_fp32(packed & 15), _e2m1_to_fp32(packed >> 4)),
                               (BLOCK_N, BLOCK_K))
            elif EVEN_K:
                w = tl.load(b_ptrs)
            else:
                w = tl.load(b_ptrs, mask=(offs_k < K - k0)[None, :], other=0.0)
            if RECIPE >= 2:  # e8m0 weight scales per 32 columns: dequantize to bf16 in-kernel
                ws = e8m0_to_fp32(tl.load(ws_ptrs))
                w = tl.reshape(tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32))
                               * ws[:, :, None], (BLOCK_N, BLOCK_K))
            if RECIPE == 2:  # mxfp8 activations: e8m0 per 32 as well
                a_s2 = e8m0_to_fp32(tl.load(as2_ptrs))
                a = tl.reshape(tl.reshape(a.to(tl.float32), (BLOCK_M, BLOCK_K // 32, 32))
                               * a_s2[:, :, None], (BLOCK_M, BLOCK_K))
            if RECIPE == 0 or RECIPE == 2:  # no per-block scale: accumulate in the MMA
                if DOT_FP32:
                    acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
                elif RECIPE == 2:
                    acc = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
                else:
                    acc = tl.dot(a, tl.trans(w), acc)
            else:
                if DOT_FP32:
                    part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
                elif RECIPE == 3:
                    part = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
                else:
                    part = tl.dot(a, tl.trans(w))
                kb = k0 // 128  # per-row activation scale of this K block of 128
                if A_PACKED:
                    word = tl.load(as_row + (kb // 4) * stride_as_g)
                    a_s = e8m0_to_fp32((word >> (8 * (kb % 4))) & 255)
                else:
                    a_s = tl.load(as_row + kb * stride_as_g)
                if RECIPE == 1:  # 128 x 128 weight block scales, applied with a_s in fp32
                    b_s = tl.load(bs_row + kb * stride_bs_k)
                    acc += part * (a_s[:, None] * b_s[None, :])
                else:
                    acc += part * a_s[:, None]
            a_ptrs += BLOCK_K
            if RECIPE == 3:
                b_ptrs += BLOCK_K // 2
            else:
                b_ptrs += BLOCK_K
            if RECIPE >= 2:
                ws_ptrs += (BLOCK_K // 32) * stride_bs_k
            if RECIPE == 2:
                as2_ptrs += (BLOCK_K // 32) * stride_as_g
        store_tile(acc, c_ptr, stride_cm, rows, row_mask, offs_n, N, bias_ptr, stride_b, e64,
                   offs_nl, HAS_BIAS, PRE_ROUND)


def _check_operands(x: QTensor, w: QWeight) -> None:
    """On every launch: the cheap conditions first, a message built only on failure."""
    if (isinstance(x, QTensor) and isinstance(w, QWeight) and x.recipe == w.recipe
            and w.recipe in _RECIPE_ID
            and x.data.dtype == (torch.bfloat16 if w.recipe == "bf16" else FP8_DTYPE)
            and x.data.stride(-1) == 1 and w.shape[2] == x.data.shape[-1]
            and w.data.is_contiguous()
            and x.data.shape[-1] % _K_GROUP[w.recipe] == 0
            and (w.recipe == "bf16" or x.scale is not None)):
        return
    check(isinstance(x, QTensor) and isinstance(w, QWeight),
          f"x must be a QTensor and w a QWeight, got {type(x).__name__}, {type(w).__name__}")
    check(w.recipe in _RECIPE_ID, f"weight recipe ({w.recipe!r}) must be one of "
          f"{tuple(_RECIPE_ID)}")
    check(x.recipe == w.recipe, f"activation recipe ({x.recipe!r}) must match the weights' "
          f"({w.recipe!r}); quantize activations with the weights' QuantConfig")
    want = torch.bfloat16 if w.recipe == "bf16" else FP8_DTYPE
    check(x.data.dtype == want, f"x.data dtype ({x.data.dtype}) must be {want} for recipe "
          f"{w.recipe}")
    check(x.data.stride(-1) == 1, f"x.data rows must be contiguous (stride {x.data.stride()})")
    check(w.data.is_contiguous(), "w.data must be contiguous; call .contiguous() on it")
    k = x.data.shape[-1]
    check(w.shape[2] == k, f"x columns K ({k}) must equal the weights' K ({w.shape[2]})")
    if w.recipe != "bf16":
        g = _K_GROUP[w.recipe]
        check(k % g == 0, f"K ({k}) must be a multiple of {g} for recipe {w.recipe}")
        check(x.scale is not None, f"x.scale is None but recipe {w.recipe} needs scales")


def _launch(x: QTensor, w: QWeight, a_2d: torch.Tensor, s_2d, out_2d: torch.Tensor,
            row_expert, counts, m: int, grid_m: int, num_e: int, block_m: int, masked: bool,
            bias=None, kernel: str = "auto", arow=None):
    """arow: output row m reads a_2d's row arow[m] (`grouped_tile`)."""
    if w.recipe == "w4a8_mxfp4" and kernel == "auto":
        launch_w4a8(w, a_2d, s_2d, out_2d, row_expert, counts, m, grid_m, num_e, block_m,
                    masked, bias, arow)
        return
    e, n, k = w.shape
    recipe = _RECIPE_ID[w.recipe]
    packed = x.scale_fmt == "ue8m0_packed" and recipe == 1
    a_data, b_data = a_2d, w.data
    bs = w.scale if w.scale is not None else w.data
    s = s_2d if s_2d is not None else a_2d
    # K step: 64 (bf16), 128 (fp8_block: one activation scale per step), 64 (w4a8_mxfp4: its
    # in-kernel decode spills less; 12% faster at DeepSeek-V4-Flash's 4096 x 4096 on one H200,
    # BENCHMARKS.md section 12), mxfp8: the largest of 128 / 64 / 32 that divides K (its e8m0
    # groups of 32 are whole in any of them)
    block_k = 64 if recipe in (0, 3) else 128
    if recipe == 2:
        block_k = next(b for b in (128, 64, 32) if k % b == 0)
    kwargs = dict(RECIPE=recipe, MASKED=masked, A_PACKED=packed, HAS_BIAS=bias is not None,
                  A_GATHER=arow is not None, DOT_FP32=INTERPRET,
                  PRE_ROUND=INTERPRET, EVEN_K=k % block_k == 0, BLOCK_M=block_m,
                  BLOCK_K=block_k, GROUP_M=8)
    if INTERPRET:
        kwargs.update(BLOCK_N=min(256, triton.next_power_of_2(n)), num_warps=4)

    def grid(meta):
        return (grid_m * triton.cdiv(n, meta["BLOCK_N"]), 1, num_e)

    _grouped_gemm_kernel[grid](
        a_data, s, b_data, bs, out_2d, row_expert, counts,
        bias if bias is not None else out_2d, arow if arow is not None else counts, m, n, k,
        grid_m,
        a_2d.stride(0), s.stride(0) if s_2d is not None else 0,
        s.stride(1) if s_2d is not None else 0,
        b_data.stride(0), b_data.stride(1), bs.stride(0) if w.scale is not None else 0,
        bs.stride(1) if w.scale is not None else 0, bs.stride(2) if w.scale is not None else 0,
        out_2d.stride(0), bias.stride(0) if bias is not None else 0, **kwargs)


def _check_bias(bias, w: QWeight) -> None:
    if bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()
                        and tuple(bias.shape) == tuple(w.shape[:2])):
        return
    check(False, f"bias must be a contiguous fp32 [E, N] = {tuple(w.shape[:2])} tensor, got "
                 f"{bias.dtype} {tuple(bias.shape)}")


def _pick_block_m(alignment: int, cap: int = 128) -> int:
    for bm in (128, 64, 32, 16):
        if bm <= cap and alignment % bm == 0:
            return bm
    raise ValueError(f"layout alignment ({alignment}) must be a multiple of 16 for the Triton "
                     f"grouped GEMM (its smallest BLOCK_M); build the layout with alignment 16+")


def _use_tma(x: QTensor, w: QWeight, kernel: str, gathered: bool = False) -> bool:
    """gathered: A's rows read through an index (the TMA kernel's pointer loads; not with
    packed UE8M0 scales, which the pointer kernel reads)."""
    check(kernel in ("auto", "tma", "pointer"), f"kernel ({kernel!r}) must be 'auto', 'tma' "
          f"or 'pointer'")
    ok = tma_supported(x.data, w.data, w.recipe) and not (
        gathered and x.scale_fmt == "ue8m0_packed")
    check(kernel != "tma" or ok, f"the TMA kernel takes recipes bf16 / fp8_block with 16-byte "
          f"aligned contiguous rows, gathered rows without packed UE8M0 scales (got "
          f"{w.recipe} {x.scale_fmt}, x strides {x.data.stride()}); use kernel='auto'")
    return ok and kernel != "pointer"


def _out(out, shape, dev):
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=dev)
    check(out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(shape) and
          out.is_contiguous(), f"out must be a contiguous bf16 tensor of shape {tuple(shape)}, "
          f"got {out.dtype} {tuple(out.shape)}")
    return out


def triton_m_grouped_gemm_nt_contiguous(x: QTensor, w: QWeight, layout: ContiguousLayout,
                                        block_m: int | None = None,
                                        config: GemmConfig | None = None,
                                        out: torch.Tensor | None = None,
                                        kernel: str = "auto",
                                        bias: torch.Tensor | None = None,
                                        rows_M: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] rows of `layout` (QTensor of w's recipe), w [E, N, K] -> y [M, N] bf16.
    Padding rows of y are left unwritten or hold garbage (any value). No host sync: the
    number of row tiles is read on the device from layout.offsets_E1.

    config  GemmConfig of the TMA kernel (default: the tuned one for the recipe)
    out     optional preallocated [M, N] bf16 output
    kernel  'auto' (TMA kernel for bf16 / fp8_block, `epmoe.kernels.gemm_w4a8`'s fp8-MMA
            kernel for w4a8_mxfp4, the pointer kernel otherwise), 'tma', 'pointer' (the
            pre-TMA kernel, every recipe; w4a8_mxfp4 decoded to bf16 there)
    bias    optional fp32 [E, N]: each row's expert's row added in fp32 before the bf16 cast
            (gpt-oss's down bias)
    rows_M  optional int32 [M]: x is [R, K] rows and layout row m is x[rows_M[m]] (-1 on
            padding), read by pointer loads (every recipe and kernel)"""
    _check_operands(x, w)
    _check_bias(bias, w)
    m = layout.num_rows
    if rows_M is not None:
        _check_gather(x, rows_M, (m,), "rows_M")
    else:
        check(x.data.dim() == 2 and x.data.shape[0] == m, f"x.data shape "
              f"{tuple(x.data.shape)} must be [M, K] with M = layout.num_rows ({m})")
    check(layout.num_experts == w.shape[0], f"layout has {layout.num_experts} experts but the "
          f"weights {w.shape[0]}; build the layout with num_experts = w.shape[0]")
    tma = _use_tma(x, w, kernel, gathered=rows_M is not None)
    cfg = (config or TUNED[w.recipe]) if tma else None
    bm = (_pick_block_m(layout.alignment, cfg.block_m if tma else 128) if block_m is None
          else block_m)
    check(layout.alignment % bm == 0, f"BLOCK_M ({bm}) must divide the layout's alignment "
          f"({layout.alignment}): a tile must not straddle two experts; pass a smaller "
          f"block_m or build the layout with alignment a multiple of {bm}")
    y = _out(out, (m, w.shape[1]), x.data.device)
    if m == 0:
        return y
    if tma:
        launch_tma(x, w, y, layout.row_expert_M, layout.counts_E, layout.offsets_E1, m,
                   w.shape[0], False, bm, cfg, bias, rows_EC=rows_M)
    else:
        _launch(x, w, x.data, x.scale, y, layout.row_expert_M, layout.counts_E, m,
                triton.cdiv(m, bm), 1, bm, masked=False, bias=bias, kernel=kernel, arow=rows_M)
    return y


def triton_m_grouped_gemm_nt_masked(x: QTensor, w: QWeight, counts_E: torch.Tensor,
                                    block_m: int = 64, config: GemmConfig | None = None,
                                    out: torch.Tensor | None = None,
                                    kernel: str = "auto",
                                    bias: torch.Tensor | None = None,
                                    rows_EC: torch.Tensor | None = None) -> torch.Tensor:
    """x [E, C, K] (scales [E, C, G], or [E*C, G] rows for packed UE8M0), counts [E] ->
    y [E, C, N] bf16; rows past each count are left unwritten (any value). config / out /
    kernel / bias as for the contiguous layout.
    rows_EC: int32 [E, C]: x is [R, K] rows (scales [R, G]) and masked row (e, c) is
    x[rows_EC[e, c]] (read where c < counts[e] only; every recipe and kernel)."""
    _check_operands(x, w)
    _check_bias(bias, w)
    if rows_EC is not None:
        return _masked_gathered(x, w, counts_E, rows_EC, block_m, config, out, kernel, bias)
    check(x.data.dim() == 3 and x.data.shape[0] == w.shape[0],
          f"x.data shape {tuple(x.data.shape)} must be [E, C, K] with E = {w.shape[0]}")
    check(x.data.is_contiguous(), "x.data must be contiguous [E, C, K]; call .contiguous()")
    check(counts_E.dtype == torch.int32 and tuple(counts_E.shape) == (w.shape[0],),
          f"counts_E must be int32 [{w.shape[0]}], got {counts_E.dtype} {tuple(counts_E.shape)}")
    e, c, k = x.data.shape
    s = x.scale
    if s is not None and s.dim() == 3:
        s = s.reshape(e * c, s.shape[2])  # a view when rows flatten, else a copy
    y = _out(out, (e, c, w.shape[1]), x.data.device)
    if e * c == 0:
        return y
    if _use_tma(x, w, kernel):
        xs = QTensor(x.data, s, x.recipe, x.group, x.scale_fmt)
        launch_tma(xs, w, y, counts_E, counts_E, counts_E, c, e, True, block_m,
                   config or TUNED[w.recipe], bias)
    else:
        _launch(x, w, x.data.view(e * c, k), s, y.view(e * c, -1), counts_E, counts_E, c,
                triton.cdiv(c, block_m), e, block_m, masked=True, bias=bias, kernel=kernel)
    return y


def _check_gather(x: QTensor, rows, want: tuple, name: str) -> None:
    check(rows.dtype == torch.int32 and rows.is_contiguous() and rows.dim() == len(want)
          and all(a == b for a, b in zip(rows.shape, want) if b is not None),
          f"{name} must be a contiguous int32 {list(want)} tensor, got {rows.dtype} "
          f"{tuple(rows.shape)}")
    check(x.data.dim() == 2, f"with {name}, x.data must be the [R, K] rows it indexes, got "
          f"shape {tuple(x.data.shape)}")


def _masked_gathered(x: QTensor, w: QWeight, counts_E, rows_EC, block_m, config, out, kernel,
                     bias) -> torch.Tensor:
    e = w.shape[0]
    _check_gather(x, rows_EC, (e, None), "rows_EC")
    check(counts_E.dtype == torch.int32 and tuple(counts_E.shape) == (e,),
          f"counts_E must be int32 [{e}], got {counts_E.dtype} {tuple(counts_E.shape)}")
    c = rows_EC.shape[1]
    y = _out(out, (e, c, w.shape[1]), x.data.device)
    if e * c == 0:
        return y
    if _use_tma(x, w, kernel, gathered=True):
        launch_tma(x, w, y, counts_E, counts_E, counts_E, c, e, True, block_m,
                   config or TUNED[w.recipe], bias, rows_EC=rows_EC)
    else:
        _launch(x, w, x.data, x.scale, y.view(e * c, -1), counts_E, counts_E, c,
                triton.cdiv(c, block_m), e, block_m, masked=True, bias=bias, kernel=kernel,
                arow=rows_EC)
    return y


__all__ = ["triton_m_grouped_gemm_nt_contiguous", "triton_m_grouped_gemm_nt_masked",
           "GemmConfig"]
