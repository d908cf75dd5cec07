"""PermuteWorkspace: the device buffers of `triton_permute`, allocated once by their owner (the
experts object), so a call allocates nothing and never syncs the host.

A call with a workspace sizes its layout for the worst case of its N*K pairs
(`contiguous_rows_upper_bound`, computed on the host from shapes alone); the GEMMs read the
real row count from `offsets_E1[E]` on the device. Its outputs (the permuted QTensor and the
ContiguousLayout) are views into the workspace, valid until the next call that uses it: one
workspace per stream of use (e.g. per micro-batch when two overlap).
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.kernels._common import align_up, check, next_pow2

import torch  # noqa: E402

from epmoe.config import QuantConfig  # noqa: E402
from epmoe.layout import contiguous_rows_upper_bound  # noqa: E402
from epmoe.quant import FP8_DTYPE, QTensor  # noqa: E402


def hist_bins(num_experts: int) -> int:
    """Histogram bins of the permute's counting phase: > E (the last bin takes invalid ids)."""
    return max(32, next_pow2(num_experts + 1))


@dataclass(frozen=True)
class PermuteWorkspace:
    """Buffers for up to `max_pairs` (token, slot) pairs over `num_experts` local experts.

    hist_B        int32 [bins]       histogram accumulator; zero between calls (reset in-kernel)
    ticket_1      int32 [1]          programs done counting; zero between calls
    counts_E, cursor_E  int32 [E];   offsets_E1 int32 [E+1]
    inv_P         int32 [max_pairs]  storage of inv_perm_NK
    row_expert_R  int32 [max_rows]   storage of row_expert_M
    token_R       int32 [max_rows]   each layout row's token (`triton_layout_tokens`)
    data_flat     [max_rows * hidden] activation rows (bf16 or fp8); empty when the workspace
                  was made for layouts whose rows are read through token_R (copies_rows off)
    scale_flat    scales (fp32 / uint8 e8m0 / int32 packed UE8M0) for any row count up to
                  max_rows, in the layout of `scale_view`; None for bf16
    """

    num_experts: int
    alignment: int
    hidden: int
    max_pairs: int
    quant: QuantConfig
    mn_major: bool
    hist_B: torch.Tensor
    ticket_1: torch.Tensor
    counts_E: torch.Tensor
    offsets_E1: torch.Tensor
    cursor_E: torch.Tensor
    inv_P: torch.Tensor
    row_expert_R: torch.Tensor
    token_R: torch.Tensor
    data_flat: torch.Tensor
    scale_flat: torch.Tensor | None

    @classmethod
    def create(cls, max_tokens: int, top_k: int, num_experts: int, alignment: int,
               hidden: int, quant: QuantConfig, device, mn_major: bool = False,
               copies_rows: bool = True) -> "PermuteWorkspace":
        """max_tokens: the most tokens (rows of x) one call will see; mn_major: fp32 / e8m0
        scales in the MN-major TMA layout (packed UE8M0 always is), matching the input's;
        copies_rows off: no room for permuted rows (layouts with token_R only)."""
        check(max_tokens >= 1 and top_k >= 1 and num_experts >= 1 and alignment >= 1,
              f"max_tokens ({max_tokens}), top_k ({top_k}), num_experts ({num_experts}) and "
              f"alignment ({alignment}) must be >= 1")
        group = quant.act_group
        check(group == 0 or hidden % group == 0, f"hidden ({hidden}) must be a multiple of "
              f"{quant.recipe}'s activation group ({group})")
        pairs = max_tokens * top_k
        rows = contiguous_rows_upper_bound(pairs, num_experts, alignment)
        i32 = dict(dtype=torch.int32, device=device)
        data = torch.empty(rows * hidden if copies_rows else 0,
                           dtype=torch.bfloat16 if group == 0 else FP8_DTYPE, device=device)
        scale = None
        if group and copies_rows:
            dt, w = _scale_dtype_width(quant, hidden)
            scale = torch.empty(w * align_up(rows, 4), dtype=dt, device=device)
        return cls(num_experts, alignment, hidden, pairs, quant, mn_major,
                   torch.zeros(hist_bins(num_experts), **i32), torch.zeros(1, **i32),
                   torch.empty(num_experts, **i32), torch.empty(num_experts + 1, **i32),
                   torch.empty(num_experts, **i32), torch.empty(pairs, **i32),
                   torch.empty(rows, **i32), torch.empty(rows, **i32), data, scale)

    @property
    def max_rows(self) -> int:
        return self.row_expert_R.shape[0]

    def scale_view(self, num_rows: int) -> torch.Tensor | None:
        """Scales of `num_rows` rows: row-major [R, G], or MN-major with strides
        (1, align(R, 4)) for mn_major / packed UE8M0 (DeepGEMM's TMA layout)."""
        if self.scale_flat is None:
            return None
        _, w = _scale_dtype_width(self.quant, self.hidden)
        if self.mn_major or self.quant.scale_fmt == "ue8m0_packed":
            return self.scale_flat.as_strided((num_rows, w), (1, align_up(num_rows, 4)))
        return self.scale_flat[:num_rows * w].view(num_rows, w)

    @property
    def copies_rows(self) -> bool:
        return self.data_flat.numel() > 0

    def rows(self, num_rows: int) -> QTensor:
        """The first `num_rows` permuted rows as a QTensor (views, no copy)."""
        check(self.copies_rows, "this workspace holds no rows (made with copies_rows off); "
              "use triton_layout_tokens with it, or create one with copies_rows on")
        check(num_rows <= self.max_rows, f"num_rows ({num_rows}) exceeds the workspace's "
              f"max_rows ({self.max_rows}); create it with a larger max_tokens")
        data = self.data_flat[:num_rows * self.hidden].view(num_rows, self.hidden)
        q = self.quant
        return QTensor(data, self.scale_view(num_rows), q.recipe, q.act_group, q.scale_fmt)

    def check_input(self, x: QTensor, num_pairs: int) -> None:
        """x must have this workspace's format, and num_pairs must fit (cheap: no views)."""
        check(num_pairs <= self.max_pairs, f"{num_pairs} (token, slot) pairs exceed the "
              f"workspace's max_pairs ({self.max_pairs}); create it with a larger max_tokens")
        q = self.quant
        same = (x.recipe == q.recipe and x.scale_fmt == q.scale_fmt and
                x.data.dtype == self.data_flat.dtype and x.data.shape[1] == self.hidden and
                (x.scale is None) == (self.scale_flat is None))
        if same and x.scale is not None:
            s = x.scale
            mn_x = s.stride(0) == 1  # with one row or one column both layouts coincide
            mn_ws = self.mn_major or q.scale_fmt == "ue8m0_packed"
            same = s.dtype == self.scale_flat.dtype and (mn_x == mn_ws or min(s.shape) <= 1)
        check(same, f"x ({x.recipe}/{x.scale_fmt}, data {x.data.dtype} {tuple(x.data.shape)}) "
              f"does not match the workspace ({q.recipe}/{q.scale_fmt}, hidden {self.hidden}, "
              f"mn_major {self.mn_major}); create the workspace with the activations' "
              f"QuantConfig and scale layout")


def _scale_dtype_width(quant: QuantConfig, hidden: int) -> tuple[torch.dtype, int]:
    g = hidden // quant.act_group
    if quant.recipe == "mxfp8":
        return torch.uint8, g
    if quant.scale_fmt == "ue8m0_packed":
        return torch.int32, (g + 3) // 4
    return torch.float32, g


__all__ = ["PermuteWorkspace", "hist_bins"]
