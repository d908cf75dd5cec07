"""Comm benchmark: dispatch and combine of every backend at DeepSeek-V3 shapes (hidden 7168,
256 experts, top-8, uniform routing), HT at 512..8192 tokens per rank, LL at 1..256, bf16 and
fp8 (1x128, fp32 scales), with the ratio to DeepEP measured in the same run where it can run.

    python -m epmoe.bench.comm [--json FILE] [--auto-table FILE] [--world 2] [--quick]

One GPU: symm-ht / symm-ll run in the loopback world (W ranks' arenas on one GPU, rank by rank):
the kernels' cost without a link, per rank (phase time / W); all2all and DeepEP need >= 2 GPUs
and are listed as not run. GB/s in two conventions: "all" = every received row incl. the
rank's own (DeepEP's tests; LL: every (token, k)), "link" = only rows that cross to another
rank. SMs: the persistent grid of the symm kernels. Times: median of CUDA-event timings.
`--auto-table` writes the per-token-count table `--backend auto` reads (only figures that
compare backends on real links belong in it: a loopback run writes none, and says so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from epmoe.config import MoEConfig, QuantConfig

HIDDEN, NUM_EXPERTS, TOP_K = 7168, 256, 8
HT_TOKENS = (512, 1024, 2048, 4096, 8192)
LL_TOKENS = (1, 8, 32, 128, 256)


@dataclass(frozen=True)
class Row:
    """One (backend, recipe, tokens) case; times in us per rank, GB/s per rank."""

    backend: str
    recipe: str
    tokens: int
    world: int
    where: str
    dispatch_us: float
    combine_us: float
    dispatch_gbs_all: float
    dispatch_gbs_link: float
    combine_gbs_all: float
    combine_gbs_link: float
    sms: int
    vs_deepep_dispatch: float | None = None
    vs_deepep_combine: float | None = None


def _cfg() -> MoEConfig:
    return MoEConfig("bench-dsv3", hidden=HIDDEN, moe_intermediate=2048,
                     num_experts=NUM_EXPERTS, top_k=TOP_K)


def routing(t: int, gen: torch.Generator, device):
    """Uniform top-8 of 256 (random scores), weights in (0.1, 1.1)."""
    ids = torch.rand(t, NUM_EXPERTS, generator=gen).topk(TOP_K, dim=1).indices
    return ids.to(torch.int32).to(device), (torch.rand(t, TOP_K, generator=gen) + 0.1).to(device)


def traffic(ids_per_rank, world: int, ll: bool) -> tuple[float, float]:
    """Rows a rank receives on average: (all incl. its own, only from other ranks). HT counts a
    token once per destination rank; LL counts every (token, k)."""
    e_l = NUM_EXPERTS // world
    all_rows = link_rows = 0
    for s, ids in enumerate(ids_per_rank):
        owner = ids.long().cpu() // e_l
        for d in range(world):
            hit = owner == d
            n = int(hit.sum()) if ll else int(hit.any(1).sum())
            all_rows += n
            link_rows += n if d != s else 0
    return all_rows / world, link_rows / world


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


def bench_loopback(mode: str, quant: QuantConfig, world: int, tokens: tuple, num_sms: int,
                   iters: int) -> list[Row]:
    """symm-ht / symm-ll on one GPU, arena sized for max(tokens) (one compile per recipe)."""
    from epmoe.comm.symm.ht import SymmHighThroughputComm
    from epmoe.comm.symm.ll import SymmLowLatencyComm
    from epmoe.comm.symm.loopback import loopback_comms
    from epmoe.comm.symm.options import SymmOptions

    cls = SymmHighThroughputComm if mode == "ht" else SymmLowLatencyComm
    cfg = _cfg()
    _, comms = loopback_comms(cls, cfg, quant, world, max(tokens), "cuda",
                              options=SymmOptions(num_sms=num_sms))
    gen = torch.Generator().manual_seed(0)
    rows = []
    d = HIDDEN
    row_bytes = d * 2 if quant.recipe == "bf16" else d + d // 128 * 4
    for t in tokens:
        xs = [torch.randn(t, d, generator=gen).to(torch.bfloat16).cuda() for _ in range(world)]
        rt = [routing(t, gen, "cuda") for _ in range(world)]
        ids, ws = [r[0] for r in rt], [r[1] for r in rt]
        def dispatch():
            pend = [c.dispatch_send(x, i, w) for c, x, i, w in zip(comms, xs, ids, ws)]
            return [c.dispatch_recv(p_) for c, p_ in zip(comms, pend)]

        def combine(outs, ys):
            for c, y, (_, h) in zip(comms, ys, outs):
                c.combine_send(y, h)
            return [c.combine_recv(h) for c, (_, h) in zip(comms, outs)]

        outs = dispatch()  # warm-up (compiles), then stand-in expert outputs of the shape
        ys = [torch.randn(b.x.data.shape[:-1] + (d,), device="cuda").to(torch.bfloat16)
              for b, _ in outs]
        combine(outs, ys)
        g_disp, outs = _capture(dispatch)
        g_comb, _ = _capture(lambda: combine(outs, ys))
        times = []
        for it in range(iters + 3):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
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
        all_rows, link_rows = traffic(ids, world, mode == "ll")
        gbs = lambda n, b, us: n * b / us / 1e3  # noqa: E731
        rows.append(Row(cls.name, quant.recipe, t, world, f"loopback {world} ranks / 1 GPU",
                        disp, comb, gbs(all_rows, row_bytes, disp),
                        gbs(link_rows, row_bytes, disp), gbs(all_rows, d * 2, comb),
                        gbs(link_rows, d * 2, comb), num_sms))
    return rows


def auto_table(rows: list[Row]) -> dict:
    """The table `--backend auto` reads: per backend and recipe, (tokens, dispatch + combine
    us) measured on real links. Loopback rows are not comparable with other backends' link
    times, so they are left out."""
    real = [r for r in rows if not r.where.startswith("loopback")]
    table: dict = {}
    for r in real:
        table.setdefault(r.backend, {}).setdefault(r.recipe, []).append(
            [r.tokens, round(r.dispatch_us + r.combine_us, 1)])
    return {"world": rows[0].world if rows else 0, "entries": table,
            "note": "dispatch + combine us per rank, DeepSeek-V3 shapes"}


def _fmt(rows: list[Row]) -> str:
    """A table that fits 80 columns."""
    head = f"{'backend':<9} {'rec':<4} {'tok':>5} {'disp us':>8} {'GB/s all/link':>13} " \
           f"{'comb us':>8} {'GB/s all/link':>13} {'SMs':>3}"
    lines = [head, "-" * len(head)]
    for r in rows:
        rec = "bf16" if r.recipe == "bf16" else "fp8"
        lines.append(f"{r.backend:<9} {rec:<4} {r.tokens:>5} {r.dispatch_us:>8.1f} "
                     f"{r.dispatch_gbs_all:>6.0f}/{r.dispatch_gbs_link:<6.0f} "
                     f"{r.combine_us:>8.1f} {r.combine_gbs_all:>6.0f}/{r.combine_gbs_link:<6.0f} "
                     f"{r.sms:>3}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results as JSON to this file")
    p.add_argument("--auto-table", help="write the table --backend auto reads to this file")
    p.add_argument("--world", type=int, default=2, help="ranks (loopback ranks on one GPU)")
    p.add_argument("--num-sms", type=int, default=24)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="4096 (HT) and 128 (LL) tokens only")
    p.add_argument("--only", choices=("ht", "ll"), help="one mode only")
    p.add_argument("--recipes", default="bf16,fp8_block", help="comma-separated recipes")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.comm needs CUDA (the CPU loopback world is for tests: tests/test_symm_*)")
        return 2
    ht, ll = ((4096,), (128,)) if a.quick else (HT_TOKENS, LL_TOKENS)
    gpus = torch.cuda.device_count()
    notes = []
    if gpus < 2:
        notes.append(f"{gpus} GPU: all2all, deepep-ht and deepep-ll need >= 2 GPUs (one rank "
                     f"per GPU) and were not run; symm-* ran in the loopback world, so there "
                     f"is no same-run DeepEP ratio")
    else:
        notes.append("real-rank runs of every backend are the 2-GPU issue's bench; this run "
                     "measured the loopback world")
    rows: list[Row] = []
    for recipe in a.recipes.split(","):
        q = QuantConfig(recipe)
        if a.only != "ll":
            rows += bench_loopback("ht", q, a.world, ht, a.num_sms, a.iters)
        if a.only != "ht":
            rows += bench_loopback("ll", q, a.world, ll, a.num_sms, a.iters)
        print(_fmt([r for r in rows if r.recipe == recipe]), flush=True)
    for n in notes:
        print("note:", n)
    table = auto_table(rows)
    if a.auto_table:
        if table["entries"]:
            with open(a.auto_table, "w") as f:
                json.dump(table, f, indent=1)
        else:
            print("note: no real-link figures in this run: no auto table written")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "gpus": gpus, "notes": notes,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
