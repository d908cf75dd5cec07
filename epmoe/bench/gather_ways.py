"""A symm backend's ways into the Triton experts, timed with the experts (one GPU, the
loopback world of 2 ranks, DeepSeek-V3 dims: hidden 7168, 256 experts, top-8, 128 local
experts a rank): the shared loop of `epmoe.bench.ll_gather` and `epmoe.bench.ht_gather`.

Each iteration runs both ranks' dispatch (every send, then every receive), the Triton experts
on each rank's batch and the combine, behind a device sleep so that the GPU, not the host's
launches, sets the pace; CUDA events around the dispatch and the experts, median over
iterations, per rank (the pair's time / 2). A way's cost to the step is dispatch + experts:
a copy the receive leaves out moves into GEMM1's row loads.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from epmoe.argtypes import at_least, int_list, name_list
from epmoe.bench.comm_loopback import HIDDEN, _cfg, routing
from epmoe.config import QuantConfig
from epmoe.outputs import dump_json

SPACER_CYCLES = 2_000_000  # ~1 ms of device sleep: longer than the host takes to issue a round


def random_weight(quant: QuantConfig, e: int, n: int, k: int, device):
    """Random [E, N, K] expert weights of the recipe (a timing stand-in: no checkpoint, no
    quantization pass over GBs; unit block scales), filled 8 experts at a time."""
    from epmoe.quant import FP8_DTYPE, QWeight

    r = quant.recipe
    if r == "w4a8_mxfp4":  # random e2m1 codes, two a byte
        data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    else:
        data = torch.empty(e, n, k, device=device,
                           dtype=torch.bfloat16 if r == "bf16" else FP8_DTYPE)
        for e0 in range(0, e, 8):
            data[e0:e0 + 8] = (torch.randn(min(8, e - e0), n, k, device=device)
                               / k ** 0.5).to(data.dtype)
    if r == "fp8_block":
        scale = torch.ones(e, n // 128, k // 128, device=device)
    elif r in ("mxfp8", "w4a8_mxfp4"):  # e8m0 per 32 columns: 2**0, or for the codes (|v|
        # up to 6) ~1 / (2 sqrt(k)), so that outputs stay O(1) as the others' do
        e8 = 127 if r == "mxfp8" else 126 - round(0.5 * math.log2(k))
        scale = torch.full((e, n, k // 32), e8, dtype=torch.uint8, device=device)
    else:
        scale = None
    return QWeight(data, scale, r)


def random_experts(cfg, quant: QuantConfig, e_l: int, device):
    """Triton experts over random weights (`random_weight`)."""
    from epmoe.experts.base import ExpertWeights
    from epmoe.experts.triton_experts import TritonExperts

    i, d = cfg.moe_intermediate, cfg.hidden
    w = ExpertWeights(random_weight(quant, e_l, 2 * i, d, device),
                      random_weight(quant, e_l, d, i, device),
                      torch.arange(e_l, device=device, dtype=torch.long))
    return TritonExperts(w, cfg, quant)


def measure(comm_cls, ways: dict, quant: QuantConfig, tokens: tuple, iters: int,
            world: int = 2) -> list[dict]:
    """ways: {name: SymmOptions knobs} -> a row per (way, tokens)."""
    from epmoe.comm.symm.loopback import loopback_combine, loopback_comms
    from epmoe.comm.symm.options import SymmOptions

    cfg = _cfg()
    experts = random_experts(cfg, quant, cfg.num_experts // world, "cuda")
    rows = []
    for way, kw in ways.items():
        _, comms = loopback_comms(comm_cls, cfg, quant, world, max(tokens), "cuda",
                                  options=SymmOptions(**kw))
        for c in comms:
            c.set_alignment(experts.alignment)
        gen = torch.Generator().manual_seed(0)
        for t in tokens:
            xs = [torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
                  for _ in range(world)]
            rt = [routing(t, gen, "cuda") for _ in range(world)]
            times = {"dispatch": [], "experts": []}
            for i in range(iters + 2):  # two warm-ups (compiles, autotune)
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                torch.cuda._sleep(SPACER_CYCLES)  # the GPU busy while the host issues: the
                ev[0].record()  # events then time the kernels, not the host's launches
                pend = [c.dispatch_send(x, r[0], r[1]) for c, x, r in zip(comms, xs, rt)]
                outs = [c.dispatch_recv(p) for c, p in zip(comms, pend)]
                ev[1].record()
                ys = [experts.run(b) for b, _ in outs]
                ev[2].record()
                loopback_combine(comms, ys, [h for _, h in outs])
                torch.cuda.synchronize()
                if i >= 2:
                    times["dispatch"].append(ev[0].elapsed_time(ev[1]) * 1e3 / world)
                    times["experts"].append(ev[1].elapsed_time(ev[2]) * 1e3 / world)
            for c in comms:
                c.check_errors()
            d, e = (statistics.median(times[k]) for k in ("dispatch", "experts"))
            rows.append(dict(recipe=quant.recipe, tokens=t, way=way, dispatch_us=d,
                             experts_us=e, total_us=d + e))
        del comms
        torch.cuda.empty_cache()
    return rows


def render(rows: list[dict], base_way: str) -> str:
    base = {(r["recipe"], r["tokens"]): r["total_us"] for r in rows if r["way"] == base_way}
    head = f"x {base_way}"
    out = [f"us per rank (median); {head}: (dispatch + experts) over the {base_way} way's",
           f"{'recipe':10} {'tokens':>6} {'way':9} {'dispatch':>9} {'experts':>9} "
           f"{'sum':>9} {head:>9}", "-" * 66]
    for r in rows:
        ratio = r["total_us"] / base[(r["recipe"], r["tokens"])]
        out.append(f"{r['recipe']:10} {r['tokens']:>6} {r['way']:9} {r['dispatch_us']:>9.1f} "
                   f"{r['experts_us']:>9.1f} {r['total_us']:>9.1f} {ratio:>9.3f}")
    return "\n".join(out)


def cli(prog: str, doc: str, comm_cls, ways: dict, base_way: str, tokens: tuple,
        argv=None) -> int:
    """The command line of a gather benchmark (`--tokens`, `--recipes`, `--iters`, `--json`)."""
    p = argparse.ArgumentParser(prog=prog, description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int_list(1), default=tokens,
                   help="tokens per rank, comma-separated")
    p.add_argument("--recipes", type=name_list(("fp8_block", "bf16")),
                   default=("fp8_block", "bf16"), help="comma-separated")
    p.add_argument("--iters", type=at_least(1), default=30)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the loopback world's kernels and the Triton experts)")
    rows = []
    for r in a.recipes:
        rows += measure(comm_cls, ways, QuantConfig(r), tuple(a.tokens), a.iters)
    print(render(rows, base_way))
    if a.json:
        with open(a.json, "w") as f:
            dump_json({"rows": rows, "device": torch.cuda.get_device_name()}, f)
    return 0
