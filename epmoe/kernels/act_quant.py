"""Fused SwiGLU activation + per-token-group quantization (the step between the two GEMMs).

a = act(h[:, :I], h[:, I:]) exactly as `epmoe.experts.base.activation` (swiglu with optional
clamp, swigluoai with alpha / limit), then per row and per `group` columns the rules of
`epmoe.quant`: amax clamped to >= 1e-10, scale = amax / 448 (fp32) or rounded up to a power of
two (ue8m0 formats, mxfp8), data = fp8(clamp(a / scale, -448, 448)). Scale outputs:

  fp32 row-major [M, G]                     fp8_block / w4a8_mxfp4, scale_fmt fp32 / ue8m0_fp32
  fp32 MN-major [M, G], strides (1, align(M, 4))   mn_major=True (DeepGEMM SM90's TMA layout)
  int32 packed UE8M0 [M, ceil(G/4)], MN-major      scale_fmt ue8m0_packed (DeepGEMM SM100)
  uint8 e8m0 [M, D/32]                      mxfp8

Expert biases (gpt-oss): `bias_EF` [E, 2I] fp32 is added to h in fp32 before the activation,
each row reading its expert's row (from `rows`).

`rows` (a `ValidRows`) names the rows that hold data: a contiguous layout's `row_expert_M` (-1 on
padding rows) or a masked layout's per-expert counts. The kernel neither reads nor writes the
other rows (their outputs stay as allocated; the GEMMs after skip them, as they skipped them in
h), and a block of rows with none valid returns at once: over the worst-case layouts that the
no-sync paths allocate, most rows are padding at decode sizes.

Under the CPU interpreter the kernel pre-rounds in fp32 (its fp8 / bf16 casts round wrongly), so
codes match the torch quantizer there as on GPU, save where the activation's last bit differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.kernels._common import (INTERPRET, check, check_tensor, empty_mn_major,
                                   fp8_scale, next_pow2, round_bf16, round_e4m3)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.config import MoEConfig, QuantConfig  # noqa: E402
from epmoe.kernels.quantize import quantize_tokens  # noqa: E402
from epmoe.quant import AMAX_MIN, FP8_DTYPE, FP8_MAX, QTensor  # noqa: E402

# QUANT modes of the kernel
_BF16, _FP32, _POW2, _E8M0, _PACKED = 0, 1, 2, 3, 4
# ACT modes
_SWIGLU, _SWIGLUOAI = 1, 2
BLOCK_M_GPU = 16  # rows per program on the GPU (the cost model's ACT_BLOCK_ROWS)
# VALID modes: every row, a contiguous layout's row_expert_M >= 0, a masked layout's counts
_ALL_ROWS, _ROW_EXPERT, _COUNTS = 0, 1, 2


@dataclass(frozen=True)
class ValidRows:
    """Which rows of the GEMM1 output hold data; `triton_act_quant` skips the others."""

    row_expert_M: torch.Tensor | None = None  # contiguous [M]: -1 on padding rows
    counts_E: torch.Tensor | None = None  # masked [E, C] flattened: row r of expert e if r < count
    capacity: int = 0

    @classmethod
    def contiguous(cls, row_expert_M: torch.Tensor) -> "ValidRows":
        return cls(row_expert_M=row_expert_M)

    @classmethod
    def masked(cls, counts_E: torch.Tensor, capacity: int) -> "ValidRows":
        return cls(counts_E=counts_E, capacity=capacity)

    def check(self, m: int) -> None:
        if self.row_expert_M is not None:
            check_tensor("row_expert_M", self.row_expert_M, (torch.int32,), dim=1)
            check(self.row_expert_M.shape[0] == m,
                  f"row_expert_M has {self.row_expert_M.shape[0]} rows, h has {m}")
        elif self.counts_E is not None:
            check_tensor("counts_E", self.counts_E, (torch.int32,), dim=1)
            check(self.capacity > 0 and self.counts_E.shape[0] * self.capacity == m,
                  f"masked rows: {self.counts_E.shape[0]} experts x capacity {self.capacity} "
                  f"!= h's {m} rows")

    @property
    def mode(self) -> int:
        if self.row_expert_M is not None:
            return _ROW_EXPERT
        return _COUNTS if self.counts_E is not None else _ALL_ROWS

    @property
    def tensor(self) -> torch.Tensor | None:
        """What the kernel reads per row (mode 1) or per expert (mode 2); None for every row."""
        return self.row_expert_M if self.row_expert_M is not None else self.counts_E


@triton.jit
def valid_rows(valid_ptr, offs_m, M, cap, VALID: tl.constexpr):
    """(mask, expert) of rows offs_m under a `ValidRows` mode (VALID 0 / 1 / 2): the rows that
    hold data, and each one's expert (its bias row; 0 when every row is valid)."""
    mm = offs_m < M
    expert = tl.zeros_like(offs_m)
    if VALID == 1:
        ev = tl.load(valid_ptr + offs_m, mask=mm, other=-1)
        mm = mm & (ev >= 0)
        expert = tl.maximum(ev, 0)
    elif VALID == 2:
        expert = offs_m // cap
        mm = mm & ((offs_m % cap) < tl.load(valid_ptr + expert, mask=mm, other=0))
    return mm, expert


