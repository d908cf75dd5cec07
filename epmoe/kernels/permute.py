"""ep_scatter: (token, k) pairs -> rows of the contiguous layout, token rows and scales copied.

Two phases: (a) count pairs per local expert (atomics) and prefix-sum the aligned counts
(torch.cumsum, no host sync); (b) each pair takes a row of its expert's group with an atomic
cursor and copies its token's row and scale row there. Row order inside a group follows the
atomics (not token order as in `epmoe.layout`); padding rows have row_expert -1 and unspecified
data. The output is sized exactly (one host sync) or by `num_rows` (no sync, CUDA-graph safe).
"""

from __future__ import annotations

from epmoe.kernels._common import (INTERPRET, as_bits, check, check_tensor,
                                   empty_mn_major, is_mn_major, next_pow2)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.layout import ContiguousLayout, contiguous_rows_upper_bound  # noqa: E402
from epmoe.quant import QTensor  # noqa: E402

_IDS_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _count_kernel(ids_ptr, map_ptr, counts_ptr, num_pairs,
                  HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pm = offs < num_pairs
    e = tl.load(ids_ptr + offs, mask=pm, other=-1).to(tl.int32)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=pm & (e >= 0), other=-1)
    tl.atomic_add(counts_ptr + e, 1, mask=pm & (e >= 0))


def _check_routing(topk_ids_NK, num_experts, alignment, expert_map):
    check_tensor("topk_ids_NK", topk_ids_NK, _IDS_DTYPES, dim=2)
    check(isinstance(num_experts, int) and num_experts >= 1,
          f"num_experts ({num_experts!r}) must be a positive int (local experts on this rank)")
    check(isinstance(alignment, int) and alignment >= 1,
          f"alignment ({alignment!r}) must be a positive int (rows per group boundary)")
    if expert_map is not None:
        check_tensor("expert_map", expert_map, (torch.int32,), dim=1)
        check(expert_map.device == topk_ids_NK.device,
              f"expert_map is on {expert_map.device} but topk_ids_NK on {topk_ids_NK.device}; "
              f"move both to one device")


def _count_and_offsets(topk_ids_NK, num_experts, alignment, expert_map):
    """Phase (a): counts_E int32, offsets_E1 int32 (aligned prefix sum), both on device."""
    dev = topk_ids_NK.device
    num_pairs = topk_ids_NK.numel()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    if num_pairs:
        block = 1024
        _count_kernel[(triton.cdiv(num_pairs, block),)](
            topk_ids_NK, expert_map if expert_map is not None else counts, counts, num_pairs,
            HAS_MAP=expert_map is not None, BLOCK=block)
    aligned = (counts + (alignment - 1)) // alignment * alignment
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(aligned, 0)
    return counts, offsets


