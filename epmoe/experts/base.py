"""The experts contract: grouped expert MLPs over the contiguous or masked layout.

One class per kernel family (torch reference, Triton, DeepGEMM); recipe and layout are data.
Every backend computes, per expert e and row x:
    h = x @ w13[e].T            (fp32 accumulate; F = 2I columns: [0, I) gate, [I, 2I) up)
    h += b13[e]                 (expert biases, when the weights carry them: gpt-oss)
    a = act(h[:, :I], h[:, I:])  (swiglu: silu(g)*u, optional clamp; swigluoai: gpt-oss)
    a_q = quantize_act(a)        (the recipe's activation quantization, per row)
    y = a_q @ w2[e].T + b2[e]    (fp32 accumulate, bf16 out)
y is the expert's output before the router weight: whoever applies the weights (the gather,
or a comm's combine) applies them to the biased row, as Hugging Face's gpt-oss does.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from epmoe.comm.base import Batch, LayoutBatch, MaskedBatch, TokenBatch
from epmoe.config import MoEConfig, QuantConfig
from epmoe.layout import (ContiguousLayout, gather_masked_reduce, make_contiguous_layout,
                          permute_qtensor, unpermute_reduce)
from epmoe.quant import QTensor, QWeight, quantize_act
from epmoe.timing import StageTimer


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's weights for the experts a rank holds (E local experts).

    w13          QWeight [E, 2I, D]  rows [0, I) gate proj, [I, 2I) up proj
    w2           QWeight [E, D, I]   down proj
    expert_ids_E int64 [E]           global (physical slot) id of each local expert
    b13          fp32 [E, 2I] | None  gate / up biases (columns as w13's rows)
    b2           fp32 [E, D] | None   down bias; under TP only the slice that starts at
                                      intermediate 0 holds it (the partial sums add it once)
    """

    w13: QWeight
    w2: QWeight
    expert_ids_E: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None

    def __post_init__(self) -> None:
        e, f, d = self.w13.shape
        for name, b, want in (("b13", self.b13, (e, f)), ("b2", self.b2, (e, d))):
            if b is not None and (tuple(b.shape) != want or b.dtype != torch.float32):
                raise ValueError(f"{name} must be fp32 {want}, got {b.dtype} "
                                 f"{tuple(b.shape)}")

    def to(self, device) -> "ExpertWeights":
        def mv(t):
            return None if t is None else t.to(device)
        return ExpertWeights(self.w13.to(device), self.w2.to(device),
                             self.expert_ids_E.to(device), mv(self.b13), mv(self.b2))

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]


