"""allgather: every rank sees every token (all-gather of tokens + routing), runs its local
experts on all of them, and a reduce-scatter returns each rank's tokens summed over ranks
(fp32 partials, summed in fp32, cast to bf16 once).

Simple and robust; bytes on the wire grow with world size (use all2all / DeepEP at scale).
Ranks may hold different token counts: rows are padded to the largest count (ids -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.comm.base import Comm, TokenBatch
from epmoe.comm.wire import all_gather_rows, reduce_scatter_single, wire_quant
from epmoe.quant import QTensor


@dataclass(frozen=True)
class AllGatherHandle:
    """num_tokens  this rank's T;  max_tokens  rows per rank after padding."""

    num_tokens: int
    max_tokens: int


class AllGatherComm(Comm):
    name = "allgather"

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        t = x_TD.shape[0]
        sizes = torch.tensor([t], dtype=torch.long, device=x_TD.device)
        all_sizes = all_gather_rows(sizes, self.world, self.group)
        tmax = int(all_sizes.max())
        xq = self.quantize(x_TD, wire_quant(self.quant))
        ids, w = topk_ids_TK, topk_weights_TK.float()
        if tmax > t:  # pad to equal blocks: empty slots
            pad = tmax - t
            xq = QTensor(torch.cat([xq.data, xq.data.new_zeros(pad, *xq.data.shape[1:])]),
                         None if xq.scale is None else
                         torch.cat([xq.scale, xq.scale.new_ones(pad, *xq.scale.shape[1:])]),
                         xq.recipe, xq.group, xq.scale_fmt)
            ids = torch.cat([ids, ids.new_full((pad, ids.shape[1]), -1)])
            w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
        g = self.world
        data = all_gather_rows(xq.data, g, self.group)
        scale = None if xq.scale is None else all_gather_rows(xq.scale, g, self.group)
        all_ids = all_gather_rows(ids, g, self.group)
        all_w = all_gather_rows(w, g, self.group)
        batch = TokenBatch(QTensor(data, scale, xq.recipe, xq.group, xq.scale_fmt),
                           self.to_local(all_ids), all_w)
        return batch, AllGatherHandle(t, tmax)

    def combine(self, expert_out, handle):
        full = expert_out.float().contiguous()
        out = torch.empty((handle.max_tokens, full.shape[1]), dtype=torch.float32,
                          device=full.device)
        reduce_scatter_single(out, full, group=self.group)
        return out[:handle.num_tokens].to(torch.bfloat16)
