"""No token exchange: quantize, map ids to local experts, and hand the tokens over."""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.comm.base import Comm, ExpertBatch


@dataclass(frozen=True)
class LocalHandle:
    """num_tokens  T, the rows combine returns."""

    num_tokens: int


class LocalComm(Comm):
    name = "local"

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        batch = ExpertBatch("tokens", self.quantize(x_TD), self.to_local(topk_ids_TK),
                            topk_weights_TK)
        return batch, LocalHandle(x_TD.shape[0])

    def combine(self, expert_out, handle):
        assert expert_out.shape[0] == handle.num_tokens
        return expert_out.float()
