"""symm-ht / symm-ll in the loopback world for `python -m epmoe.bench.comm` on one GPU: every
rank's arena on the device, rank by rank, captured as CUDA graphs and replayed; the kernels'
cost with no link, per rank (phase time / W; device time: the host's graph launch is hidden
behind a device sleep, as it is inside a captured decode step). `--check` compares each
combine bit for bit with all2all's numerics in torch; `--breakdown` adds each kernel's device
time."""

from __future__ import annotations

import argparse

import statistics

import torch

from epmoe.bench.comm_ranks import sends_once_per_rank, sent_rows
from epmoe.comm.base import rows_shape
from epmoe.config import MoEConfig, QuantConfig

HIDDEN, NUM_EXPERTS, TOP_K = 7168, 256, 8
# ~50 us of device sleep before each timed pair of graph replays: without it the first event
# fires on an idle stream and the dispatch time includes the host's graph launch latency.
SPACER_CYCLES = 100_000


def _cfg() -> MoEConfig:
    return MoEConfig("bench-dsv3", hidden=HIDDEN, moe_intermediate=2048,
                     num_experts=NUM_EXPERTS, top_k=TOP_K)


def routing(t: int, gen: torch.Generator, device):
    """Uniform top-8 of 256 (random scores), weights in (0.1, 1.1)."""
    ids = torch.rand(t, NUM_EXPERTS, generator=gen).topk(TOP_K, dim=1).indices
    return ids.to(torch.int32).to(device), (torch.rand(t, TOP_K, generator=gen) + 0.1).to(device)


def traffic(ids_per_rank, world: int, ll: bool, dedup_link: bool) -> tuple[float, float]:
    """Rows a rank receives on average: (all incl. its own, only from other ranks); the mean
    over sources of what each sends (comm_ranks.sent_rows)."""
    sent = [sent_rows(ids, world, NUM_EXPERTS, s, ll, dedup_link)
            for s, ids in enumerate(ids_per_rank)]
    return sum(a for a, _ in sent) / world, sum(b for _, b in sent) / world


def _capture(fn):
    """-> (graph, fn's result) captured on a side stream (nothing runs until replay)."""
    main = torch.cuda.current_stream()
    s = torch.cuda.Stream()
    s.wait_stream(main)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            res = fn()
    main.wait_stream(s)
    return g, res


def _median_us(pairs) -> float:
    return statistics.median(a.elapsed_time(b) for a, b in pairs) * 1e3


def _options(opt_kw: dict):
    """SymmOptions from the knobs given (only those: the bench also runs older trees)."""
    from epmoe.comm.symm.options import SymmOptions

    kw = {k: v for k, v in opt_kw.items() if v}
    for k in ON_OFF:
        if k in kw:
            kw[k] = kw[k] == 1
    return SymmOptions(**kw)