@triton.jit
def _act_quant_kernel(h_ptr, q_ptr, s_ptr, valid_ptr, b_ptr, cap, M, I, stride_h, stride_q,
                      s_stride_m, s_stride_g, stride_b, limit, alpha, amax_min, fp8_max,
                      ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, QUANT: tl.constexpr,
                      PRE_ROUND: tl.constexpr, VALID: tl.constexpr, HAS_BIAS: tl.constexpr,
                      GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mm, expert = valid_rows(valid_ptr, offs_m, M, cap, VALID)
    if tl.max(mm.to(tl.int32), axis=0) > 0:  # else every row here is padding
        _act_quant_rows(h_ptr, q_ptr, s_ptr, b_ptr + expert.to(tl.int64) * stride_b, offs_m, mm,
                        I, stride_h, stride_q, s_stride_m, s_stride_g, limit, alpha, amax_min,
                        fp8_max, ACT, HAS_LIMIT, QUANT, PRE_ROUND, HAS_BIAS, GROUP,
                        GROUPS_PER_PROG)


@triton.jit
def _act_quant_rows(h_ptr, q_ptr, s_ptr, b_rows, offs_m, mm, I, stride_h, stride_q, s_stride_m,
                    s_stride_g, limit, alpha, amax_min, fp8_max,
                    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, QUANT: tl.constexpr,
                    PRE_ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr,
                    GROUPS_PER_PROG: tl.constexpr):
    pid_g = tl.program_id(1)
    rows_h = h_ptr + offs_m.to(tl.int64)[:, None] * stride_h
    rows_q = q_ptr + offs_m.to(tl.int64)[:, None] * stride_q
    num_groups = tl.cdiv(I, GROUP)
    word = tl.zeros_like(offs_m)
    for j in tl.static_range(GROUPS_PER_PROG):
        g = pid_g * GROUPS_PER_PROG + j
        offs_c = g * GROUP + tl.arange(0, GROUP)
        m2 = mm[:, None] & (offs_c < I)[None, :]
        a = tl.load(rows_h + offs_c[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_BIAS:  # fp32 bias of the row's expert, added to GEMM1's bf16 output
            a += tl.load(b_rows[:, None] + offs_c[None, :], mask=m2, other=0.0)
        if ACT != 0:
            up = tl.load(rows_h + I + offs_c[None, :], mask=m2, other=0.0).to(tl.float32)
            if HAS_BIAS:
                up += tl.load(b_rows[:, None] + I + offs_c[None, :], mask=m2, other=0.0)
            if HAS_LIMIT:
                a = tl.minimum(a, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
            if ACT == 1:
                a = a * tl.sigmoid(a) * up
            else:
                a = a * tl.sigmoid(alpha * a) * (up + 1.0)
        if QUANT == 0:
            if PRE_ROUND:
                a = round_bf16(a)
            tl.store(rows_q + offs_c[None, :], a.to(q_ptr.dtype.element_ty), mask=m2)
        else:
            amax = tl.maximum(tl.max(tl.abs(a), axis=1), amax_min)
            s, e8 = fp8_scale(amax, fp8_max, QUANT >= 2)
            q = tl.math.div_rn(a, s[:, None])
            q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
            if PRE_ROUND:
                q = round_e4m3(q)
            tl.store(rows_q + offs_c[None, :], q.to(q_ptr.dtype.element_ty), mask=m2)
            gm = mm & (g < num_groups)
            s_at = s_ptr + offs_m.to(tl.int64) * s_stride_m
            if QUANT <= 2:
                tl.store(s_at + g * s_stride_g, s, mask=gm)
            elif QUANT == 3:
                tl.store(s_at + g * s_stride_g, e8.to(tl.uint8), mask=gm)
            else:
                word = word | tl.where(g < num_groups, e8 << (8 * j), 0)
    if QUANT == 4:
        tl.store(s_ptr + offs_m.to(tl.int64) * s_stride_m + pid_g * s_stride_g, word, mask=mm)


def _launch(h: torch.Tensor, cols: int, act: int, limit, alpha: float, quant_mode: int,
            group: int, mn_major: bool, rows: ValidRows,
            bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    m = h.shape[0]
    dev = h.device
    if quant_mode == _BF16:
        q = torch.empty((m, cols), dtype=torch.bfloat16, device=dev)
        s = None
        group = min(next_pow2(max(cols, 1)), 1024 if INTERPRET else 256)
        gpp = 1
    else:
        q = torch.empty((m, cols), dtype=FP8_DTYPE, device=dev)
        g = cols // group
        if quant_mode == _PACKED:
            s, gpp = empty_mn_major(m, triton.cdiv(g, 4), torch.int32, dev), 4
        else:
            sdt = torch.uint8 if quant_mode == _E8M0 else torch.float32
            s = (empty_mn_major(m, g, sdt, dev) if mn_major
                 else torch.empty((m, g), dtype=sdt, device=dev))
            gpp = min(4, g) if INTERPRET else 1
    if m == 0 or cols == 0:
        return q, s
    block_m = 64 if INTERPRET else BLOCK_M_GPU
    num_col_blocks = triton.cdiv(cols, group)
    grid = (triton.cdiv(m, block_m), triton.cdiv(num_col_blocks, gpp))
    valid = rows.tensor if rows.tensor is not None else h  # (mode 0 never reads it)
    _act_quant_kernel[grid](
        h, q, s if s is not None else q, valid, bias if bias is not None else h, rows.capacity,
        m, cols, h.stride(0), q.stride(0),
        s.stride(0) if s is not None else 0, s.stride(1) if s is not None else 0,
        bias.stride(0) if bias is not None else 0,
        float(limit) if limit is not None else 0.0, float(alpha), AMAX_MIN, FP8_MAX,
        ACT=act, HAS_LIMIT=limit is not None, QUANT=quant_mode, PRE_ROUND=INTERPRET,
        VALID=rows.mode, HAS_BIAS=bias is not None, GROUP=group, GROUPS_PER_PROG=gpp,
        BLOCK_M=block_m, num_warps=4)
    return q, s


def _quant_mode(recipe: str, scale_fmt: str) -> int:
    if recipe == "bf16":
        return _BF16
    if recipe == "mxfp8":
        return _E8M0
    return {"fp32": _FP32, "ue8m0_fp32": _POW2, "ue8m0_packed": _PACKED}[scale_fmt]


def triton_act_quant(h_MF: torch.Tensor, cfg: MoEConfig, quant: QuantConfig,
                     mn_major: bool = False, rows: ValidRows | None = None,
                     bias_EF: torch.Tensor | None = None) -> QTensor:
    """GEMM1 output h [M, 2I] (bf16/fp32; [0, I) gate, [I, 2I) up) -> quantized a [M, I] in the
    recipe's activation format (bf16 recipe: bf16 data, no scale). mn_major: fp32 / e8m0 scales
    in the TMA-aligned column-major layout (packed UE8M0 is always MN-major). rows: the rows
    that hold data (default all); the others of a and its scales are left unwritten.
    bias_EF: fp32 [E, 2I] expert biases added to h before the activation, the row's expert
    read from `rows` (a contiguous layout's row_expert_M, a masked row's expert); with every
    row valid, E must be 1."""
    check_tensor("h_MF", h_MF, (torch.bfloat16, torch.float16, torch.float32), dim=2,
                 contiguous=False)
    check(h_MF.stride(1) == 1, f"h_MF rows must be contiguous (stride {h_MF.stride()}); call "
          f".contiguous() first")
    f = h_MF.shape[1]
    check(f % 2 == 0, f"h_MF columns ({f}) must be even: [gate | up] halves of 2I")
    i = f // 2
    group = quant.act_group
    check(group == 0 or i % group == 0,
          f"intermediate ({i}) must be a multiple of {quant.recipe}'s activation group "
          f"({group}); pick recipe bf16 or lower tp")
    rows = rows or ValidRows()
    rows.check(h_MF.shape[0])
    if bias_EF is not None:
        check_tensor("bias_EF", bias_EF, (torch.float32,), dim=2)
        check(bias_EF.shape[1] == f, f"bias_EF has {bias_EF.shape[1]} columns, h has {f}")
        check(rows.mode != _ALL_ROWS or bias_EF.shape[0] == 1,
              f"bias_EF holds {bias_EF.shape[0]} experts: pass rows (a layout's row experts "
              f"or a masked layout's counts) so each row finds its expert")
        if rows.mode == _COUNTS:
            check(bias_EF.shape[0] == rows.counts_E.shape[0],
                  f"bias_EF holds {bias_EF.shape[0]} experts, the masked layout "
                  f"{rows.counts_E.shape[0]}")
    act = _SWIGLU if cfg.activation == "swiglu" else _SWIGLUOAI
    mode = _quant_mode(quant.recipe, quant.scale_fmt)
    q, s = _launch(h_MF, i, act, cfg.swiglu_limit, cfg.activation_alpha, mode, group, mn_major,
                   rows, bias_EF)
    return QTensor(q, s, quant.recipe, group, quant.scale_fmt)


def per_token_group_quant(x: torch.Tensor, group: int = 128, scale_fmt: str = "fp32",
                          mn_major: bool = False, recipe: str | None = None) -> QTensor:
    """x [M, D] -> fp8 per 1 x group: group 128 (fp8_block / w4a8_mxfp4 activations; scale_fmt
    fp32, ue8m0_fp32 or ue8m0_packed) or 32 (mxfp8, e8m0 uint8 scales). The Triton kernel of
    `epmoe.kernels.quantize` (also under the interpreter); see `quantize_tokens`."""
    check(group in (32, 128), f"group ({group}) must be 128 (fp8 block) or 32 (mxfp8)")
    recipe = recipe or ("fp8_block" if group == 128 else "mxfp8")
    check(recipe in ("fp8_block", "w4a8_mxfp4") if group == 128 else recipe == "mxfp8",
          f"recipe ({recipe!r}) does not quantize activations per {group} columns; group 128 "
          f"is fp8_block / w4a8_mxfp4, 32 is mxfp8")
    check(group == 128 or scale_fmt == "fp32",
          f"scale_fmt ({scale_fmt!r}) applies to group 128; mxfp8 scales are e8m0 bytes: "
          f"leave scale_fmt='fp32'")
    check(scale_fmt in ("fp32", "ue8m0_fp32", "ue8m0_packed"),
          f"scale_fmt ({scale_fmt!r}) must be fp32, ue8m0_fp32 or ue8m0_packed")
    check(recipe == "fp8_block" or scale_fmt == "fp32",
          f"scale_fmt ({scale_fmt!r}) applies to fp8_block only")
    return quantize_tokens(x, QuantConfig(recipe, scale_fmt), mn_major=mn_major,
                           backend="triton")


__all__ = ["ValidRows", "triton_act_quant", "per_token_group_quant"]
