"""all2all: each token travels once to every rank that owns one of its experts
(`all_to_all_single` with split sizes), and its partial results travel back.

The portable reference for the DeepEP backends; runs on gloo (CPU) and NCCL (GPU).
dispatch: quantize -> per-destination token lists -> exchange counts -> exchange rows, scales,
global ids and weights -> ids to local. combine: partial sums back (bf16 on the wire, as
DeepEP), summed per token in fp32 and cast to bf16 once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe.comm.base import Comm, TokenBatch
from epmoe.comm.wire import all_to_all_qtensor, all_to_all_rows, wire_quant


@dataclass(frozen=True)
class All2AllHandle:
    """send_token_T  int64 [S]: the local token of each sent row, rows grouped by destination
    send_splits / recv_splits: rows sent to / received from each rank
    num_tokens: this rank's T"""

    send_token_T: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    num_tokens: int


class All2AllComm(Comm):
    name = "all2all"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.owner_E = self.owner_of_slots()

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        t = x_TD.shape[0]
        dev = x_TD.device
        ids = topk_ids_TK.long()
        owner = torch.where(ids >= 0, self.owner_E.to(dev)[ids.clamp(min=0)],
                            torch.full_like(ids, -1))
        to_rank = torch.zeros(t, self.world, dtype=torch.bool, device=dev)
        valid = owner >= 0
        rows = torch.arange(t, device=dev)[:, None].expand_as(owner)
        to_rank[rows[valid], owner[valid]] = True
        # rows grouped by destination rank, token order within each destination
        dst, tok = to_rank.T.nonzero(as_tuple=True)
        send_splits = torch.bincount(dst, minlength=self.world)
        recv_splits = torch.empty_like(send_splits)
        dist.all_to_all_single(recv_splits, send_splits, group=self.group)
        ss, rs = send_splits.tolist(), recv_splits.tolist()

        xq = self.quantize(x_TD, wire_quant(self.quant))
        send_x = xq.index_select(tok)
        recv_x = all_to_all_qtensor(send_x, ss, rs, self.group)
        recv_ids = all_to_all_rows(topk_ids_TK[tok].to(torch.int32), ss, rs, self.group)
        recv_w = all_to_all_rows(topk_weights_TK[tok].float(), ss, rs, self.group)
        batch = TokenBatch(recv_x, self.to_local(recv_ids), recv_w)
        return batch, All2AllHandle(tok, tuple(ss), tuple(rs), t)

    def combine(self, expert_out, handle):
        back = all_to_all_rows(expert_out.to(torch.bfloat16), list(handle.recv_splits),
                               list(handle.send_splits), self.group)
        out = torch.zeros((handle.num_tokens, back.shape[1]), dtype=torch.float32,
                          device=back.device)
        # one block per source rank, in rank order: a token appears at most once per block, so
        # the fp32 sum has a fixed order on every device (bit-reproducible, also on CUDA)
        start = 0
        for n in handle.send_splits:
            if n:
                out.index_add_(0, handle.send_token_T[start:start + n],
                               back[start:start + n].float())
            start += n
        return out.to(torch.bfloat16)
