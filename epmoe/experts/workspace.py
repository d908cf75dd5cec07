"""Device buffers an experts object reuses from call to call (its hot path allocates nothing).

    ws = ExpertsWorkspace(device)
    h = ws.take("h", (rows, 2 * inter), torch.bfloat16)   # a view of a reused buffer

A buffer is allocated the first time a name is asked for, or when a call needs more than the
largest one before (warm-up, or `reserve`); any later call that fits returns a view of the same
storage. Views are valid until the next call that takes the same name: one workspace per
stream of use (`slot`): two micro-batches in flight use two slots. The permute's own buffers
(`epmoe.kernels` PermuteWorkspace) are kept here too, keyed ("permute", copies rows).
"""

from __future__ import annotations

import math

import torch


class ExpertsWorkspace:
    """Named flat buffers on one device; `allocations` counts every buffer ever allocated
    (a steady-state call adds none)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._objs: dict[tuple, object] = {}
        self.allocations = 0

    def take(self, name: str, shape, dtype: torch.dtype, slot: int = 0) -> torch.Tensor:
        """A [shape] view of buffer (slot, name, dtype), grown (reallocated) only if smaller."""
        n = math.prod(shape)
        key = (slot, name, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=dtype, device=self.device)
            self._bufs[key] = buf
            self.allocations += 1
        return buf[:n].view(shape)

    def obj(self, key, make, fits=lambda o: True, slot: int = 0):
        """A reusable object (e.g. a PermuteWorkspace) for (slot, key): made by `make()` the first
        time or when `fits(existing)` is false."""
        k = (slot, key)
        o = self._objs.get(k)
        if o is None or not fits(o):
            o = make()
            self._objs[k] = o
            self.allocations += 1
        return o

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def permute_worst_case(x, topk_ids_NK: torch.Tensor, num_experts: int, alignment: int,
                       ws: ExpertsWorkspace, slot: int = 0):
    """Tokens -> (rows, ContiguousLayout) with no host sync and no allocation in steady
    state: the layout is sized for the worst case of the call's N*K pairs (from shapes alone;
    the GEMMs skip padding rows, row_expert -1, on the device), and every output is a view into
    the kernels' `PermuteWorkspace` kept in `ws` (valid until the next call on this slot)."""
    from epmoe.kernels.permute import triton_permute

    pws = _permute_workspace(x, topk_ids_NK, num_experts, alignment, ws, slot, True)
    return triton_permute(x, topk_ids_NK, num_experts, alignment=alignment, workspace=pws)


def layout_tokens_worst_case(x, topk_ids_NK: torch.Tensor, num_experts: int, alignment: int,
                             ws: ExpertsWorkspace, slot: int = 0):
    """permute_worst_case without the copy: -> (ContiguousLayout, rows_M int32 [M], each
    layout row's token in x, -1 on padding), for GEMMs that read x's rows in place."""
    from epmoe.kernels.permute import triton_layout_tokens

    pws = _permute_workspace(x, topk_ids_NK, num_experts, alignment, ws, slot, False)
    return triton_layout_tokens(topk_ids_NK, num_experts, alignment=alignment, workspace=pws)


def _permute_workspace(x, topk_ids_NK, num_experts, alignment, ws, slot, copies_rows):
    """The PermuteWorkspace kept in `ws` for this call's format and size (made or grown)."""
    from epmoe.config import QuantConfig
    from epmoe.kernels.workspace import PermuteWorkspace

    n, k = topk_ids_NK.shape
    hidden = x.data.shape[1]
    quant = QuantConfig(x.recipe, x.scale_fmt)
    mn_major = (x.scale is not None and x.scale.dim() == 2 and x.scale.shape[1] > 1
                and x.scale.stride(0) == 1)

    def fits(o) -> bool:
        return (o.max_pairs >= max(n * k, 1) and o.num_experts == num_experts
                and o.alignment == alignment and o.hidden == hidden and o.quant == quant
                and o.mn_major == mn_major)

    return ws.obj(("permute", copies_rows), lambda: PermuteWorkspace.create(
        max(n, 1), k, num_experts, alignment, hidden, quant, ws.device, mn_major=mn_major,
        copies_rows=copies_rows), fits, slot=slot)


def fused_quantize(x_TD: torch.Tensor, quant, mn_major: bool = False):
    """The recipe's activation quantization of token rows: one Triton pass on CUDA, the exact
    torch reference on CPU (`epmoe.kernels.quantize.quantize_tokens`)."""
    from epmoe.kernels.quantize import quantize_tokens

    return quantize_tokens(x_TD.contiguous(), quant, mn_major=mn_major)


__all__ = ["ExpertsWorkspace", "fused_quantize", "layout_tokens_worst_case",
           "permute_worst_case"]
