"""Quantization recipes in plain torch (CPU and CUDA): activations, expert weights, scale formats.

Every quantizer computes in fp32 and casts to fp8 / e2m1 last (CPU torch has no fp8 arithmetic);
every dequantizer up-casts with `.float()` first. Scale rules, exactly:

- fp8_block activations: per row, per 128 columns, `amax = max(|x|)` clamped to >= 1e-10 (fp32);
  `scale = amax / 448`, or `round_scale_pow2(amax / 448)` when scale_fmt is ue8m0_fp32 or
  ue8m0_packed; `data = fp8(clamp(x / scale, -448, 448))`.
- fp8_block weights: the same rule per 128x128 block (fp32 or power-of-two per scale_fmt).
- mxfp8 (activations and weights): per row, per 32 columns, `scale = round_scale_pow2(amax / 448)`
  stored as an e8m0 byte (biased exponent: value = 2**(e - 127)).
- w4a8_mxfp4 weights: per row, per 32 columns, `scale = round_scale_pow2(amax / 6)` as e8m0;
  `codes = e2m1_encode(x / scale)` (round to nearest, ties to the even code), two codes a byte.
  w4a8_mxfp4 activations: fp8 per 128 columns with fp32 scales (the fp8_block fp32 rule).
- bf16: `data = x.to(bf16)`, no scale.

Power-of-two scales are rounded up, so `|x / scale| <= 448` (or 6) always holds: nothing clips.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from epmoe.config import RECIPES, QuantConfig
from epmoe.quant_formats import (  # noqa: F401  (the recipes' formats, re-exported)
    E2M1_MAX, E2M1_VALUES, E8M0_BIAS, _align, _mn_major, _pack_exponents, e2m1_decode, e2m1_encode,
    e2m1_pack, e2m1_unpack, e8m0_to_fp32, fp32_to_e8m0, pack_ue8m0, round_scale_pow2,
    unpack_ue8m0)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_MIN = 1e-10
MX_GROUP = 32
BLOCK = 128

# --------------------------------------------------------------------------------------------
# Shared helpers.

def _check_float(x: torch.Tensor, what: str) -> None:
    if not x.is_floating_point() or x.element_size() < 2:
        raise ValueError(f"{what} dtype ({x.dtype}) must be bf16, fp16 or fp32; quantize "
                         f"unquantized floating-point values")


def _check_multiple(name: str, value: int, group: int, recipe: str, fix: str) -> None:
    if value % group:
        raise ValueError(f"{name} ({value}) must be a multiple of {recipe}'s quant group "
                         f"({group}); {fix}")


def _amax(x: torch.Tensor, dims) -> torch.Tensor:
    return x.abs().amax(dim=dims).clamp(min=AMAX_MIN)


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """t / c correctly rounded on every device. CUDA turns division by a Python scalar into a
    multiply by its reciprocal (one ulp off for some inputs), which would make scales, and so
    fp8 codes, differ between CPU and GPU; a 0-dim device tensor gets true division."""
    return t / torch.tensor(c, dtype=t.dtype, device=t.device)


def _index0(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """index_select along dim 0, through uint8 for fp8 (CPU fp8 lacks most kernels)."""
    if t.dtype == FP8_DTYPE:
        return t.view(torch.uint8).index_select(0, idx).view(FP8_DTYPE)
    return t.index_select(0, idx)


# --------------------------------------------------------------------------------------------
# Activations.

@dataclass(frozen=True)
class QTensor:
    """Quantized activation rows. data [..., D]: bf16 (recipe bf16) or float8_e4m3fn.

    scale: None (bf16); fp32 [..., D//group] (fp8_block / w4a8_mxfp4 with scale_fmt fp32 or
    ue8m0_fp32; ue8m0_fp32 = fp32 values that are exact powers of two); uint8 e8m0 exponents
    [..., D//32] (mxfp8); int32 packed [T, ceil(D//group/4)], MN-major TMA-aligned (scale_fmt
    ue8m0_packed, see pack_ue8m0; 2-D data only).
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    recipe: str  # one of config.RECIPES
    group: int  # columns per scale (0 for bf16)
    scale_fmt: str = "fp32"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def num_rows(self) -> int:
        return math.prod(self.data.shape[:-1])

    def index_select(self, idx: torch.Tensor) -> "QTensor":
        """Rows `idx` (along dim 0) of data and scale; packed scales keep their layout."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.data.device)
        scale = None
        if self.scale is not None:
            scale = self.scale.index_select(0, idx)
            if self.scale_fmt == "ue8m0_packed":
                scale = _mn_major(scale)
        return QTensor(_index0(self.data, idx), scale, self.recipe, self.group, self.scale_fmt)

    def to(self, device) -> "QTensor":
        scale = None if self.scale is None else self.scale.to(device)
        if scale is not None and self.scale_fmt == "ue8m0_packed":
            scale = _mn_major(scale)
        return QTensor(self.data.to(device), scale, self.recipe, self.group, self.scale_fmt)


def quantize_act(x: torch.Tensor, quant: QuantConfig) -> QTensor:
    """Dynamic per-row-group quantization of x [..., D] (bf16/fp16/fp32); see the module rules."""
    _check_float(x, "activation")
    recipe = quant.recipe
    if recipe == "bf16":
        return QTensor(x.to(torch.bfloat16), None, recipe, 0, quant.scale_fmt)
    group = quant.act_group
    d = x.shape[-1]
    _check_multiple("hidden", d, group, recipe,
                    f"pick recipe bf16 or a hidden size that is a multiple of {group}")
    packed = quant.scale_fmt == "ue8m0_packed"
    if packed and x.dim() != 2:
        raise ValueError(f"scale_fmt ue8m0_packed needs 2-D activations [T, D], got shape "
                         f"{tuple(x.shape)}; reshape to [-1, D] first")
    xg = x.float().reshape(*x.shape[:-1], d // group, group)
    scale = _div(_amax(xg, -1), FP8_MAX)
    if recipe == "mxfp8" or quant.scale_fmt != "fp32":
        scale = round_scale_pow2(scale)
    data = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(x.shape)
    if recipe == "mxfp8":
        scale = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    elif packed:
        scale = _pack_exponents(((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8))
    return QTensor(data, scale, recipe, group, quant.scale_fmt)


def _act_scale_fp32(q: QTensor) -> torch.Tensor:
    if q.scale.dtype == torch.uint8:
        return e8m0_to_fp32(q.scale)
    if q.scale_fmt == "ue8m0_packed":
        return unpack_ue8m0(q.scale, q.data.shape[-1] // q.group)
    return q.scale.float()


def dequantize_act(q: QTensor) -> torch.Tensor:
    """fp32 with data's shape: data * its group's scale."""
    if q.scale is None:
        return q.data.float()
    d = q.data.shape[-1]
    xg = q.data.float().reshape(*q.data.shape[:-1], d // q.group, q.group)
    return (xg * _act_scale_fp32(q).unsqueeze(-1)).reshape(q.data.shape)


# --------------------------------------------------------------------------------------------
# Expert weights.

@dataclass(frozen=True)
class QWeight:
    """Expert weights [E, N, K] (N output rows, K input/reduction dim).

    bf16: data bf16 [E, N, K], scale None.
    fp8_block: data fp8 [E, N, K], scale fp32 [E, N//128, K//128] (scale_fmt ue8m0_fp32: powers
      of two; weights are never stored packed, see quantize_weight).
    mxfp8: data fp8 [E, N, K], scale uint8 e8m0 [E, N, K//32].
    w4a8_mxfp4: data uint8 [E, N, K//2] (two e2m1 codes a byte, LOW nibble = even column),
      scale uint8 e8m0 [E, N, K//32].
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    recipe: str
    scale_fmt: str = "fp32"

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe ({self.recipe!r}) must be one of {RECIPES}")
        if self.data.dim() != 3:
            raise ValueError(f"weight data must be [E, N, K], got shape {tuple(self.data.shape)}")

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.data.shape
        return (e, n, 2 * k) if self.recipe == "w4a8_mxfp4" else (e, n, k)

    @property
    def _block(self) -> tuple[int, int]:
        """(rows, cols) of one scale; (1, 1) for bf16."""
        return {"bf16": (1, 1), "fp8_block": (BLOCK, BLOCK), "mxfp8": (1, MX_GROUP),
                "w4a8_mxfp4": (1, MX_GROUP)}[self.recipe]

    def select(self, experts_idx: torch.Tensor | Sequence[int]) -> "QWeight":
        """Experts `experts_idx` (indices into dim 0)."""
        idx = torch.as_tensor(experts_idx, dtype=torch.long, device=self.data.device).reshape(-1)
        scale = None if self.scale is None else self.scale.index_select(0, idx)
        return QWeight(_index0(self.data, idx), scale, self.recipe, self.scale_fmt)

    def _narrow(self, dim: int, start: int, length: int) -> "QWeight":
        size, blk = self.shape[dim], self._block[dim - 1]
        what = ("rows", "N") if dim == 1 else ("cols", "K")
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"narrow_{what[0]}({start}, {length}) is out of range for "
                             f"{what[1]} ({size})")
        if start % blk or length % blk:
            raise ValueError(f"narrow_{what[0]}({start}, {length}): start and length must be "
                             f"multiples of {self.recipe}'s {blk}-wide scale block along "
                             f"{what[1]}; choose a tp degree that keeps slices block-aligned")
        dstart, dlen = start, length
        if dim == 2 and self.recipe == "w4a8_mxfp4":
            dstart, dlen = start // 2, length // 2
        data = self.data.narrow(dim, dstart, dlen).contiguous()
        scale = None
        if self.scale is not None:
            scale = self.scale.narrow(dim, start // blk, length // blk).contiguous()
        return QWeight(data, scale, self.recipe, self.scale_fmt)

    def narrow_rows(self, start: int, length: int) -> "QWeight":
        """Rows [start, start+length) of N (contiguous copy); block-aligned for fp8_block."""
        return self._narrow(1, start, length)

    def narrow_cols(self, start: int, length: int) -> "QWeight":
        """Columns [start, start+length) of K (contiguous copy); aligned to the scale group."""
        return self._narrow(2, start, length)

    def to(self, device) -> "QWeight":
        scale = None if self.scale is None else self.scale.to(device)
        return QWeight(self.data.to(device), scale, self.recipe, self.scale_fmt)


def quantize_weight(w: torch.Tensor, quant: QuantConfig) -> QWeight:
    """Quantize expert weights w [E, N, K] per the module rules.

    fp8_block with scale_fmt ue8m0_fp32 or ue8m0_packed stores power-of-two fp32 block scales
    with scale_fmt "ue8m0_fp32" (a kernel wrapper packs them with pack_ue8m0 in the per-row
    layout its kernel reads).
    """
    _check_float(w, "weight")
    if w.dim() != 3:
        raise ValueError(f"weights must be [E, N, K], got shape {tuple(w.shape)}; add the "
                         f"expert dim (unsqueeze(0)) for a single matrix")
    recipe = quant.recipe
    if recipe == "bf16":
        return QWeight(w.to(torch.bfloat16), None, recipe, "fp32")
    e, n, k = w.shape
    wf = w.float()
    if recipe == "fp8_block":
        _check_multiple("weight K (input dim)", k, BLOCK, recipe,
                        "pick recipe bf16 or dims that are multiples of 128")
        _check_multiple("weight rows N", n, BLOCK, recipe,
                        "pick recipe bf16 or dims that are multiples of 128 (lower tp)")
        wb = wf.reshape(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        scale = _div(_amax(wb, (2, 4)), FP8_MAX)
        fmt = "fp32"
        if quant.scale_fmt != "fp32":
            scale, fmt = round_scale_pow2(scale), "ue8m0_fp32"
        data = (wb / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return QWeight(data.reshape(e, n, k), scale, recipe, fmt)
    _check_multiple("weight K (input dim)", k, MX_GROUP, recipe,
                    f"pick recipe bf16 or dims that are multiples of {MX_GROUP}")
    wg = wf.reshape(e, n, k // MX_GROUP, MX_GROUP)
    qmax = FP8_MAX if recipe == "mxfp8" else E2M1_MAX
    scale = round_scale_pow2(_div(_amax(wg, -1), qmax))
    scaled = wg / scale.unsqueeze(-1)
    e8 = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    if recipe == "mxfp8":
        data = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(e, n, k)
    else:
        data = e2m1_pack(e2m1_encode(scaled).reshape(e, n, k))
    return QWeight(data, e8, recipe, "fp32")


def dequantize_weight(qw: QWeight) -> torch.Tensor:
    """fp32 [E, N, K]."""
    e, n, k = qw.shape
    if qw.recipe == "bf16":
        return qw.data.float()
    if qw.recipe == "fp8_block":
        wb = qw.data.float().reshape(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        return (wb * qw.scale.float()[:, :, None, :, None]).reshape(e, n, k)
    vals = qw.data.float() if qw.recipe == "mxfp8" else e2m1_decode(e2m1_unpack(qw.data))
    wg = vals.reshape(e, n, k // MX_GROUP, MX_GROUP)
    return (wg * e8m0_to_fp32(qw.scale).unsqueeze(-1)).reshape(e, n, k)


def requant_weight_ue8m0(qw: QWeight) -> QWeight:
    """fp8_block weights -> power-of-two block scales (rounded UP, so nothing clips) with the
    data re-quantized: data_new = fp8(dequant / new_scale). Result scale_fmt "ue8m0_fp32"."""
    if qw.recipe != "fp8_block":
        raise ValueError(f"requant_weight_ue8m0 applies to fp8_block weights, got recipe "
                         f"{qw.recipe!r}; mx recipes already have e8m0 scales")
    e, n, k = qw.shape
    scale = round_scale_pow2(qw.scale)
    wb = dequantize_weight(qw).reshape(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    data = (wb / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return QWeight(data.reshape(e, n, k), scale, "fp8_block", "ue8m0_fp32")
