"""Plain-torch experts: dequantize, fp32 matmul per expert group. Runs everywhere."""

from __future__ import annotations

import torch

from epmoe.experts.base import Experts, activation
from epmoe.layout import ContiguousLayout
from epmoe.quant import QTensor, dequantize_act, dequantize_weight, quantize_act


class TorchExperts(Experts):
    name = "torch"

    @classmethod
    def supports(cls, cfg, quant, device) -> str | None:
        if quant.scale_fmt == "ue8m0_packed":  # the base class's plain-torch permute
            return ("its plain-torch row permute cannot reorder packed UE8M0 scales "
                    "(MN-major); use triton, or scale_fmt ue8m0_fp32")
        return None

    def __init__(self, weights, cfg, quant):
        super().__init__(weights, cfg, quant)
        # Dequantized once per weight load: the reference backend trades memory for simplicity.
        self._w13 = dequantize_weight(weights.w13)  # fp32 [E, F, D]
        self._w2 = dequantize_weight(weights.w2)  # fp32 [E, D, I]

    def _mlp(self, x_RD: torch.Tensor, e: int) -> torch.Tensor:
        t = self.timer
        b13, b2 = self.weights.b13, self.weights.b2
        with t.stage("experts.gemm1"):
            h = x_RD @ self._w13[e].T
            h = h.to(torch.bfloat16).float()  # GEMM1 writes bf16, as the fused paths do
        with t.stage("experts.act_quant"):
            if b13 is not None:
                h = h + b13[e]
            a = dequantize_act(quantize_act(activation(h, self.cfg), self.quant))
        with t.stage("experts.gemm2"):
            y = a @ self._w2[e].T
            return (y if b2 is None else y + b2[e]).to(torch.bfloat16)

    def run_contiguous(self, x: QTensor, layout: ContiguousLayout) -> torch.Tensor:
        xf = dequantize_act(x)
        y = torch.zeros(xf.shape, dtype=torch.bfloat16, device=xf.device)
        offs = layout.offsets_E1.tolist()
        counts = layout.counts_E.tolist()
        for e in range(layout.num_experts):
            if counts[e]:
                s = offs[e]
                y[s:s + counts[e]] = self._mlp(xf[s:s + counts[e]], e)
        return y

    def run_dense(self, x: QTensor) -> torch.Tensor:
        self.check_one_expert()
        return self._mlp(dequantize_act(x), 0)

    def run_masked(self, x: QTensor, counts_E: torch.Tensor) -> torch.Tensor:
        xf = dequantize_act(x)
        y = torch.zeros(xf.shape, dtype=torch.bfloat16, device=xf.device)
        for e, c in enumerate(counts_E.tolist()):
            if c:
                y[e, :c] = self._mlp(xf[e, :c], e)
        return y
