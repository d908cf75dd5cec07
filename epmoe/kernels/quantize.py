"""Fused activation quantization of token rows: `quantize_tokens(x_TD, quant) -> QTensor`.

One pass over x: per row and per `quant.act_group` columns, amax (clamped to >= 1e-10), scale =
amax / 448 (IEEE division) or rounded up to a power of two (scale_fmt ue8m0_fp32 /
ue8m0_packed, and mxfp8), codes = fp8(clamp(x / scale, -448, 448)) with IEEE division and
round-to-nearest-even. These are `epmoe.quant.quantize_act`'s rules, so the codes and scales
are bit for bit the reference's (the reference stays in quant.py). Scale outputs:

  fp8_block / w4a8_mxfp4, fp32 / ue8m0_fp32   fp32 [T, D/128], row-major (mn_major=False) or
                                              MN-major TMA-aligned (mn_major=True, DeepGEMM SM90)
  fp8_block, ue8m0_packed                     int32 [T, ceil(D/128/4)], MN-major (DeepGEMM SM100)
  mxfp8                                       uint8 e8m0 [T, D/32], row-major or MN-major
  bf16                                        no scale: x.to(bf16)

CPU decision: on CPU tensors `quantize_tokens` runs the torch reference (`backend='auto'`);
the Triton kernel runs under the interpreter only when asked (`backend='triton'`, the tests at
tiny shapes), since the interpreter costs per program and the reference is exact by definition.
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.kernels._common import (INTERPRET, align_up, check, check_tensor,
                                   empty_mn_major, fp8_scale, round_e4m3)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.config import QuantConfig  # noqa: E402
from epmoe.kernels.launcher import Launcher  # noqa: E402
from epmoe.quant import AMAX_MIN, FP8_DTYPE, FP8_MAX, QTensor, quantize_act  # noqa: E402

_FP32, _POW2, _E8M0, _PACKED = 1, 2, 3, 4  # scale modes


@dataclass(frozen=True)
class QuantKernelConfig:
    """rows per program, scale groups per program (a multiple of 4 for packed UE8M0), warps."""

    block_m: int = 4
    groups: int = 8
    num_warps: int = 4


# Tuned on one H200 at 4096 x 7168 bf16 (`python -m epmoe.bench.kernel_tune`, 2026-12-01):
# group 128: 4 rows x 8 groups, 4 warps 30.2 us (8x8/8 warps 32.2, 2x16 39.7, 1x64 45.7);
# group 32 (mxfp8): 4 x 32, 4 warps 31.1 us (8 x 16: 30.5, within noise; 2 x 64: 40.8).
TUNED_QUANT = {128: QuantKernelConfig(4, 8, 4), 32: QuantKernelConfig(4, 32, 4)}


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, D, stride_x, stride_q, s_stride_m, s_stride_g,
                       amax_min, fp8_max, MODE: tl.constexpr, PRE_ROUND: tl.constexpr,
                       GROUP: tl.constexpr, GPP: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * (GPP * GROUP) + tl.arange(0, GPP * GROUP)
    rm = rows < M
    mask = rm[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    xg = tl.reshape(x.to(tl.float32), (BLOCK_M, GPP, GROUP))
    amax = tl.maximum(tl.max(tl.abs(xg), axis=2), amax_min)
    s, e8 = fp8_scale(amax, fp8_max, MODE >= 2)
    q = tl.math.div_rn(xg, s[:, :, None])
    q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
    if PRE_ROUND:
        q = round_e4m3(q)
    q = tl.reshape(q, (BLOCK_M, GPP * GROUP))
    tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=mask)
    num_groups = D // GROUP
    g = tl.program_id(1) * GPP + tl.arange(0, GPP)
    s_rows = s_ptr + rows64[:, None] * s_stride_m
    gmask = rm[:, None] & (g < num_groups)[None, :]
    if MODE <= 2:
        tl.store(s_rows + g[None, :] * s_stride_g, s, mask=gmask)
    elif MODE == 3:
        tl.store(s_rows + g[None, :] * s_stride_g, e8.to(tl.uint8), mask=gmask)
    else:  # four exponents a little-endian int32 word; groups past the end are zero bytes
        e8 = tl.reshape(tl.where(gmask, e8, 0), (BLOCK_M, GPP // 4, 4))
        shift = (tl.arange(0, 4) * 8)[None, None, :]
        word = tl.sum(e8 << shift, axis=2)
        wi = tl.program_id(1) * (GPP // 4) + tl.arange(0, GPP // 4)
        tl.store(s_rows + wi[None, :] * s_stride_g, word,
                 mask=rm[:, None] & (wi < tl.cdiv(num_groups, 4))[None, :])


def _mode(quant: QuantConfig) -> int:
    if quant.recipe == "mxfp8":
        return _E8M0
    return {"fp32": _FP32, "ue8m0_fp32": _POW2, "ue8m0_packed": _PACKED}[quant.scale_fmt]


def _empty_scale(mode: int, t: int, g: int, mn_major: bool, dev) -> torch.Tensor:
    if mode == _PACKED:
        return empty_mn_major(t, triton.cdiv(g, 4), torch.int32, dev)
    dt = torch.uint8 if mode == _E8M0 else torch.float32
    return empty_mn_major(t, g, dt, dev) if mn_major else torch.empty((t, g), dtype=dt, device=dev)


def _check_out(out: QTensor, t: int, d: int, group: int, mode: int, mn_major: bool) -> None:
    check(isinstance(out, QTensor) and out.data.dtype == FP8_DTYPE and
          tuple(out.data.shape) == (t, d) and out.data.stride(1) == 1,
          f"out.data must be float8_e4m3fn [{t}, {d}] with contiguous rows")
    g = d // group
    w = (g + 3) // 4 if mode == _PACKED else g
    dt = {_PACKED: torch.int32, _E8M0: torch.uint8}.get(mode, torch.float32)
    mn = mode == _PACKED or mn_major
    stride = (1, align_up(t, 4)) if mn else (w, 1)
    s = out.scale
    check(s is not None and s.dtype == dt and tuple(s.shape) == (t, w) and
          (s.stride() == stride or t <= 1 or w <= 1),
          f"out.scale must be {dt} {(t, w)} with strides {stride}, got "
          f"{None if s is None else (s.dtype, tuple(s.shape), s.stride())}")


def _groups_per_program(cfg: QuantKernelConfig, mode: int, groups: int) -> int:
    gpp = max(cfg.groups, 4) if mode == _PACKED else cfg.groups
    return min(gpp, max(4, triton.next_power_of_2(groups))) if INTERPRET else gpp


def launch_quant(x: torch.Tensor, group: int, mode: int, q: torch.Tensor, s: torch.Tensor,
                 cfg: QuantKernelConfig | None = None) -> None:
    """The kernel alone: x [T, D] -> q [T, D] fp8 and s (layout given by its strides)."""
    t, d = x.shape
    if t == 0 or d == 0:
        return
    cfg = cfg or TUNED_QUANT[group]
    gpp = _groups_per_program(cfg, mode, d // group)
    grid = (triton.cdiv(t, cfg.block_m), triton.cdiv(d // group, gpp))
    _quant_rows_kernel[grid](x, q, s, t, d, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                             AMAX_MIN, FP8_MAX, MODE=mode, PRE_ROUND=INTERPRET, GROUP=group,
                             GPP=gpp, BLOCK_M=cfg.block_m, num_warps=cfg.num_warps)


def quantize_tokens(x_TD: torch.Tensor, quant: QuantConfig, mn_major: bool = False,
                    out: QTensor | None = None, backend: str = "auto",
                    config: QuantKernelConfig | None = None) -> QTensor:
    """x [T, D] (bf16 / fp16 / fp32) -> QTensor in `quant`'s activation format, the codes and
    scale values of `epmoe.quant.quantize_act` bit for bit.

    mn_major  fp32 / e8m0 scales in the MN-major TMA-aligned layout (strides (1, align(T, 4)))
              instead of row-major; packed UE8M0 is always MN-major
    out       preallocated QTensor to write into (no allocation); returned as is
    backend   'auto' (Triton on CUDA, the torch reference on CPU), 'triton', 'torch'
    """
    check_tensor("x_TD", x_TD, (torch.bfloat16, torch.float16, torch.float32), dim=2,
                 contiguous=False)
    check(backend in ("auto", "triton", "torch"),
          f"backend ({backend!r}) must be 'auto', 'triton' or 'torch'")
    if quant.recipe == "bf16":
        return QTensor(x_TD.to(torch.bfloat16), None, "bf16", 0, quant.scale_fmt)
    group = quant.act_group
    t, d = x_TD.shape
    check(d % group == 0, f"hidden ({d}) must be a multiple of {quant.recipe}'s activation "
          f"group ({group}); pick recipe bf16 or a hidden size that is a multiple of {group}")
    mode = _mode(quant)
    if out is not None:
        _check_out(out, t, d, group, mode, mn_major)
    use_triton = backend == "triton" or (backend == "auto" and x_TD.is_cuda)
    if not use_triton:
        ref = quantize_act(x_TD, quant)
        if out is None and not (mn_major and mode != _PACKED):
            return ref
        dst = out or QTensor(torch.empty_like(ref.data), _empty_scale(mode, t, d // group,
                                                                       True, x_TD.device),
                             ref.recipe, ref.group, ref.scale_fmt)
        dst.data.copy_(ref.data)
        dst.scale.copy_(ref.scale)
        return dst
    check(x_TD.stride(1) == 1, f"x_TD rows must be contiguous (stride {x_TD.stride()}); call "
          f".contiguous() first")
    if out is None:
        out = QTensor(torch.empty((t, d), dtype=FP8_DTYPE, device=x_TD.device),
                      _empty_scale(mode, t, d // group, mn_major, x_TD.device),
                      quant.recipe, group, quant.scale_fmt)
    launch_quant(x_TD, group, mode, out.data, out.scale, config)
    return out


class TokenQuantizer:
    """`quantize_tokens`' Triton path for one format and hidden size, its kernel bound once
    (`epmoe.kernels.launcher`): for a caller that quantizes every call (the symm-ht wire).
    Row-major scales; the same kernel, arguments and results as quantize_tokens."""

    def __init__(self, quant: QuantConfig, hidden: int,
                 config: QuantKernelConfig | None = None):
        check(quant.recipe != "bf16", "bf16 has nothing to quantize")
        group = quant.act_group
        check(hidden % group == 0, f"hidden ({hidden}) must be a multiple of {quant.recipe}'s "
              f"activation group ({group})")
        self.quant, self.group, self.hidden, self.mode = quant, group, hidden, _mode(quant)
        cfg = config or TUNED_QUANT[group]
        gpp = _groups_per_program(cfg, self.mode, hidden // group)
        self.block_m, self.col_programs = cfg.block_m, triton.cdiv(hidden // group, gpp)
        self.kernel = Launcher(_quant_rows_kernel, dict(
            MODE=self.mode, PRE_ROUND=INTERPRET, GROUP=group, GPP=gpp, BLOCK_M=cfg.block_m),
            num_warps=cfg.num_warps)

    def __call__(self, x_TD: torch.Tensor) -> QTensor:
        t, d = x_TD.shape
        check(d == self.hidden and x_TD.stride(1) == 1, f"x_TD must be [T, {self.hidden}] "
              f"with contiguous rows, got {tuple(x_TD.shape)} strides {x_TD.stride()}")
        q = torch.empty((t, d), dtype=FP8_DTYPE, device=x_TD.device)
        s = _empty_scale(self.mode, t, d // self.group, False, x_TD.device)
        if t:
            self.kernel((triton.cdiv(t, self.block_m), self.col_programs), x_TD, q, s, t, d,
                        x_TD.stride(0), q.stride(0), s.stride(0), s.stride(1), AMAX_MIN,
                        FP8_MAX)
        return QTensor(q, s, self.quant.recipe, self.group, self.quant.scale_fmt)


__all__ = ["quantize_tokens", "QuantKernelConfig", "TokenQuantizer", "launch_quant"]
