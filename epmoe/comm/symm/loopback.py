"""The loopback world driver: W ranks of a symm backend in one process (tests, one-GPU bench).

    world, comms = loopback_comms(SymmHighThroughputComm, cfg, quant, world=2, max_tokens=64)
    outs = loopback_dispatch(comms, xs, ids, ws)          # [(batch, handle)] per rank
    ys = [experts[r].run(outs[r][0]) for r in range(2)]
    res = loopback_combine(comms, ys, [h for _, h in outs])

Each phase runs rank by rank (every rank's send, then every rank's receive), so no spin waits
for a rank that has not run; the receive halves check each rank's error record. With
`streams` (CUDA), every rank's send and receive go on its own stream instead, so the ranks run
concurrently and the spins really wait on each other.
"""

from __future__ import annotations

import torch

from epmoe.comm.context import CommContext
from epmoe.comm.symm.arena import ArenaResource, LoopbackWorld


def loopback_comms(cls, cfg, quant, world: int, max_tokens: int, device="cpu", **kw):
    """-> (LoopbackWorld, [comm of rank r]); experts in contiguous blocks of E / world."""
    layout = cls.arena_layout(cfg, quant, world, max_tokens)
    lw = LoopbackWorld(layout, device)
    e_l = cfg.num_experts // world
    comms = []
    for r in range(world):
        ctx = CommContext(None, r, world, device, max_tokens_per_rank=max_tokens)
        ctx.resource(cls.arena_key, lambda r=r: ArenaResource(lw.rank(r)))
        expert_map = torch.full((cfg.num_experts,), -1, dtype=torch.int32)
        expert_map[r * e_l:(r + 1) * e_l] = torch.arange(e_l, dtype=torch.int32)
        comms.append(cls(cfg, quant, expert_map.to(device), ctx, **kw))
    return lw, comms


def _run(comms, send, recv, streams):
    if not streams:
        pending = [send(r) for r in range(len(comms))]
        out = [recv(r, p) for r, p in enumerate(pending)]
        for c in comms:
            c.check_errors()
        return out
    main = torch.cuda.current_stream()
    ss = [torch.cuda.Stream() for _ in comms]
    out = []
    for r, s in enumerate(ss):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            out.append(recv(r, send(r)))
    for s in ss:
        main.wait_stream(s)
    return out


def loopback_dispatch(comms, xs, ids, ws, streams: bool = False):
    return _run(comms, lambda r: comms[r].dispatch_send(xs[r], ids[r], ws[r]),
                lambda r, p: comms[r].dispatch_recv(p), streams)


def loopback_combine(comms, ys, handles, streams: bool = False):
    return _run(comms, lambda r: comms[r].combine_send(ys[r], handles[r]),
                lambda r, sent: comms[r].combine_recv(sent), streams)


__all__ = ["loopback_comms", "loopback_dispatch", "loopback_combine"]
