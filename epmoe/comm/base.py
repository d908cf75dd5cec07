"""The comm contract: every dispatch/combine backend implements `Comm`.

    batch, handle = comm.dispatch(x_TD, topk_ids_TK, topk_weights_TK)
    expert_out = experts(batch)               # token form: [N, D] fp32, weighted sum per token
                                              # masked form: [E, C, D] bf16, unweighted
    out_TD = comm.combine(expert_out, handle) # [T, D] this rank's tokens: fp32, or bf16 when the
                                              # backend reduced in fp32 and cast once (DeepEP)

Combine is the inverse of dispatch. Handles are frozen dataclasses private to their backend;
`ExpertBatch` is the shared result type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.layout import MaskedLayout
from epmoe.quant import QTensor, quantize_act
from epmoe.timing import StageTimer


@dataclass(frozen=True)
class ExpertBatch:
    """What this rank's experts receive.

    form             "tokens": x [N, D] received tokens with their local routing;
                     "masked": x [E_local, C, D] per-expert rows with counts_E
    x                QTensor, quantized per the recipe (scales travel with rows)
    topk_ids_NK      int [N, K] local expert ids, -1 = not on this rank (tokens form)
    topk_weights_NK  fp32 [N, K] combine weights; None when the combine applies them
    counts_E         int32 [E_local] (masked form)
    masked_layout    where each (token, k) sits in x (masked form, for local combine)
    """

    form: Literal["tokens", "masked"]
    x: QTensor
    topk_ids_NK: torch.Tensor | None = None
    topk_weights_NK: torch.Tensor | None = None
    counts_E: torch.Tensor | None = None
    masked_layout: MaskedLayout | None = None

    @property
    def num_tokens(self) -> int:
        return self.x.data.shape[0] if self.form == "tokens" else int(self.counts_E.sum())


class Comm(ABC):
    """A dispatch/combine backend bound to one rank's process group and expert map.

    expert_map_E: int32 [E_physical] physical expert id -> local index on this rank, -1 elsewhere.
    """

    name: str = "?"

    def __init__(self, cfg: MoEConfig, quant: QuantConfig, expert_map_E: torch.Tensor,
                 group=None, rank: int = 0, world: int = 1):
        self.cfg, self.quant, self.group = cfg, quant, group
        self.rank, self.world = rank, world
        self.expert_map_E = expert_map_E.to(torch.int32)
        self.num_local_experts = int((self.expert_map_E >= 0).sum())
        self.timer = StageTimer(enabled=False)  # the layer hands its own over

    def quantize(self, x_TD: torch.Tensor, quant: QuantConfig | None = None) -> QTensor:
        """The recipe's activation quantization, timed as stage "dispatch.quantize"."""
        with self.timer.stage("dispatch.quantize"):
            return quantize_act(x_TD, self.quant if quant is None else quant)

    @classmethod
    def supports(cls, cfg: MoEConfig, quant: QuantConfig, device: torch.device,
                 world: int) -> str | None:
        """None if this backend can run here, else the reason it cannot."""
        return None

    def to_local(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Physical expert ids -> local ids (-1 when not on this rank or empty)."""
        m = self.expert_map_E.to(topk_ids.device)
        ids = topk_ids.long()
        local = m[ids.clamp(min=0)].to(topk_ids.dtype)
        return torch.where(ids >= 0, local, torch.full_like(local, -1))

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor):
        """-> (ExpertBatch, handle)"""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle) -> torch.Tensor:
        """-> out_TD: the weighted sum over slots, summed in fp32 (returned as fp32, or as bf16
        when the backend's own kernel already cast once: an extra fp32 copy would cost HBM time)"""
