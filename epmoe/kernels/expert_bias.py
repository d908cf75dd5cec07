"""Add each row's expert bias to a grouped GEMM's bf16 output, in place (gpt-oss's down bias).

y [M, N] (a contiguous layout's rows, or a masked layout's [E, C, N] viewed as [E*C, N]) and
bias [E, N] fp32: y[m] = bf16(y[m] + bias[expert(m)]), the sum in fp32. The rows come from a
`ValidRows` as for the fused activation: a contiguous layout's row_expert_M (padding rows,
-1, untouched) or a masked layout's counts (rows past a count untouched); every row reads
expert 0 when none is given. One pass over the valid rows; a block with none returns at once.
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET, check, check_tensor, round_bf16

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.kernels.act_quant import _ALL_ROWS, ValidRows, valid_rows  # noqa: E402

_BLOCK_M = 16


@triton.jit
def _add_bias_kernel(y_ptr, b_ptr, valid_ptr, cap, M, N, stride_y, stride_b,
                     VALID: tl.constexpr, PRE_ROUND: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mm, expert = valid_rows(valid_ptr, offs_m, M, cap, VALID)
    if tl.max(mm.to(tl.int32), axis=0) > 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m2 = mm[:, None] & (offs_n < N)[None, :]
        yp = y_ptr + offs_m.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
        bp = b_ptr + expert.to(tl.int64)[:, None] * stride_b + offs_n[None, :]
        v = tl.load(yp, mask=m2, other=0.0).to(tl.float32) + tl.load(bp, mask=m2, other=0.0)
        if PRE_ROUND:  # the interpreter's fp32 -> bf16 cast truncates
            v = round_bf16(v)
        tl.store(yp, v.to(y_ptr.dtype.element_ty), mask=m2)


def triton_add_expert_bias_(y: torch.Tensor, bias_EN: torch.Tensor,
                            rows: ValidRows | None = None) -> torch.Tensor:
    """y [M, N] or [E, C, N] bf16 (contiguous rows) += bias of each valid row's expert; returns
    y. rows: as for `triton_act_quant` (required when bias_EN holds more than one expert)."""
    check_tensor("y", y, (torch.bfloat16,), contiguous=False)
    check_tensor("bias_EN", bias_EN, (torch.float32,), dim=2)
    check(y.dim() in (2, 3) and y.stride(-1) == 1 and y.is_contiguous(),
          f"y must be a contiguous [M, N] or [E, C, N] tensor, got {tuple(y.shape)}")
    n = y.shape[-1]
    y2 = y.view(-1, n)
    rows = rows or ValidRows()
    rows.check(y2.shape[0])
    check(bias_EN.shape[1] == n, f"bias_EN has {bias_EN.shape[1]} columns, y has {n}")
    check(rows.mode != _ALL_ROWS or bias_EN.shape[0] == 1,
          f"bias_EN holds {bias_EN.shape[0]} experts: pass rows so each row finds its expert")
    if y2.shape[0] == 0 or n == 0:
        return y
    block_n = min(triton.next_power_of_2(n), 1024 if INTERPRET else 256)
    grid = (triton.cdiv(y2.shape[0], _BLOCK_M), triton.cdiv(n, block_n))
    valid = rows.tensor if rows.tensor is not None else y2
    _add_bias_kernel[grid](y2, bias_EN, valid, rows.capacity, y2.shape[0], n, y2.stride(0),
                           bias_EN.stride(0), VALID=rows.mode, PRE_ROUND=INTERPRET,
                           BLOCK_M=_BLOCK_M, BLOCK_N=block_n, num_warps=4)
    return y


__all__ = ["triton_add_expert_bias_"]