def kernel_breakdown(run, iters: int, world: int) -> dict:
    """{kernel name: us per call and rank} of `run()` (eager launches), from torch.profiler's
    CUDA kernel records (device time only: launch gaps excluded)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    out: dict = {}
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dev_us and ev.count:
            out[ev.key[:60]] = round(dev_us / iters / world, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def check_ht(comms, ids, ws, outs, ys, res) -> str:
    """symm-ht's combine against all2all's numerics in torch (fp32 mul then add per slot in k
    order, bf16 per (token, rank), fp32 sum in rank order, one cast): 'ok' or what differs."""
    tmax = comms[0].shape.max_tokens
    world, dim, dev = len(comms), ys[0].shape[-1], ys[0].device
    parts = [torch.zeros(world, i.shape[0], dim, device=dev) for i in ids]
    for r, (_, h) in enumerate(outs):
        n = int(h.recv.info_I[0])
        inv, w, st = h.recv.inv_NK[:n].long(), h.recv.w_NK[:n], h.recv.src_tok_N[:n].long()
        acc = torch.zeros(n, dim, device=dev)
        for k in range(inv.shape[1]):
            v = inv[:, k] >= 0
            acc = torch.where(v[:, None], acc + w[:, k, None] * ys[r][inv[:, k].clamp(min=0)]
                              .float(), acc)
        for s in range(world):
            sel = st // tmax == s
            parts[s][r, st[sel] % tmax] = acc[sel].to(torch.bfloat16).float()
    bad = []
    for s, (_, h) in enumerate(outs):
        msg = h.msg_TW.long()
        acc = torch.zeros(ids[s].shape[0], dim, device=dev)
        for r in range(world):
            acc = torch.where(msg[:, r, None] >= 0, acc + parts[s][r], acc)
        if not torch.equal(acc.to(torch.bfloat16), res[s]):
            bad.append(f"rank {s}: {int((acc.to(torch.bfloat16) != res[s]).sum())} differ")
    return "; ".join(bad) or "ok"


def check_ll(comms, ids, ws, outs, ys, res) -> str:
    """symm-ll's combine against all2all's numerics in torch (per rank the fp32 sum of w_k *
    y_k over the token's slots there in k order, bf16, then an fp32 sum over ranks in rank
    order, one cast; rows found through the arena's meta words): 'ok' or what differs."""
    sh = comms[0].shape
    tmax, k_, c_ = sh.max_tokens, sh.top_k, sh.capacity
    world, dim, dev = len(comms), ys[0].shape[-1], ys[0].device
    parts = [torch.zeros(world, i.shape[0], dim, device=dev) for i in ids]
    for r, (batch, _) in enumerate(outs):
        meta = comms[r].arena.view.words("ll_meta").view(-1, c_).long()
        used = torch.arange(c_, device=dev)[None, :] < batch.counts_E[:, None]
        m = meta[used]
        src, t, k = m // (tmax * k_), (m // k_) % tmax, m % k_
        y = ys[r][used].float()
        for s in range(world):
            acc = torch.zeros(ids[s].shape[0], dim, device=dev)
            for kk in range(k_):  # k order: at most one row per (token, k)
                sel = (src == s) & (k == kk)
                w = ws[s][t[sel], kk].float()[:, None]
                acc[t[sel]] = acc[t[sel]] + w * y[sel]
            parts[s][r] = acc.to(torch.bfloat16).float()
    bad = []
    for s in range(world):
        acc = torch.zeros(ids[s].shape[0], dim, device=dev)
        e_l = comms[s].e_l
        for r in range(world):
            went = ((ids[s] >= 0) & (ids[s] // e_l == r)).any(1)
            acc = torch.where(went[:, None], acc + parts[s][r], acc)
        if not torch.equal(acc.to(torch.bfloat16), res[s]):
            bad.append(f"rank {s}: {int((acc.to(torch.bfloat16) != res[s]).sum())} differ")
    return "; ".join(bad) or "ok"


def bench_loopback(mode: str, quant: QuantConfig, world: int, tokens: tuple, iters: int,
                   opt_kw: dict | None, breakdown: bool, emit, check: bool = False) -> None:
    """symm-ht / symm-ll on one GPU, arena sized for max(tokens) (one compile per recipe).
    opt_kw: SymmOptions knobs (num_sms, recv_sms, tile_tokens, ...); emit(row, extra) gets each
    row (times, traffic) and its extras (options, kernel breakdown, check) as soon as it is
    measured."""
    from epmoe.comm.symm.ht import SymmHighThroughputComm
    from epmoe.comm.symm.ll import SymmLowLatencyComm
    from epmoe.comm.symm.loopback import (loopback_combine, loopback_comms,
                                          loopback_dispatch)

    opt_kw = dict(opt_kw or {})
    opts = _options(opt_kw)
    cls = SymmHighThroughputComm if mode == "ht" else SymmLowLatencyComm
    cfg = _cfg()
    _, comms = loopback_comms(cls, cfg, quant, world, max(tokens), "cuda", options=opts)
    gen = torch.Generator().manual_seed(0)
    d = HIDDEN
    for t in tokens:
        xs = [torch.randn(t, d, generator=gen).to(torch.bfloat16).cuda() for _ in range(world)]
        rt = [routing(t, gen, "cuda") for _ in range(world)]
        ids, ws = [r[0] for r in rt], [r[1] for r in rt]
        def dispatch():
            if opts.pipelined:  # each rank's one kernel on its stream: the ranks overlap
                return loopback_dispatch(comms, xs, ids, ws, streams=True)
            pend = [c.dispatch_send(x, i, w) for c, x, i, w in zip(comms, xs, ids, ws)]
            return [c.dispatch_recv(p_) for c, p_ in zip(comms, pend)]

        def combine(outs, ys):
            if opts.pipelined:  # as the dispatch: each rank's one kernel on its stream
                return loopback_combine(comms, ys, [h for _, h in outs], streams=True)
            sent = [c.combine_send(y, h) for c, y, (_, h) in zip(comms, ys, outs)]
            return [c.combine_recv(s_) for c, s_ in zip(comms, sent)]

        outs = dispatch()  # warm-up (compiles), then stand-in expert outputs of the shape
        ys = [torch.randn(rows_shape(b) + (d,), device="cuda").to(torch.bfloat16)
              for b, _ in outs]
        res = combine(outs, ys)
        verdict = (check_ht if mode == "ht" else check_ll)(comms, ids, ws, outs, ys, res) \
            if check else None
        kernels = None
        if breakdown:
            kernels = kernel_breakdown(lambda: combine(dispatch(), ys), 3, world)
        g_disp, outs = _capture(dispatch)
        g_comb, _ = _capture(lambda: combine(outs, ys))
        times = []
        for it in range(iters + 3):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            torch.cuda._sleep(SPACER_CYCLES)  # the GPU busy while the host enqueues both
            ev[0].record()
            g_disp.replay()
            ev[1].record()
            g_comb.replay()
            ev[2].record()
            if it >= 3:
                times.append(ev)
        torch.cuda.synchronize()
        for c in comms:
            c.check_errors()
        del g_disp, g_comb, outs, ys
        disp = _median_us((e[0], e[1]) for e in times) / world
        comb = _median_us((e[1], e[2]) for e in times) / world
        all_rows, link_rows = traffic(ids, world, mode == "ll", sends_once_per_rank(comms[0]))
        emit(dict(backend=cls.name, recipe=quant.recipe, tokens=t, world=world,
                  where=f"loopback {world} ranks / 1 GPU", dispatch_us=disp, combine_us=comb,
                  rows=all_rows, link_rows=link_rows,
                  sms="/".join(str(n) for n in comms[0].ctas())),
             dict(options=opt_kw, kernels=kernels, check=verdict))
    del comms
    torch.cuda.empty_cache()


KNOBS = ("num_sms", "recv_sms", "tile_tokens", "chunk_cols", "num_warps", "pipelined",
         "chunk_rows", "ll_dedup", "ll_gather", "ht_gather")
ON_OFF = ("pipelined", "ll_dedup", "ll_gather", "ht_gather")  # 1: on, 2: off (0: default)


def sweep_spec(spec: str) -> list[dict]:
    """"24:0:0,32:132:2:512:4" -> [{num_sms, recv_sms, tile_tokens, chunk_cols, num_warps,
    pipelined, chunk_rows, ll_dedup, ll_gather, ht_gather}] (missing or 0: the default;
    pipelined 1:
    symm-ht's one-kernel dispatch and combine, ranks on their own streams; 2: two launches,
    send then receive; ll_dedup 1: symm-ll sends a token once per rank, 2: once per expert;
    ll_gather 1: with ll_dedup, the receive copies no row, the batch is indexed; ht_gather
    1: symm-ht's receive writes the layout's index, not its rows). An
    argparse type: a malformed item is `argparse.ArgumentTypeError` naming it."""
    out = []
    for item in filter(None, spec.split(",")):
        try:
            vals = [int(v) for v in item.split(":")]
        except ValueError:
            vals = []
        if not 1 <= len(vals) <= len(KNOBS) or min(vals) < 0:
            raise argparse.ArgumentTypeError(
                f"item {item!r}: 1 to {len(KNOBS)} whole numbers >= 0 ({':'.join(KNOBS)})")
        knobs = dict(zip(KNOBS, vals + [0] * (len(KNOBS) - len(vals))))
        bad = [k for k in ON_OFF if knobs[k] not in (0, 1, 2)]
        if bad:
            raise argparse.ArgumentTypeError(f"item {item!r}: {', '.join(bad)} must be 0 "
                                             f"(default), 1 (on) or 2 (off)")
        out.append(knobs)
    return out
