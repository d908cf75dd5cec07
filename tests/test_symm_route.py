"""symm-ht's sender routing table (epmoe.comm.symm.route) over several token chunks, against a
plain-Python count (Triton interpreter): positions per expert in token order, the dedup index
per destination rank, and the totals the count block carries."""

from __future__ import annotations

import pytest
import torch

from epmoe.comm.symm.route import SendRouter

pytestmark = pytest.mark.interpreter  # the routing kernels on CPU tensors


def test_route_ranks_pairs_and_messages_in_token_order_across_chunks(seed):
    gen = torch.Generator().manual_seed(seed)
    t, k, e, world = 150, 4, 16, 2  # 3 chunks of 64 tokens under the interpreter
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
    ids[torch.rand(t, k, generator=gen) < 0.3] = -1  # empty slots, some empty tokens
    rt = SendRouter(e, world, k)(ids)
    e_l = e // world
    seen = [0] * e
    sent = [0] * world
    for n in range(t):
        for j in range(k):
            x = int(ids[n, j])
            assert int(rt.pos_TK[n, j]) == (-1 if x < 0 else seen[x]), (n, j)
            if x >= 0:
                seen[x] += 1
        for d in range(world):
            goes = bool(((ids[n] >= 0) & (ids[n] // e_l == d)).any())
            assert int(rt.msg_TW[n, d]) == (sent[d] if goes else -1), (n, d)
            if goes:  # the inverse: rank d's sent[d]-th token is n
                assert int(rt.tok_WT[d, sent[d]]) == n, (n, d)
            sent[d] += goes
    assert rt.total_C.tolist() == seen + sent
