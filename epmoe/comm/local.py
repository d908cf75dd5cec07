"""No token exchange: quantize, map ids to local experts, and hand the tokens over."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.comm.base import Comm, TokenBatch


@dataclass(frozen=True)
class LocalHandle:
    """num_tokens  T, the rows combine returns."""

    num_tokens: int


class LocalComm(Comm):
    name = "local"

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        batch = TokenBatch(self.quantize(x_TD), self.to_local(topk_ids_TK),
                           topk_weights_TK.float())
        return batch, LocalHandle(x_TD.shape[0])

    def combine(self, expert_out, handle):
        if expert_out.shape[0] != handle.num_tokens:
            raise ValueError(f"expert output has {expert_out.shape[0]} rows, dispatch sent "
                             f"{handle.num_tokens}")
        return expert_out.to(torch.bfloat16)
