"""`python -m epmoe.bench.ll_gather`: symm-ll's three ways into the Triton experts, timed with
the experts (one GPU, the loopback world of 2 ranks, DeepSeek-V3 dims: hidden 7168, 256
experts, top-8, 128 local experts a rank).

    direct    a row per (token, expert) stored into the peers' masked layout (the default)
    staged    ll_dedup: a token once per rank, the receive copies it into its experts' rows
    gathered  ll_dedup + ll_gather: the receive copies nothing; GEMM1 reads the staged rows
              through the index (`MaskedBatch.rows_EC`)

Each iteration runs both ranks' dispatch (every send, then every receive), the Triton experts
on each rank's batch and the combine, behind a device sleep so that the GPU, not the host's
launches, sets the pace; CUDA events around the dispatch and the experts, median over
iterations, per rank (the pair's time / 2). A way's cost to the step is dispatch +
experts: the staged copy moves into the receive, the gather into GEMM1's row loads.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from epmoe.argtypes import at_least, int_list, name_list
from epmoe.bench.comm_loopback import HIDDEN, _cfg, routing
from epmoe.config import QuantConfig
from epmoe.outputs import dump_json

SPACER_CYCLES = 2_000_000  # ~1 ms of device sleep: longer than the host takes to issue a round
WAYS = {"direct": {}, "staged": {"ll_dedup": True},
        "gathered": {"ll_dedup": True, "ll_gather": True}}


def random_weight(quant: QuantConfig, e: int, n: int, k: int, device):
    """Random [E, N, K] expert weights of the recipe (a timing stand-in: no checkpoint, no
    quantization pass over GBs; unit block scales), filled 8 experts at a time."""
    from epmoe.quant import FP8_DTYPE, QWeight

    fp8 = quant.recipe == "fp8_block"
    data = torch.empty(e, n, k, device=device, dtype=FP8_DTYPE if fp8 else torch.bfloat16)
    for e0 in range(0, e, 8):
        data[e0:e0 + 8] = (torch.randn(min(8, e - e0), n, k, device=device)
                           / k ** 0.5).to(data.dtype)
    scale = torch.ones(e, n // 128, k // 128, device=device) if fp8 else None
    return QWeight(data, scale, quant.recipe)


def random_experts(cfg, quant: QuantConfig, e_l: int, device):
    """Triton experts over random weights (`random_weight`)."""
    from epmoe.experts.base import ExpertWeights
    from epmoe.experts.triton_experts import TritonExperts

    i, d = cfg.moe_intermediate, cfg.hidden
    w = ExpertWeights(random_weight(quant, e_l, 2 * i, d, device),
                      random_weight(quant, e_l, d, i, device),
                      torch.arange(e_l, device=device, dtype=torch.long))
    return TritonExperts(w, cfg, quant)


def measure(quant: QuantConfig, tokens: tuple, iters: int, world: int = 2) -> list[dict]:
    from epmoe.comm.symm.ll import SymmLowLatencyComm
    from epmoe.comm.symm.loopback import loopback_combine, loopback_comms
    from epmoe.comm.symm.options import SymmOptions

    cfg = _cfg()
    experts = random_experts(cfg, quant, cfg.num_experts // world, "cuda")
    rows = []
    for way, kw in WAYS.items():
        _, comms = loopback_comms(SymmLowLatencyComm, cfg, quant, world, max(tokens), "cuda",
                                  options=SymmOptions(**kw))
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


def render(rows: list[dict]) -> str:
    base = {(r["recipe"], r["tokens"]): r["total_us"] for r in rows if r["way"] == "staged"}
    out = ["us per rank (median); x staged: (dispatch + experts) over the staged way's",
           f"{'recipe':10} {'tokens':>6} {'way':9} {'dispatch':>9} {'experts':>9} "
           f"{'sum':>9} {'x staged':>9}", "-" * 66]
    for r in rows:
        ratio = r["total_us"] / base[(r["recipe"], r["tokens"])]
        out.append(f"{r['recipe']:10} {r['tokens']:>6} {r['way']:9} {r['dispatch_us']:>9.1f} "
                   f"{r['experts_us']:>9.1f} {r['total_us']:>9.1f} {ratio:>9.3f}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.ll_gather", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int_list(1), default=(1, 8, 128, 256),
                   help="tokens per rank, comma-separated")
    p.add_argument("--recipes", type=name_list(("fp8_block", "bf16")),
                   default=("fp8_block", "bf16"), help="comma-separated")
    p.add_argument("--iters", type=at_least(1), default=30)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    recipes = a.recipes
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the loopback world's kernels and the Triton experts)")
    rows = []
    for r in recipes:
        rows += measure(QuantConfig(r), tuple(a.tokens), a.iters)
    print(render(rows))
    if a.json:
        with open(a.json, "w") as f:
            dump_json({"rows": rows, "device": torch.cuda.get_device_name()}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