@triton.jit
def _scatter_kernel(ids_ptr, map_ptr, cursor_ptr, inv_ptr, row_expert_ptr,
                    x_ptr, out_ptr, s_ptr, s_out_ptr,
                    num_pairs, K, D, G,
                    stride_x, stride_out, s_stride_n, s_stride_g, so_stride_m, so_stride_g,
                    HAS_MAP: tl.constexpr, ASSIGN: tl.constexpr, COPY: tl.constexpr,
                    HAS_SCALE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_G: tl.constexpr):
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = offs_p < num_pairs
    if ASSIGN:  # take a row of the expert's group; the cursor starts at the group's offset
        e = tl.load(ids_ptr + offs_p, mask=pm, other=-1).to(tl.int32)
        if HAS_MAP:
            e = tl.load(map_ptr + e, mask=pm & (e >= 0), other=-1)
        valid = pm & (e >= 0)
        row = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
        row = tl.where(valid, row, -1)
        tl.store(inv_ptr + offs_p, row, mask=pm)
        tl.store(row_expert_ptr + row, e, mask=valid)
    else:  # rows given by an existing layout
        row = tl.load(inv_ptr + offs_p, mask=pm, other=-1)
        valid = pm & (row >= 0)
    if COPY:
        tok = (offs_p // K).to(tl.int64)
        row64 = row.to(tl.int64)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            m = valid[:, None] & (offs_d < D)[None, :]
            v = tl.load(x_ptr + tok[:, None] * stride_x + offs_d[None, :], mask=m)
            tl.store(out_ptr + row64[:, None] * stride_out + offs_d[None, :], v, mask=m)
        if HAS_SCALE:
            for g0 in range(0, G, BLOCK_G):
                offs_g = g0 + tl.arange(0, BLOCK_G)
                m = valid[:, None] & (offs_g < G)[None, :]
                s = tl.load(s_ptr + tok[:, None] * s_stride_n + offs_g[None, :] * s_stride_g,
                            mask=m)
                tl.store(s_out_ptr + row64[:, None] * so_stride_m + offs_g[None, :] * so_stride_g,
                         s, mask=m)


def _launch_scatter(topk_ids_NK, expert_map, cursor, inv, row_expert, x, out, assign):
    n, k = inv.shape
    num_pairs = n * k
    if num_pairs == 0:
        return
    copy = x is not None
    data = as_bits(x.data) if copy else inv
    odata = as_bits(out.data) if copy else inv
    has_scale = copy and x.scale is not None
    s = as_bits(x.scale) if has_scale else inv
    so = as_bits(out.scale) if has_scale else inv
    d = x.data.shape[1] if copy else 0
    g = x.scale.shape[1] if has_scale else 0
    block_d = min(next_pow2(max(d, 1)), 4096 if INTERPRET else 2048 // data.element_size())
    block_p = 64 if INTERPRET else 8
    _scatter_kernel[(triton.cdiv(num_pairs, block_p),)](
        topk_ids_NK if topk_ids_NK is not None else inv,
        expert_map if expert_map is not None else inv, cursor if cursor is not None else inv,
        inv, row_expert if row_expert is not None else inv, data, odata, s, so,
        num_pairs, k, d, g, data.stride(0) if copy else 0, odata.stride(0) if copy else 0,
        s.stride(0) if has_scale else 0, s.stride(1) if has_scale else 0,
        so.stride(0) if has_scale else 0, so.stride(1) if has_scale else 0,
        HAS_MAP=expert_map is not None, ASSIGN=assign, COPY=copy, HAS_SCALE=has_scale,
        BLOCK_P=block_p, BLOCK_D=block_d, BLOCK_G=min(next_pow2(max(g, 1)), 128),
        num_warps=4)


def _check_x(x: QTensor, n: int, device) -> None:
    check(isinstance(x, QTensor), f"x must be an epmoe.quant.QTensor, got {type(x).__name__}")
    check(x.data.dim() == 2 and x.data.shape[0] == n,
          f"x.data must be [N, D] with N = topk_ids_NK.shape[0] ({n}), got "
          f"{tuple(x.data.shape)}")
    check(x.data.stride(1) == 1, f"x.data rows must be contiguous (stride {x.data.stride()}); "
          f"call .contiguous() first")
    check(x.data.device == device, f"x is on {x.data.device} but topk_ids_NK on {device}")
    if x.scale is not None:
        check(x.scale.dim() == 2 and x.scale.shape[0] == n,
              f"x.scale must be [N, G] with N = {n}, got {tuple(x.scale.shape)}")


def _empty_like_rows(x: QTensor, num_rows: int) -> QTensor:
    dev = x.data.device
    data = torch.empty((num_rows, x.data.shape[1]), dtype=x.data.dtype, device=dev)
    scale = None
    if x.scale is not None:
        g = x.scale.shape[1]
        if x.scale_fmt == "ue8m0_packed" or is_mn_major(x.scale):  # keep the TMA layout
            scale = empty_mn_major(num_rows, g, x.scale.dtype, dev)
        else:
            scale = torch.empty((num_rows, g), dtype=x.scale.dtype, device=dev)
    return QTensor(data, scale, x.recipe, x.group, x.scale_fmt)


def _layout(topk_ids_NK, num_experts, alignment, expert_map, num_rows, x):
    _check_routing(topk_ids_NK, num_experts, alignment, expert_map)
    n, k = topk_ids_NK.shape
    dev = topk_ids_NK.device
    topk_ids_NK = topk_ids_NK.contiguous()
    counts, offsets = _count_and_offsets(topk_ids_NK, num_experts, alignment, expert_map)
    if num_rows is None:
        num_rows = int(offsets[-1])  # host sync: exact size
    else:
        bound = contiguous_rows_upper_bound(n * k, num_experts, alignment)
        check(num_rows >= bound,
              f"num_rows ({num_rows}) is below the worst case for {n * k} pairs over "
              f"{num_experts} experts at alignment {alignment} ({bound}); pass "
              f"contiguous_rows_upper_bound(...) or None (exact, syncs the host)")
    row_expert = torch.full((num_rows,), -1, dtype=torch.int32, device=dev)
    inv = torch.empty((n, k), dtype=torch.int32, device=dev)
    cursor = offsets[:-1].clone()
    out = None if x is None else _empty_like_rows(x, num_rows)
    _launch_scatter(topk_ids_NK, expert_map, cursor, inv, row_expert, x, out, assign=True)
    layout = ContiguousLayout(row_expert_M=row_expert, inv_perm_NK=inv, counts_E=counts,
                              offsets_E1=offsets, alignment=alignment)
    return out, layout


def triton_permute(x: QTensor, topk_ids_NK: torch.Tensor, num_experts: int,
                   alignment: int = 128, expert_map: torch.Tensor | None = None,
                   num_rows: int | None = None) -> tuple[QTensor, ContiguousLayout]:
    """Tokens x [N, D] (+ scales [N, G]) routed by topk_ids_NK -> (rows [M, D], layout).

    topk_ids_NK  int32/int64 [N, K]  local expert ids in [0, E), or global ids when
                                     expert_map is given; -1 = empty slot
    expert_map   int32 [E_global]    global -> local id, -1 = not on this rank
    num_rows     None = exact M (syncs the host), else M >= contiguous_rows_upper_bound
    Scales keep their layout: row-major stays row-major, MN-major (fp32 TMA-aligned or packed
    UE8M0) comes back MN-major with strides (1, align(M, 4)).
    """
    _check_x(x, topk_ids_NK.shape[0] if topk_ids_NK.dim() == 2 else -1, topk_ids_NK.device)
    out, layout = _layout(topk_ids_NK, num_experts, alignment, expert_map, num_rows, x)
    return out, layout


def triton_make_contiguous_layout(topk_ids_NK: torch.Tensor, num_experts: int,
                                  alignment: int = 128, expert_map: torch.Tensor | None = None,
                                  num_rows: int | None = None) -> ContiguousLayout:
    """The layout alone (same kernels, no data copied); `triton_permute_rows` copies later."""
    return _layout(topk_ids_NK, num_experts, alignment, expert_map, num_rows, None)[1]


def triton_permute_rows(x: QTensor, layout: ContiguousLayout) -> QTensor:
    """Copy token rows (and scales) into an existing layout: out[inv_perm[n, k]] = x[n]."""
    n, _ = layout.inv_perm_NK.shape
    _check_x(x, n, layout.inv_perm_NK.device)
    check_tensor("layout.inv_perm_NK", layout.inv_perm_NK, (torch.int32,), dim=2)
    out = _empty_like_rows(x, layout.num_rows)
    _launch_scatter(None, None, None, layout.inv_perm_NK, None, x, out, assign=False)
    return out


__all__ = ["triton_permute", "triton_make_contiguous_layout", "triton_permute_rows"]