def activation(h_MF: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """SwiGLU family on fp32 [..., 2I] -> fp32 [..., I]."""
    i = h_MF.shape[-1] // 2
    gate, up = h_MF[..., :i].float(), h_MF[..., i:].float()
    lim = cfg.swiglu_limit
    if cfg.activation == "swiglu":
        if lim is not None:
            gate = gate.clamp(max=lim)
            up = up.clamp(-lim, lim)
        return torch.nn.functional.silu(gate) * up
    # swigluoai (gpt-oss): clamp, gate * sigmoid(alpha * gate) * (up + 1)
    if lim is not None:
        gate = gate.clamp(max=lim)
        up = up.clamp(-lim, lim)
    return gate * torch.sigmoid(cfg.activation_alpha * gate) * (up + 1)


class Experts(ABC):
    """Grouped expert compute for one layer on one rank.

    slot: which set of reused buffers a call writes (a backend with a workspace keeps one set
    per slot): outputs of a call stay valid until the next call in the same slot, so two
    micro-batches in flight run in two slots (`with experts.use_slot(i): ...`)."""

    name: str = "?"
    slot: int = 0

    def __init__(self, weights: ExpertWeights, cfg: MoEConfig, quant: QuantConfig):
        self.weights, self.cfg, self.quant = weights, cfg, quant
        # The layer hands its timer over; stages "experts.permute", ".gemm1", ".act_quant",
        # ".gemm2", ".gather" then appear in the run report (CUDA events on GPU).
        self.timer = StageTimer(enabled=False)

    @classmethod
    def supports(cls, cfg: MoEConfig, quant: QuantConfig, device: torch.device) -> str | None:
        """None if this backend can run the config on the device, else the reason it cannot."""
        return None

    @property
    def alignment(self) -> int:
        """Row alignment of each expert group that this backend's GEMM assumes."""
        return 1

    @property
    def gathers_rows(self) -> bool:
        """Whether the GEMMs read a batch's rows through its index (a MaskedBatch's rows_EC,
        a LayoutBatch's rows_M: no copy into the layout first)."""
        return False

    @property
    def fp8_mma(self) -> bool:
        """Whether this backend's fp8 GEMMs run on a GPU's fp8 tensor cores, whose MMA sums a
        K block at reduced precision before the fp32 promotion (`reference.tolerance`)."""
        return False

    @abstractmethod
    def run_contiguous(self, x: QTensor, layout: ContiguousLayout) -> torch.Tensor:
        """x [M, D] rows in `layout` -> y [M, D] bf16 (padding rows: any value)."""

    @abstractmethod
    def run_masked(self, x: QTensor, counts_E: torch.Tensor) -> torch.Tensor:
        """x [E, C, D], counts [E] -> y [E, C, D] bf16 (rows past a count: any value)."""

    def run_masked_rows(self, x: QTensor, counts_E: torch.Tensor,
                        rows_EC: torch.Tensor) -> torch.Tensor:
        """run_masked with x [R, D] and row (e, c) = x[rows_EC[e, c]] (`MaskedBatch`), for
        backends that gather their GEMM's rows (`gathers_rows`)."""
        raise self._cannot_gather("masked rows (rows_EC)", "symm-ll: ll_gather")

    def run_contiguous_rows(self, x: QTensor, layout: ContiguousLayout,
                            rows_M: torch.Tensor) -> torch.Tensor:
        """run_contiguous with x [R, D] and layout row m = x[rows_M[m]] (`LayoutBatch`), for
        backends that gather their GEMM's rows (`gathers_rows`)."""
        raise self._cannot_gather("layout rows (rows_M)", "symm-ht: ht_gather")

    def _cannot_gather(self, what: str, knob: str) -> ValueError:
        return ValueError(f"{self.name} experts ({self.quant.recipe}) cannot read {what} "
                          f"through an index; run the comm without gathered rows ({knob} "
                          f"off) or use the triton experts")

    def run(self, batch: Batch) -> torch.Tensor:
        """The one entry point: what a comm's dispatch returned -> what its combine takes.

        TokenBatch  -> [N, D] per received token, the weighted sum over its local experts
        LayoutBatch -> [M, D] bf16 per row of the contiguous layout, unweighted
        MaskedBatch -> [E, C, D] bf16 per masked row, unweighted
        """
        if isinstance(batch, TokenBatch):
            return self.apply(batch.x, batch.topk_ids_NK, batch.topk_weights_NK)
        if isinstance(batch, LayoutBatch):
            if batch.layout.num_experts != self.weights.num_experts:
                raise ValueError(f"layout has {batch.layout.num_experts} experts, these experts "
                                 f"hold {self.weights.num_experts}")
            self.resolve_alignment(batch.layout.alignment)
            if batch.rows_M is None:
                return self.run_contiguous(batch.x, batch.layout)
            return self.run_contiguous_rows(batch.x, batch.layout, batch.rows_M)
        if isinstance(batch, MaskedBatch):
            if batch.rows_EC is None:
                return self.run_masked(batch.x, batch.counts_E)
            return self.run_masked_rows(batch.x, batch.counts_E, batch.rows_EC)
        raise TypeError(f"experts take a TokenBatch, LayoutBatch or MaskedBatch, got "
                        f"{type(batch).__name__}")

    @contextlib.contextmanager
    def use_slot(self, slot: int):
        prev, self.slot = self.slot, slot
        try:
            yield self
        finally:
            self.slot = prev

    def quantize_input(self, x_TD: torch.Tensor) -> QTensor:
        """Token rows -> this backend's activation format (the recipe's quantization)."""
        return quantize_act(x_TD, self.quant)

    def run_dense(self, x: QTensor) -> torch.Tensor:
        """Every row of x [N, D] through the one expert these weights hold (the shared MLP) ->
        [N, D] bf16, unweighted. Backends override it with plain GEMMs (no permute, no gather)."""
        self.check_one_expert()
        n = x.data.shape[0]
        ids = torch.zeros(n, 1, dtype=torch.int32, device=x.data.device)
        return self.apply(x, ids, None).to(torch.bfloat16)

    def check_one_expert(self) -> None:
        """run_dense's precondition: these weights hold exactly one expert."""
        if self.weights.num_experts != 1:
            raise ValueError(f"run_dense takes one expert (the shared MLP), these weights hold "
                             f"{self.weights.num_experts}")

    def resolve_alignment(self, alignment: int | None) -> int:
        """The row alignment to use: this backend's GEMM alignment or a multiple of it. A finer
        one is refused: an expert index aligned finer than BLOCK_M makes the GEMM read another
        expert's id for part of a tile (the seed's mk_alignment_scope problem)."""
        a = self.alignment if alignment is None else alignment
        if a < 1 or a % self.alignment:
            raise ValueError(f"alignment ({a}) must be a multiple of {self.name}'s GEMM "
                             f"alignment ({self.alignment})")
        return a

    def make_layout(self, topk_ids_NK: torch.Tensor, alignment: int | None = None,
                    num_rows: int | None = None) -> ContiguousLayout:
        """The layout at this backend's alignment (see resolve_alignment)."""
        a = self.resolve_alignment(alignment)
        return make_contiguous_layout(topk_ids_NK, self.weights.num_experts, a, num_rows)

    def permute(self, x: QTensor, layout: ContiguousLayout) -> QTensor:
        return permute_qtensor(x, layout)

    def unpermute(self, y_MD, layout, topk_weights_NK) -> torch.Tensor:
        return unpermute_reduce(y_MD, layout, topk_weights_NK, out_dtype=torch.float32)

    def apply(self, x: QTensor, topk_ids_NK: torch.Tensor, topk_weights_NK: torch.Tensor | None,
              alignment: int | None = None) -> torch.Tensor:
        """Tokens [N, D] with local expert ids (-1 = not here) -> out [N, D] (fp32 or bf16),
        out[n] = sum_k w[n,k] * expert_{id[n,k]}(x[n]) (fp32 sum, one cast)."""
        t = self.timer
        with t.stage("experts.permute"):
            layout = self.make_layout(topk_ids_NK, alignment)
            xp = self.permute(x, layout)
        y = self.run_contiguous(xp, layout)
        with t.stage("experts.gather"):
            return self.unpermute(y, layout, topk_weights_NK)

    def apply_masked(self, x_ECD: QTensor, counts_E, layout, topk_weights_NK) -> torch.Tensor:
        return gather_masked_reduce(self.run_masked(x_ECD, counts_E), layout, topk_weights_NK)
