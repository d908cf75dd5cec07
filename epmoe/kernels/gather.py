"""ep_gather: expert output rows -> tokens, weighted sum over the top-k slots.

out[n] = sum_k w[n, k] * y[row[n, k]] over slots with row >= 0, fp32 accumulation, one cast to
bf16. One kernel serves both layouts: the contiguous layout's inv_perm_NK indexes rows of y [M, D],
the masked layout's slot_NK indexes rows of y [E, C, D] viewed as [E*C, D].
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET, check, check_tensor, next_pow2, round_bf16

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.layout import ContiguousLayout, MaskedLayout  # noqa: E402


@triton.jit
def _gather_reduce_kernel(y_ptr, rows_ptr, w_ptr, out_ptr, N, K, D, stride_y, stride_out,
                          HAS_W: tl.constexpr, PRE_ROUND: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """PRE_ROUND: the sum rounded to the nearest bf16 before the cast (the interpreter's cast
    truncates; the GPU's rounds to nearest)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tm = offs_t < N
    dm = offs_d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in range(0, K):
        row = tl.load(rows_ptr + offs_t * K + k, mask=tm, other=-1)
        valid = tm & (row >= 0)
        v = tl.load(y_ptr + row.to(tl.int64)[:, None] * stride_y + offs_d[None, :],
                    mask=valid[:, None] & dm[None, :], other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + offs_t * K + k, mask=valid, other=0.0).to(tl.float32)
            v = v * w[:, None]
        acc += v
    if PRE_ROUND:
        acc = round_bf16(acc)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_out + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=tm[:, None] & dm[None, :])


def _gather_reduce(y_RD: torch.Tensor, rows_NK: torch.Tensor, w_NK: torch.Tensor | None,
                   out_dtype: torch.dtype, what: str) -> torch.Tensor:
    check_tensor(f"{what} y", y_RD, (torch.bfloat16, torch.float16, torch.float32), dim=2)
    check_tensor(f"{what} row index", rows_NK, (torch.int32,), dim=2)
    n, k = rows_NK.shape
    if w_NK is not None:
        check_tensor("topk_weights_NK", w_NK, (torch.float32, torch.bfloat16, torch.float16),
                     dim=2)
        check(tuple(w_NK.shape) == (n, k), f"topk_weights_NK shape {tuple(w_NK.shape)} must "
              f"match the layout's [N, K] = {(n, k)}")
    d = y_RD.shape[1]
    out = torch.empty((n, d), dtype=out_dtype, device=y_RD.device)
    if n == 0 or d == 0:
        return out
    block_t = 64 if INTERPRET else 4
    block_d = min(next_pow2(d), 4096 if INTERPRET else 1024)
    grid = (triton.cdiv(n, block_t), triton.cdiv(d, block_d))
    _gather_reduce_kernel[grid](y_RD, rows_NK, w_NK if w_NK is not None else y_RD, out, n, k, d,
                                y_RD.stride(0), out.stride(0), HAS_W=w_NK is not None,
                                PRE_ROUND=INTERPRET and out_dtype == torch.bfloat16,
                                BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    return out


def triton_unpermute_reduce(y_MD: torch.Tensor, layout: ContiguousLayout,
                            topk_weights_NK: torch.Tensor | None,
                            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y [M, D] rows of `layout` -> out [N, D]; topk_weights_NK None = plain sum (weights
    already applied on the input). Padding rows of y are never read."""
    check(y_MD.dim() == 2 and y_MD.shape[0] == layout.num_rows,
          f"y_MD shape {tuple(y_MD.shape)} must be [M, D] with M = layout.num_rows "
          f"({layout.num_rows})")
    return _gather_reduce(y_MD, layout.inv_perm_NK, topk_weights_NK, out_dtype, "contiguous")


def triton_gather_masked_reduce(y_ECD: torch.Tensor, layout: MaskedLayout,
                                topk_weights_NK: torch.Tensor | None,
                                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y [E, C, D] of the masked layout -> out [N, D] (rows past each count never read)."""
    check(y_ECD.dim() == 3 and tuple(y_ECD.shape[:2]) == (layout.num_experts, layout.capacity),
          f"y_ECD shape {tuple(y_ECD.shape)} must be [E, C, D] with E = {layout.num_experts}, "
          f"C = {layout.capacity}")
    check(y_ECD.is_contiguous(), f"y_ECD (stride {y_ECD.stride()}) must be contiguous; call "
          f".contiguous() first")
    return _gather_reduce(y_ECD.view(-1, y_ECD.shape[2]), layout.slot_NK, topk_weights_NK,
                          out_dtype, "masked")


__all__ = ["triton_unpermute_reduce", "triton_gather_masked_reduce"]
