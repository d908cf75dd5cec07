"""Comm benchmark: dispatch and combine of every backend at DeepSeek-V3 shapes (hidden 7168,
256 experts, top-8, uniform routing), HT at 512..8192 tokens per rank, LL at 1..256, bf16 and
fp8 (1x128, fp32 scales), with the ratio to DeepEP measured in the same run where it can run.

    python -m epmoe.bench.comm [--json FILE] [--auto-table FILE] [--world 2] [--quick]
        [--sweep 24:0:0,32:132:0:512:4] [--breakdown] [--jsonl FILE]

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


def _options(opt_kw: dict):
    """SymmOptions from the knobs given (only those: the bench also runs older trees)."""
    from epmoe.comm.symm.options import SymmOptions

    return SymmOptions(**{k: v for k, v in opt_kw.items() if v})


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
    """symm-ll's combine against sum_k w_k * y_k in fp32 in k order (rows found through the
    arena's meta words), cast once: 'ok' or what differs."""
    sh = comms[0].shape
    tmax, k_, c_ = sh.max_tokens, sh.top_k, sh.capacity
    dim, dev = ys[0].shape[-1], ys[0].device
    back = [torch.zeros(i.shape[0], k_, dim, device=dev) for i in ids]
    for r, (batch, _) in enumerate(outs):
        meta = comms[r].arena.view.words("ll_meta").view(-1, c_).long()
        used = torch.arange(c_, device=dev)[None, :] < batch.counts_E[:, None]
        m = meta[used]
        src, t, k = m // (tmax * k_), (m // k_) % tmax, m % k_
        y = ys[r][used].float()
        for s in range(len(comms)):
            sel = src == s
            back[s][t[sel], k[sel]] = y[sel]
    bad = []
    for s in range(len(comms)):
        acc = torch.zeros(ids[s].shape[0], dim, device=dev)
        for k in range(k_):
            v = ids[s][:, k] >= 0
            acc = torch.where(v[:, None], acc + ws[s][:, k, None].float() * back[s][:, k], acc)
        if not torch.equal(acc.to(torch.bfloat16), res[s]):
            bad.append(f"rank {s}: {int((acc.to(torch.bfloat16) != res[s]).sum())} differ")
    return "; ".join(bad) or "ok"


def bench_loopback(mode: str, quant: QuantConfig, world: int, tokens: tuple, iters: int,
                   opt_kw: dict | None = None, breakdown: bool = False, sink=None,
                   check: bool = False) -> list[Row]:
    """symm-ht / symm-ll on one GPU, arena sized for max(tokens) (one compile per recipe).
    opt_kw: SymmOptions knobs (num_sms, recv_sms, tile_tokens); sink(row dict) gets each row
    (and its kernel breakdown) as soon as it is measured."""
    from epmoe.comm.symm.ht import SymmHighThroughputComm
    from epmoe.comm.symm.ll import SymmLowLatencyComm
    from epmoe.comm.symm.loopback import loopback_comms

    opt_kw = dict(opt_kw or {})
    opts = _options(opt_kw)
    cls = SymmHighThroughputComm if mode == "ht" else SymmLowLatencyComm
    cfg = _cfg()
    _, comms = loopback_comms(cls, cfg, quant, world, max(tokens), "cuda", options=opts)
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
        row = Row(cls.name, quant.recipe, t, world, f"loopback {world} ranks / 1 GPU",
                  disp, comb, gbs(all_rows, row_bytes, disp), gbs(link_rows, row_bytes, disp),
                  gbs(all_rows, d * 2, comb), gbs(link_rows, d * 2, comb), opts.num_sms)
        rows.append(row)
        if sink is not None:
            sink(dict(asdict(row), options=opt_kw, kernels=kernels, check=verdict))
    del comms
    torch.cuda.empty_cache()
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


KNOBS = ("num_sms", "recv_sms", "tile_tokens", "chunk_cols", "num_warps")


def _sweep(spec: str) -> list[dict]:
    """"24:0:0,32:132:2:512:4" -> [{num_sms, recv_sms, tile_tokens, chunk_cols, num_warps}]
    (missing or 0: the default)."""
    out = []
    for item in filter(None, spec.split(",")):
        vals = [int(v) for v in item.split(":")]
        if not 1 <= len(vals) <= len(KNOBS):
            raise ValueError(f"--sweep item '{item}': 1 to {len(KNOBS)} numbers "
                             f"({':'.join(KNOBS)})")
        out.append(dict(zip(KNOBS, vals + [0] * (len(KNOBS) - len(vals)))))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results as JSON to this file")
    p.add_argument("--jsonl", help="append each row (with its options and kernels) as a JSON "
                                   "line as soon as it is measured")
    p.add_argument("--auto-table", help="write the table --backend auto reads to this file")
    p.add_argument("--world", type=int, default=2, help="ranks (loopback ranks on one GPU)")
    p.add_argument("--num-sms", type=int, default=24)
    p.add_argument("--sweep", default="", help="knob sets num_sms:recv_sms:tile_tokens:"
                   "chunk_cols:num_warps, comma-separated (0 or missing: default); overrides "
                   "--num-sms")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="4096 (HT) and 128 (LL) tokens only")
    p.add_argument("--ht-tokens", help="comma-separated HT token counts (overrides --quick)")
    p.add_argument("--ll-tokens", help="comma-separated LL token counts (overrides --quick)")
    p.add_argument("--breakdown", action="store_true",
                   help="per-kernel device time (torch.profiler, eager launches) per row")
    p.add_argument("--check", action="store_true", help="check each combine bit for bit "
                                                        "against torch (first run of a size)")
    p.add_argument("--only", choices=("ht", "ll"), help="one mode only")
    p.add_argument("--recipes", default="bf16,fp8_block", help="comma-separated recipes")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.comm needs CUDA (the CPU loopback world is for tests: tests/test_symm_*)")
        return 2
    ht, ll = ((4096,), (128,)) if a.quick else (HT_TOKENS, LL_TOKENS)
    ht = tuple(int(v) for v in a.ht_tokens.split(",")) if a.ht_tokens else ht
    ll = tuple(int(v) for v in a.ll_tokens.split(",")) if a.ll_tokens else ll
    gpus = torch.cuda.device_count()
    notes = []
    if gpus < 2:
        notes.append(f"{gpus} GPU: all2all, deepep-ht and deepep-ll need >= 2 GPUs (one rank "
                     f"per GPU) and were not run; symm-* ran in the loopback world, so there "
                     f"is no same-run DeepEP ratio")
    else:
        notes.append("real-rank runs of every backend are the 2-GPU issue's bench; this run "
                     "measured the loopback world")

    def sink(row: dict) -> None:
        if a.jsonl:
            with open(a.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")

    rows: list[Row] = []
    for knobs in _sweep(a.sweep) or [dict(num_sms=a.num_sms)]:
        for recipe in a.recipes.split(","):
            q = QuantConfig(recipe)
            new = []
            if a.only != "ll":
                new += bench_loopback("ht", q, a.world, ht, a.iters, knobs, a.breakdown, sink,
                                      a.check)
            if a.only != "ht":
                new += bench_loopback("ll", q, a.world, ll, a.iters, knobs, a.breakdown, sink,
                                      a.check)
            print(f"knobs {knobs}", flush=True)
            print(_fmt(new), flush=True)
            rows += new
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
