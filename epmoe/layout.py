"""Expert layouts: how (token, k) pairs become rows of the grouped GEMMs, and back.

Contiguous (high throughput): rows grouped by local expert, each group padded to `alignment`
rows, `row_expert_M` the expert of each row (-1 on padding), `inv_perm_NK` the row of each
(token, slot) (-1 where the slot is empty or not on this rank). Masked (low latency):
`[E, C, D]` with per-expert counts.

These are the plain-torch implementations (the semantics); `epmoe.kernels` has Triton
versions that must produce the same layouts (row order within a group may differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.quant import QTensor


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _check_ids(topk_ids_NK: torch.Tensor, num_experts: int) -> None:
    if topk_ids_NK.dim() != 2 or topk_ids_NK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be a 2-D int32/int64 tensor [N, K], got "
                         f"{tuple(topk_ids_NK.shape)} {topk_ids_NK.dtype}")
    if topk_ids_NK.numel() and (int(topk_ids_NK.max()) >= num_experts
                                or int(topk_ids_NK.min()) < -1):
        raise ValueError(f"topk_ids must lie in [-1, {num_experts}) (-1 = empty slot), got "
                         f"[{int(topk_ids_NK.min())}, {int(topk_ids_NK.max())}]")


@dataclass(frozen=True)
class ContiguousLayout:
    """Rows of the contiguous grouped GEMM.

    row_expert_M   int32 [M]     local expert of each row; -1 on padding rows (DeepGEMM m_indices)
    inv_perm_NK    int32 [N, K]  row holding (token n, slot k); -1 for empty / non-local slots
    counts_E       int32 [E]     valid rows per local expert
    offsets_E1     int32 [E+1]   first row of each expert's group; groups are `alignment`-aligned
    alignment      rows per group boundary (the GEMM's M block)
    """

    row_expert_M: torch.Tensor
    inv_perm_NK: torch.Tensor
    counts_E: torch.Tensor
    offsets_E1: torch.Tensor
    alignment: int

    @property
    def num_rows(self) -> int:
        return self.row_expert_M.shape[0]

    @property
    def num_experts(self) -> int:
        return self.counts_E.shape[0]


def contiguous_rows_upper_bound(num_pairs: int, num_experts: int, alignment: int) -> int:
    """Worst-case M for `num_pairs` (token, k) pairs: no host sync needed (CUDA-graph safe)."""
    return align_up(num_pairs + num_experts * (alignment - 1), alignment)


def make_contiguous_layout(topk_ids_NK: torch.Tensor, num_experts: int, alignment: int = 128,
                           num_rows: int | None = None) -> ContiguousLayout:
    """Group (token, k) pairs by local expert id (ids in [0, E) or -1), token order within a group.

    num_rows: total rows M to allocate; None = exact (sum of aligned counts, syncs the host),
    else at least that (e.g. `contiguous_rows_upper_bound`), extra rows are padding (-1).
    """
    _check_ids(topk_ids_NK, num_experts)
    if alignment < 1:
        raise ValueError(f"alignment ({alignment}) must be >= 1")
    dev = topk_ids_NK.device
    n, k = topk_ids_NK.shape
    ids = topk_ids_NK.reshape(-1).long()
    valid = ids >= 0
    counts = torch.bincount(ids[valid], minlength=num_experts)
    aligned = (counts + alignment - 1) // alignment * alignment
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    offsets[1:] = torch.cumsum(aligned, 0)
    exact = int(offsets[-1])
    if num_rows is None:
        num_rows = exact
    elif num_rows < exact:
        raise ValueError(f"num_rows ({num_rows}) is below the {exact} rows this routing needs; "
                         f"use contiguous_rows_upper_bound() or None (exact)")
    # Stable sort keeps token order inside each expert's group.
    key = torch.where(valid, ids, torch.full_like(ids, num_experts))
    order = torch.argsort(key, stable=True)
    sorted_ids = key[order]
    num_valid = int(valid.sum())
    pair_idx = order[:num_valid]
    e_of = sorted_ids[:num_valid]
    # rank of each pair within its expert group
    first_of_e = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    first_of_e[1:] = torch.cumsum(counts, 0)
    within = torch.arange(num_valid, device=dev) - first_of_e[e_of]
    rows = offsets[e_of] + within
    inv = torch.full((n * k,), -1, dtype=torch.int32, device=dev)
    inv[pair_idx] = rows.to(torch.int32)
    row_expert = torch.full((num_rows,), -1, dtype=torch.int32, device=dev)
    row_expert[rows] = e_of.to(torch.int32)
    return ContiguousLayout(row_expert_M=row_expert, inv_perm_NK=inv.view(n, k),
                            counts_E=counts.to(torch.int32), offsets_E1=offsets.to(torch.int32),
                            alignment=alignment)


def permute_rows(x_ND: torch.Tensor, layout: ContiguousLayout) -> torch.Tensor:
    """Copy token rows into the contiguous layout; padding rows are zero. x_ND [N, ...]."""
    n, k = layout.inv_perm_NK.shape
    out = torch.zeros((layout.num_rows, *x_ND.shape[1:]), dtype=x_ND.dtype, device=x_ND.device)
    if x_ND.dtype.itemsize == 1 and x_ND.is_floating_point():  # fp8: index_copy via uint8 view
        out.view(torch.uint8).copy_(permute_rows(x_ND.view(torch.uint8), layout))
        return out
    inv = layout.inv_perm_NK.reshape(-1).long()
    valid = inv >= 0
    tok = torch.arange(n, device=x_ND.device).repeat_interleave(k)
    out[inv[valid]] = x_ND[tok[valid]]
    return out


def permute_qtensor(x: QTensor, layout: ContiguousLayout) -> QTensor:
    """Permute quantized rows together with their scales (any scale format with rows first)."""
    if x.scale is not None and x.scale_fmt == "ue8m0_packed":
        raise ValueError("permute packed UE8M0 scales via epmoe.kernels (MN-major layout); "
                         "quantize after permute or keep scale_fmt ue8m0_fp32 on the wire")
    scale = None if x.scale is None else permute_rows(x.scale, layout)
    return QTensor(permute_rows(x.data, layout), scale, x.recipe, x.group, x.scale_fmt)


def unpermute_reduce(y_MD: torch.Tensor, layout: ContiguousLayout,
                     topk_weights_NK: torch.Tensor | None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """out[n] = sum_k w[n,k] * y[inv_perm[n,k]] over valid slots, fp32 accumulate, one cast.

    topk_weights_NK None: weights already applied (apply_router_weight_on_input), plain sum.
    """
    return _gather_weighted_sum(y_MD, layout.inv_perm_NK, topk_weights_NK, out_dtype)


def _gather_weighted_sum(y_RD: torch.Tensor, idx_NK: torch.Tensor,
                         topk_weights_NK: torch.Tensor | None,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """out[n] = sum_k w[n,k] * y[idx[n,k]] over idx >= 0. Skipped slots contribute exactly 0,
    even when the row they would clamp to holds garbage (padding / rows past a count may be
    NaN), and y may have no rows at all (every slot skipped)."""
    n, k = idx_NK.shape
    d = y_RD.shape[-1]
    if y_RD.shape[0] == 0:
        return torch.zeros((n, d), dtype=out_dtype, device=y_RD.device)
    idx = idx_NK.long()
    valid = idx >= 0
    rows = y_RD[idx.clamp(min=0).reshape(-1)].float().view(n, k, d)
    rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros((), device=rows.device))
    w = valid.float() if topk_weights_NK is None else \
        torch.where(valid, topk_weights_NK.float(), torch.zeros((), device=valid.device))
    return torch.einsum("nkd,nk->nd", rows, w).to(out_dtype)


@dataclass(frozen=True)
class MaskedLayout:
    """Rows of the masked (batched) grouped GEMM: [E, C, D] with per-expert counts.

    slot_NK   int32 [N, K]  flat index e*C + c of (token n, slot k); -1 for empty / non-local
    counts_E  int32 [E]     valid rows per expert (rows past the count are garbage)
    capacity  C
    """

    slot_NK: torch.Tensor
    counts_E: torch.Tensor
    capacity: int

    @property
    def num_experts(self) -> int:
        return self.counts_E.shape[0]


def make_masked_layout(topk_ids_NK: torch.Tensor, num_experts: int,
                       capacity: int) -> MaskedLayout:
    """Token order within each expert. More than `capacity` tokens on one expert is an error
    (never a silent drop): raise the capacity (max tokens per rank) to fix it."""
    _check_ids(topk_ids_NK, num_experts)
    lay = make_contiguous_layout(topk_ids_NK, num_experts, alignment=1)
    worst = int(lay.counts_E.max()) if num_experts else 0
    if worst > capacity:
        raise ValueError(f"expert {int(lay.counts_E.argmax())} received {worst} tokens, over "
                         f"the masked layout's capacity ({capacity}); raise the capacity "
                         f"(max tokens per rank x ranks) to at least {worst}")
    inv = lay.inv_perm_NK.long()
    e = topk_ids_NK.long()  # (not row_expert_M[inv]: it has no rows when every slot is -1)
    within = inv - lay.offsets_E1.long()[e.clamp(min=0)]
    slot = torch.where(inv >= 0, e * capacity + within, torch.full_like(inv, -1))
    return MaskedLayout(slot_NK=slot.to(torch.int32), counts_E=lay.counts_E, capacity=capacity)


def scatter_masked(x_ND: torch.Tensor, layout: MaskedLayout) -> torch.Tensor:
    """x [N, ...] -> [E, C, ...]; rows past each expert's count are zero."""
    n, k = layout.slot_NK.shape
    e, c = layout.num_experts, layout.capacity
    if x_ND.dtype.itemsize == 1 and x_ND.is_floating_point():
        return scatter_masked(x_ND.view(torch.uint8), layout).view(x_ND.dtype)
    out = torch.zeros((e * c, *x_ND.shape[1:]), dtype=x_ND.dtype, device=x_ND.device)
    slot = layout.slot_NK.reshape(-1).long()
    valid = slot >= 0
    tok = torch.arange(n, device=x_ND.device).repeat_interleave(k)
    out[slot[valid]] = x_ND[tok[valid]]
    return out.view(e, c, *x_ND.shape[1:])


def gather_masked_reduce(y_ECD: torch.Tensor, layout: MaskedLayout,
                         topk_weights_NK: torch.Tensor | None,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """out[n] = sum_k w[n,k] * y[slot[n,k]], fp32 accumulate, one cast."""
    flat = y_ECD.reshape(-1, y_ECD.shape[-1])
    return _gather_weighted_sum(flat, layout.slot_NK, topk_weights_NK, out_dtype)
