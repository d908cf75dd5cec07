"""Triton experts: permute -> GEMM1 -> fused act + quant -> GEMM2 -> gather, all Triton kernels.

Runs on CUDA (compiled) and on CPU under Triton's interpreter (slow: tests and debugging only).
Every recipe of epmoe.config (bf16, fp8_block in each scale format, mxfp8, w4a8_mxfp4).
The hot path makes no host sync: the layout is sized for the worst case of its pairs
(`permute_worst_case`); in bf16 and mxfp8 the permute copies no rows, GEMM1 reads each token
where it is through the layout's row -> token index (`gather_tokens`). `run_dense` (shared
experts) is the masked GEMM with one expert over all rows: no permute, no gather.
"""

from __future__ import annotations

import torch

from epmoe.config import RECIPES, MoEConfig, QuantConfig
from epmoe.experts.base import ExpertWeights, Experts
from epmoe.experts.workspace import (ExpertsWorkspace, fused_quantize,
                                     layout_tokens_worst_case, permute_worst_case)
from epmoe.kernels._common import INTERPRET
from epmoe.kernels.act_quant import ValidRows, triton_act_quant
from epmoe.kernels.gather import triton_gather_masked_reduce, triton_unpermute_reduce
from epmoe.kernels.gemm_w4a8 import w4a8_block_m
from epmoe.kernels.grouped_gemm import (triton_m_grouped_gemm_nt_contiguous,
                                        triton_m_grouped_gemm_nt_masked)
from epmoe.kernels.permute import triton_make_contiguous_layout, triton_permute_rows
from epmoe.layout import ContiguousLayout, MaskedLayout
from epmoe.quant import QTensor


