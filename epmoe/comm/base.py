"""The comm contract: every dispatch/combine backend implements `Comm`.

    batch, handle = comm.dispatch(x_TD, topk_ids_TK, topk_weights_TK)
    y = experts.run(batch)                    # what y is depends on the batch type (below)
    out_TD = comm.combine(y, handle)          # bf16 [T, D]: this rank's tokens, sum_k w_k * y_k,
                                              # reduced in fp32 and cast once

A dispatch returns one of three batch types; each has one meaning:

| batch        | x                                   | experts return                          | top-k weights applied by    |
|--------------|-------------------------------------|-----------------------------------------|-----------------------------|
| TokenBatch   | [N, D] received tokens + local ids  | [N, D] per token, weighted sum over its | the experts' gather (it     |
|              |                                     | local experts (fp32 sum; fp32 or bf16)  | reduces over k)             |
| LayoutBatch  | [M, D] rows in the contiguous layout| [M, D] bf16 per row, unweighted         | combine                     |
| MaskedBatch  | [E_local, C, D] + counts_E          | [E_local, C, D] bf16, unweighted        | combine                     |

The rule: the top-k weights are applied where the reduction over k happens. Combine is the
inverse of dispatch; handles are frozen dataclasses private to their backend. Backends get a
`CommContext` (group, rank, world, device, worst-case tokens per rank, shared buffers) owned by
the Runtime.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Union

import torch

from epmoe.comm.context import CommContext
from epmoe.config import MoEConfig, QuantConfig
from epmoe.layout import ContiguousLayout
from epmoe.quant import QTensor
from epmoe.timing import StageTimer


@dataclass(frozen=True)
class TokenBatch:
    """Received tokens with their routing on this rank.

    x                QTensor [N, D], quantized per the recipe (scales travel with rows)
    topk_ids_NK      int32 [N, K] local expert ids, -1 = not on this rank
    topk_weights_NK  fp32 [N, K] the router's weights (the experts' gather applies them)
    """

    x: QTensor
    topk_ids_NK: torch.Tensor
    topk_weights_NK: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.x.data.shape[0]


@dataclass(frozen=True)
class LayoutBatch:
    """Rows already in the experts' contiguous layout (the receiver wrote them there).

    x       QTensor [M, D] (padding rows: any value)
    layout  ContiguousLayout: row -> local expert (-1 padding), groups aligned to the experts'
            GEMM alignment; its `inv_perm_NK` is the backend's business (combine reads it)
    rows_M  None, or int32 [M]: x is then [R, D] rows (each received once) and layout row m
            is x[rows_M[m]] (-1 on padding and on rows that never came); experts that gather
            their GEMM's rows read it so (`Experts.gathers_rows`)
    """

    x: QTensor
    layout: ContiguousLayout
    rows_M: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.x.data.shape[0] if self.rows_M is None else self.rows_M.shape[0]

    def copied(self) -> QTensor:
        """x as [M, D] layout rows (gathered through rows_M: a copy; padding rows hold some
        row of x), for consumers that do not gather."""
        return _gathered(self.x, self.rows_M)


@dataclass(frozen=True)
class MaskedBatch:
    """Per-expert rows for the masked (batched) grouped GEMM.

    x         QTensor [E_local, C, D] (rows past a count: any value)
    counts_E  int32 [E_local] valid rows per local expert (on the device: no host sync)
    rows_EC   None, or int32 [E_local, C]: x is then [R, D] rows (each received once) and
              masked row (e, c) is x[rows_EC[e, c]] for c < counts_E[e] (experts that gather
              their GEMM's rows read it so: `Experts.gathers_rows`)
    """

    x: QTensor
    counts_E: torch.Tensor
    rows_EC: torch.Tensor | None = None

    @property
    def shape_EC(self) -> tuple[int, int]:
        return tuple(self.rows_EC.shape if self.rows_EC is not None else self.x.data.shape[:2])

    @property
    def num_rows(self) -> int:
        e, c = self.shape_EC
        return e * c

    def copied(self) -> QTensor:
        """x as [E, C, D] rows (gathered through rows_EC: a copy; rows past a count hold
        some row of x), for consumers that do not gather."""
        return _gathered(self.x, self.rows_EC)


def _gathered(x: QTensor, rows: torch.Tensor | None) -> QTensor:
    """x's rows at `rows` (any shape; -1 and past the end read some row), or x itself."""
    if rows is None:
        return x
    at = rows.long().clamp(0, x.data.shape[0] - 1)
    return QTensor(x.data[at], None if x.scale is None else x.scale[at], x.recipe, x.group,
                   x.scale_fmt)


Batch = Union[TokenBatch, LayoutBatch, MaskedBatch]


def rows_shape(batch: Batch) -> tuple[int, ...]:
    """The leading shape of what the experts return for `batch` (its rows without D)."""
    if isinstance(batch, MaskedBatch):
        return batch.shape_EC
    return (batch.num_rows,)


class Comm(ABC):
    """A dispatch/combine backend bound to one rank's context and expert map.

    expert_map_E: int32 [E_physical] physical expert id -> local index on this rank, -1 elsewhere.
    """

    name: str = "?"

    def __init__(self, cfg: MoEConfig, quant: QuantConfig, expert_map_E: torch.Tensor,
                 ctx: CommContext | None = None):
        self.cfg, self.quant = cfg, quant
        self.ctx = ctx if ctx is not None else CommContext(device=expert_map_E.device)
        self.expert_map_E = expert_map_E.to(torch.int32)
        self.num_local_experts = int((self.expert_map_E >= 0).sum())
        slots = self.expert_map_E.shape[0]  # every slot here as itself: to_local is a no-op
        self._identity_map = torch.equal(self.expert_map_E.cpu(),
                                         torch.arange(slots, dtype=torch.int32))
        self.timer = StageTimer(enabled=False)  # the layer hands its own over

    @property
    def group(self):
        return self.ctx.group

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world(self) -> int:
        return self.ctx.world

    def quantize(self, x_TD: torch.Tensor, quant: QuantConfig | None = None) -> QTensor:
        """The recipe's activation quantization (one fused Triton pass on CUDA, the exact torch
        reference on CPU; bit-identical), timed as stage "dispatch.quantize"."""
        from epmoe.kernels.quantize import quantize_tokens

        with self.timer.stage("dispatch.quantize"):
            return quantize_tokens(x_TD.contiguous(), self.quant if quant is None else quant)

    @classmethod
    def supports(cls, cfg: MoEConfig, quant: QuantConfig, device: torch.device,
                 world: int) -> str | None:
        """None if this backend can run here, else the reason it cannot."""
        return None

    def to_local(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Physical expert ids -> local ids (-1 when not on this rank or empty); the ids
        themselves when this rank holds every slot as itself (ep 1: no launch, no copy)."""
        if self._identity_map:
            return topk_ids
        m = self.expert_map_E.to(topk_ids.device)
        ids = topk_ids.long()
        local = m[ids.clamp(min=0)].to(topk_ids.dtype)
        return torch.where(ids >= 0, local, torch.full_like(local, -1))

    def owner_of_slots(self) -> torch.Tensor:
        """int64 [E_physical]: the rank holding each physical slot (contiguous blocks of
        E_physical / world slots per rank, as every EP backend assumes)."""
        slots = self.expert_map_E.shape[0]
        if slots % self.world:
            raise ValueError(f"physical experts ({slots}) must be divisible by ep ({self.world})")
        return torch.arange(slots, device=self.expert_map_E.device) // (slots // self.world)

    def set_alignment(self, alignment: int) -> None:
        """The experts' GEMM row alignment (the runtime tells every comm; a backend that writes
        rows straight into the contiguous layout pads its groups to it)."""

    def check_errors(self) -> None:
        """Raise if a device-side wait of this backend timed out (may sync: the runtime calls
        it at a sync point it already has)."""

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor) -> tuple[Batch, object]:
        """-> (batch, handle)"""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle) -> torch.Tensor:
        """-> out_TD bf16 [T, D]: sum over this rank's tokens' slots of w_k * y_k, reduced in
        fp32 and cast once (see the table above for who applies the weights)."""