class TritonExperts(Experts):
    """block_m: the GEMM's BLOCK_M, which is also the layout alignment this backend asks for
    (default 128 on GPU, 32 under the interpreter to keep padding small)."""

    name = "triton"
    # Recipes whose GEMM1 reads a token batch's rows in place through the layout's row ->
    # token index, so the permute's copy of every (token, local expert) row goes: bf16, where
    # the TMA kernel's MMA hides those loads (BENCHMARKS 40, 44), and mxfp8, whose pointer
    # kernel loads A by pointer either way (0.93-0.99x the copying apply, BENCHMARKS 45).
    # Not fp8_block (its TMA kernel would give way to A by pointer, ~5% of its GEMM1, more
    # than the copy) nor w4a8_mxfp4 (its swapped MMA gathers the token side: 1.4-1.5x).
    # epmoe.plan.traffic prices the same set (permute_copies_rows).
    TOKEN_GATHER_RECIPES = ("bf16", "mxfp8")

    def __init__(self, weights: ExpertWeights, cfg: MoEConfig, quant: QuantConfig,
                 block_m: int | None = None):
        super().__init__(weights, cfg, quant)
        self.block_m = block_m or (32 if INTERPRET else 128)
        if self.block_m not in (16, 32, 64, 128):
            raise ValueError(f"block_m ({self.block_m}) must be one of 16, 32, 64, 128")
        if weights.w13.recipe != quant.recipe or weights.w2.recipe != quant.recipe:
            raise ValueError(f"weights are {weights.w13.recipe}/{weights.w2.recipe} but the "
                             f"recipe is {quant.recipe}; quantize them with the same QuantConfig")
        self.ws = ExpertsWorkspace(weights.w13.data.device)
        self.gather_tokens = quant.recipe in self.TOKEN_GATHER_RECIPES

    @classmethod
    def supports(cls, cfg: MoEConfig, quant: QuantConfig, device: torch.device) -> str | None:
        if quant.recipe not in RECIPES:
            return f"recipe {quant.recipe!r} unsupported"
        device = torch.device(device)
        if device.type != "cuda" and not INTERPRET:
            return f"device {device} is not CUDA and TRITON_INTERPRET is off"
        try:
            quant.check_shapes(cfg)
        except ValueError as exc:
            return str(exc)
        return None

    @property
    def alignment(self) -> int:
        return self.block_m

    @property
    def fp8_mma(self) -> bool:  # the interpreter's dot is an fp32 one
        return self.quant.recipe == "fp8_block" and self.weights.w13.data.is_cuda and not INTERPRET

    def make_layout(self, topk_ids_NK: torch.Tensor, alignment: int | None = None,
                    num_rows: int | None = None) -> ContiguousLayout:
        a = self.resolve_alignment(alignment)
        return triton_make_contiguous_layout(topk_ids_NK, self.weights.num_experts, a,
                                             num_rows=num_rows)

    def permute(self, x: QTensor, layout: ContiguousLayout) -> QTensor:
        return triton_permute_rows(x, layout)

    def unpermute(self, y_MD, layout, topk_weights_NK) -> torch.Tensor:
        return triton_unpermute_reduce(y_MD, layout, topk_weights_NK)

    def apply(self, x: QTensor, topk_ids_NK: torch.Tensor, topk_weights_NK: torch.Tensor | None,
              alignment: int | None = None) -> torch.Tensor:
        """One pass builds the layout and copies the rows (the seed's ep_scatter), or under
        gather_tokens only the layout's row -> token index that GEMM1 reads x through; no
        sync."""
        a = self.resolve_alignment(alignment)
        t = self.timer
        e = self.weights.num_experts
        if self.gather_tokens:
            with t.stage("experts.permute"):
                layout, rows_M = layout_tokens_worst_case(x, topk_ids_NK, e, a, self.ws,
                                                          self.slot)
            y = self.run_contiguous(x, layout, rows_M=rows_M)
        else:
            with t.stage("experts.permute"):
                xp, layout = permute_worst_case(x, topk_ids_NK, e, a, self.ws, self.slot)
            y = self.run_contiguous(xp, layout)
        with t.stage("experts.gather"):
            return self.unpermute(y, layout, topk_weights_NK)

    def run_contiguous(self, x: QTensor, layout: ContiguousLayout,
                       rows_M: torch.Tensor | None = None) -> torch.Tensor:
        """rows_M: x is [R, D] rows, GEMM1 reads layout row m from x[rows_M[m]]."""
        bm = self.block_m if layout.alignment % self.block_m == 0 else None
        if bm is not None:  # the mean (token, k) pairs per expert, from shapes: no sync (an
            # upper bound where the layout is sized for the worst case)
            bm = self._block_m(bm, layout.inv_perm_NK.numel() / layout.num_experts)
        t = self.timer
        with t.stage("experts.gemm1"):
            h = triton_m_grouped_gemm_nt_contiguous(x, self.weights.w13, layout, block_m=bm,
                                                    rows_M=rows_M)
        rows = ValidRows.contiguous(layout.row_expert_M)
        with t.stage("experts.act_quant"):
            a = triton_act_quant(h, self.cfg, self.quant, rows=rows, bias_EF=self.weights.b13)
        with t.stage("experts.gemm2"):  # + b2 in the GEMM's epilogue
            return triton_m_grouped_gemm_nt_contiguous(a, self.weights.w2, layout, block_m=bm,
                                                       bias=self.weights.b2)

    def _block_m(self, cap: int, rows_per_expert: float) -> int:
        """The grouped GEMMs' BLOCK_M: cap, or under W4A8 (whose BLOCK_M is the swapped MMA's
        token side) sized to the rows an expert is expected to get."""
        if self.quant.recipe == "w4a8_mxfp4":
            return w4a8_block_m(rows_per_expert, cap)
        return cap

    @property
    def gathers_rows(self) -> bool:  # every GEMM1 kernel reads A's rows through an index
        return True

    def run_masked_rows(self, x: QTensor, counts_E: torch.Tensor,
                        rows_EC: torch.Tensor) -> torch.Tensor:
        return self.run_masked(x, counts_E, rows_EC=rows_EC)

    def run_contiguous_rows(self, x: QTensor, layout: ContiguousLayout,
                            rows_M: torch.Tensor) -> torch.Tensor:
        return self.run_contiguous(x, layout, rows_M=rows_M)

    def run_masked(self, x: QTensor, counts_E: torch.Tensor,
                   rows_per_expert: float | None = None,
                   rows_EC: torch.Tensor | None = None) -> torch.Tensor:
        """rows_per_expert: the rows an expert is expected to get (w4a8's BLOCK_M follows
        it); default the capacity's share under uniform routing, C x top_k / experts.
        rows_EC: x is [R, D] rows, GEMM1 reads row (e, c) from x[rows_EC[e, c]]."""
        e, c = rows_EC.shape if rows_EC is not None else x.data.shape[:2]
        counts_E = counts_E.to(torch.int32)
        expected = c * self.cfg.top_k / self.cfg.num_experts if rows_per_expert is None \
            else rows_per_expert
        # the pointer kernel's masked tiles stay <= 64 rows; the W4A8 kernel runs up to 128
        cap = self.block_m if self.quant.recipe == "w4a8_mxfp4" else min(self.block_m, 64)
        bm = self._block_m(cap, expected)
        rows = ValidRows.masked(counts_E, c)
        h = triton_m_grouped_gemm_nt_masked(x, self.weights.w13, counts_E, block_m=bm,
                                            rows_EC=rows_EC)
        a = triton_act_quant(h.view(e * c, -1), self.cfg, self.quant, rows=rows,
                             bias_EF=self.weights.b13)
        a = QTensor(a.data.view(e, c, -1), a.scale, a.recipe, a.group, a.scale_fmt)
        return triton_m_grouped_gemm_nt_masked(a, self.weights.w2, counts_E, block_m=bm,
                                               bias=self.weights.b2)

    def quantize_input(self, x_TD: torch.Tensor) -> QTensor:
        return fused_quantize(x_TD, self.quant)

    def run_dense(self, x: QTensor) -> torch.Tensor:
        """Every row through expert 0 (the shared MLP): the masked GEMM with E = 1, C = N."""
        self.check_one_expert()
        n, d = x.data.shape
        counts = self.ws.take("dense_count", (1,), torch.int32, self.slot)
        counts.fill_(n)
        # scales stay [N, G] as they are (the masked GEMM reads 2-D scales as rows E*C)
        x3 = QTensor(x.data.contiguous().view(1, n, d), x.scale, x.recipe, x.group, x.scale_fmt)
        return self.run_masked(x3, counts, rows_per_expert=n).view(n, d)

    def apply_masked(self, x_ECD: QTensor, counts_E, layout: MaskedLayout,
                     topk_weights_NK) -> torch.Tensor:
        return triton_gather_masked_reduce(self.run_masked(x_ECD, counts_E), layout,
                                           topk_weights_NK)
