"""Comm benchmark: dispatch and combine of every backend at DeepSeek-V3 shapes (hidden 7168,
256 experts, top-8, uniform routing), HT at 512..8192 tokens per rank, LL at 1..256, bf16 and
fp8 (1x128, fp32 scales), with the ratio to DeepEP measured in the same run where it can run.

    python -m epmoe.bench.comm [--json FILE] [--auto-table FILE] [--world 2] [--quick]
        [--sweep 24:0:0,32:132:0:512:4] [--breakdown] [--jsonl FILE]

Two or more GPUs: every backend (`--backends`, default all2all, deepep-ht, deepep-ll, symm-ht,
symm-ll) on real ranks, one GPU each (`epmoe.bench.comm_ranks`: the same inputs for every
backend, DeepEP and ours in separate processes since each owns NVSHMEM), with each row's ratio
to DeepEP's time in the same run and a round-trip check through identity experts. One GPU:
symm-ht / symm-ll run in the loopback world (W ranks' arenas on one GPU, rank by rank): the
kernels' cost without a link, per rank (phase time / W); the others need >= 2 GPUs and are
listed as not run. `--device cpu`: the portable backends on gloo ranks (a check of the
harness, not a benchmark). `--device shared`: symm-* on W real ranks that share the one GPU
(processes time-sliced by the driver): the real-rank path (NVSHMEM arena, peer views, the
pipelined dispatch) checked end to end on one GPU; its times are not link speeds. GB/s in two
conventions: "all" = every received row incl. the rank's own (DeepEP's tests; LL: every
(token, k)), "link" = only rows that cross to another rank (symm-ll with ll_dedup: a token
once per rank).
SMs: the persistent grid of the symm kernels (DeepEP HT: its SM count). Times: median of
CUDA-event timings (real ranks: the slowest rank's per iteration; `--timing device`, the
default, is the GPU's time with the host ahead and the ranks' GPUs lined up, DeepEP's
convention; `launched` includes the host's launch time: epmoe.bench.comm_ranks).
`--auto-table` writes the per-token-count table `--backend auto` reads (only figures that
compare backends on real links belong in it: a loopback run writes none, and says so).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import asdict, dataclass

import torch

from epmoe.argtypes import at_least, int_list, name_list, seconds
from epmoe.bench.comm_loopback import HIDDEN, NUM_EXPERTS, TOP_K, bench_loopback, sweep_spec
from epmoe.bench.comm_ranks import HT_BACKENDS, LL_BACKENDS, TIMINGS
from epmoe.config import QuantConfig
from epmoe.outputs import dump_json, json_text, run_main, writable_file

# the recipes whose activations the comm backends carry (bf16 rows, fp8 rows with scales)
COMM_RECIPES = ("bf16", "fp8_block")

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
    sms: str | None  # CTAs: symm-* "send/receive", deepep-ht its SMs, None: NCCL decides
    vs_deepep_dispatch: float | None = None
    vs_deepep_combine: float | None = None
    passed: bool | None = None  # real ranks: the round trip within the recipe's tolerance
    max_rel_err: float | None = None  # real ranks: the round trip's error (module docstring)
    knobs: str = ""  # symm-* on real ranks: the --sweep knobs away from their defaults
    permute_us: float | None = None  # real ranks, rows per token (deepep-ht, all2all): the
    # permute into the experts' layout that the runtime runs after such a dispatch
    vs_deepep_layout: float | None = None  # symm-ht: dispatch / (DeepEP's + its permute)


def make_row(r: dict, hidden: int = HIDDEN) -> Row:
    """A measured case (times, rows sent: all and crossing) -> Row with GB/s both ways."""
    d = hidden
    disp_b = d * 2 if r["recipe"] == "bf16" else d + d // 128 * 4  # data + fp32 scales / 128
    g = lambda n, b, us: n * b / us / 1e3  # noqa: E731
    return Row(r["backend"], r["recipe"], r["tokens"], r["world"], r["where"], r["dispatch_us"],
               r["combine_us"], g(r["rows"], disp_b, r["dispatch_us"]),
               g(r["link_rows"], disp_b, r["dispatch_us"]), g(r["rows"], d * 2, r["combine_us"]),
               g(r["link_rows"], d * 2, r["combine_us"]), r["sms"], r.get("vs_deepep_dispatch"),
               r.get("vs_deepep_combine"), r.get("passed"), r.get("max_rel_err"),
               r.get("knobs", ""), r.get("permute_us"), r.get("vs_deepep_layout"))


def auto_table(rows: list[Row], measured: str = "") -> dict:
    """The table `--backend auto` reads: per backend and recipe, (tokens, dispatch + combine
    us) measured on real links. Loopback rows are not comparable with other backends' link
    times, so they are left out, as are rows whose round trip failed. `measured`: where, when
    and how (auto's reasons quote it)."""
    real = [r for r in rows if not r.where.startswith(("loopback", "shared"))
            and r.passed is not False  # a backend whose round trip failed is no candidate
            and not r.knobs]  # a sweep's other knobs are not what the runtime runs
    table: dict = {}
    for r in real:
        table.setdefault(r.backend, {}).setdefault(r.recipe, []).append(
            [r.tokens, round(r.dispatch_us + r.combine_us, 1)])
    return {"world": rows[0].world if rows else 0, "entries": table,
            "note": "dispatch + combine us per rank, DeepSeek-V3 shapes",
            **({"measured": measured} if measured else {})}


def _fmt(rows: list[Row]) -> str:
    """A table that fits 80 columns."""
    head = f"{'backend':<9} {'rec':<4} {'tok':>5} {'disp us':>8} {'GB/s all/link':>13} " \
           f"{'comb us':>8} {'GB/s all/link':>13} {'SMs':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        rec = "bf16" if r.recipe == "bf16" else "fp8"
        lines.append(f"{r.backend:<9} {rec:<4} {r.tokens:>5} {r.dispatch_us:>8.1f} "
                     f"{r.dispatch_gbs_all:>6.0f}/{r.dispatch_gbs_link:<6.0f} "
                     f"{r.combine_us:>8.1f} {r.combine_gbs_all:>6.0f}/{r.combine_gbs_link:<6.0f} "
                     f"{r.sms or '-':>7}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.comm",
                                description=__doc__.splitlines()[0])
    p.add_argument("--json", type=writable_file, help="write the results as JSON to this file")
    p.add_argument("--jsonl", type=writable_file,
                   help="append each row (with its options and kernels) as a JSON "
                        "line as soon as it is measured")
    p.add_argument("--auto-table", help="write the table --backend auto reads to this file")
    p.add_argument("--world", type=at_least(2), default=2, help="ranks (loopback ranks on one GPU)")
    p.add_argument("--num-sms", type=at_least(0), default=0,
                   help="CTAs of symm-*'s send halves and deepep-ht's SMs (0: each backend's "
                        "default: symm-ht 24 + every SM for its local receives, symm-ll every "
                        "SM, deepep-ht 24)")
    p.add_argument("--sweep", type=sweep_spec, default="",
                   help="knob sets num_sms:recv_sms:tile_tokens:chunk_cols:num_warps:"
                   "pipelined:chunk_rows:ll_dedup:ll_gather:ht_gather, comma-separated (0 or "
                   "missing: default; pipelined 1: symm-ht's one-kernel dispatch and combine, "
                   "2: send then receive; ll_dedup 1: symm-ll sends a token once per rank, 2: "
                   "once per expert; ll_gather 1: with ll_dedup the rows stay staged, "
                   "indexed; ht_gather 1: symm-ht's receive writes the layout's index, not its "
                   "rows); overrides --num-sms for symm-* (real ranks: their jobs run once per "
                   "set, the others once)")
    p.add_argument("--iters", type=at_least(1), default=20)
    p.add_argument("--quick", action="store_true", help="4096 (HT) and 128 (LL) tokens only")
    p.add_argument("--ht-tokens", type=int_list(1),
                   help="comma-separated HT token counts (overrides --quick)")
    p.add_argument("--ll-tokens", type=int_list(1),
                   help="comma-separated LL token counts (overrides --quick)")
    p.add_argument("--breakdown", action="store_true",
                   help="per-kernel device time (torch.profiler, eager launches) per row")
    p.add_argument("--check", action="store_true", help="check each combine bit for bit "
                                                        "against torch (first run of a size)")
    p.add_argument("--only", choices=("ht", "ll"), help="one mode only")
    p.add_argument("--recipes", type=name_list(COMM_RECIPES), default="bf16,fp8_block",
                   help="comma-separated recipes")
    p.add_argument("--backends", type=name_list(dict.fromkeys(HT_BACKENDS + LL_BACKENDS)),
                   default=",".join(dict.fromkeys(HT_BACKENDS + LL_BACKENDS)),
                   help="real ranks: comma-separated backends (each runs in its modes)")
    p.add_argument("--device", choices=("auto", "cuda", "shared", "cpu"), default="auto",
                   help="cpu: the portable backends on gloo ranks (a harness check); shared: "
                        "symm-* on --world real ranks sharing one GPU (a check of the "
                        "real-rank path; time-sliced, so not a speed)")
    p.add_argument("--loopback", action="store_true",
                   help="with >= 2 GPUs: also run symm-* in the loopback world")
    p.add_argument("--hidden", type=at_least(128), default=HIDDEN,
                   help="real ranks: hidden size (a multiple of 128, the fp8 block)")
    p.add_argument("--num-experts", type=at_least(1), default=NUM_EXPERTS,
                   help="real ranks: experts")
    p.add_argument("--timing", choices=TIMINGS, default="device",
                   help="real ranks: device = the GPU's time (host ahead, ranks' GPUs lined "
                        "up; DeepEP's convention), launched = the host's launch time included")
    p.add_argument("--job-timeout", type=seconds, default=900.0,
                   help="seconds per spawned world before its ranks are killed")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    cuda = torch.cuda.is_available() and a.device != "cpu"
    if a.device in ("cuda", "shared") and not torch.cuda.is_available():
        print(f"error: --device {a.device} but no CUDA device is visible", file=sys.stderr)
        return 2
    ht, ll = ((4096,), (128,)) if a.quick else (HT_TOKENS, LL_TOKENS)
    ht, ll = a.ht_tokens or ht, a.ll_tokens or ll
    gpus = torch.cuda.device_count() if cuda else 0
    real = not cuda or gpus >= 2
    backends = a.backends
    bad = []
    if a.hidden % 128:
        bad.append(f"--hidden ({a.hidden}) must be a multiple of 128 (the fp8 block)")
    if a.num_experts % a.world:
        bad.append(f"--num-experts ({a.num_experts}) must be a multiple of --world ({a.world})")
    if bad:
        print(f"error: {'; '.join(bad)}", file=sys.stderr)
        return 2
    notes = []
    if a.device == "shared":
        return _shared(a, backends, ht, ll, sink=_sink(a))
    if cuda and gpus < 2:
        notes.append(f"{gpus} GPU: all2all, deepep-ht and deepep-ll need >= 2 GPUs (one rank "
                     f"per GPU) and were not run; symm-* ran in the loopback world, so there "
                     f"is no same-run DeepEP ratio")
    if not cuda:
        backends = tuple(b for b in backends if b == "all2all")
        notes.append("CPU: gloo ranks run the portable backend only (a check of the harness, "
                     "not a benchmark); DeepEP and symm-* need CUDA")

    sink = _sink(a)
    rows: list[Row] = []
    if real:
        world = a.world if not cuda else min(a.world, gpus)
        rows += bench_ranks(a, backends, ht, ll, world, "cuda" if cuda else "cpu", sink)
    if cuda and (gpus < 2 or a.loopback):
        rows += _loopback_all(a, ht, ll, sink)
    for n in notes:
        print("note:", n)
    when = datetime.date.today().isoformat()
    table = auto_table(rows, f"bench.comm {when}, {gpus} x {torch.cuda.get_device_name()}, "
                             f"{a.timing} timing" if cuda else "")
    if a.auto_table:
        if table["entries"]:
            with open(a.auto_table, "w") as f:
                dump_json(table, f, indent=1)
        else:
            print("note: no real-link figures in this run: no auto table written")
    if a.json:
        with open(a.json, "w") as f:
            dump_json({"device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": gpus,
                       "timing": a.timing, "notes": notes, "rows": [asdict(r) for r in rows]},
                      f, indent=1)
    return 1 if any(r.passed is False for r in rows) else 0


def _sink(a):
    """-> a function that appends a row as a JSON line to --jsonl (if given)."""
    def sink(row: dict) -> None:
        if a.jsonl:
            with open(a.jsonl, "a") as f:
                f.write(json_text(row, indent=None) + "\n")
    return sink


def _shared(a, backends, ht, ll, sink) -> int:
    """--device shared: symm-* on real ranks sharing one GPU; exit 1 if a round trip failed
    or a job did not finish."""
    ours = tuple(b for b in backends if b.startswith("symm"))
    if not ours:
        print(f"error: --device shared runs symm-* only (--backends {','.join(backends)})",
              file=sys.stderr)
        return 2
    rows = bench_ranks(a, ours, ht, ll, a.world, "cuda-shared", sink)
    print("note: ranks shared one GPU (time-sliced): a check of the real-rank path; the times "
          "are not link speeds")
    if a.json:
        with open(a.json, "w") as f:
            dump_json({"device": torch.cuda.get_device_name(), "gpus": 1, "shared": True,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
    want = sum(len(ht if b.endswith("ht") else ll) for b in ours
               if a.only in (None, b[-2:])) * len(a.recipes)
    ok = len(rows) == want and all(r.passed for r in rows)
    return 0 if ok else 1


def _loopback_all(a, ht, ll, sink) -> list[Row]:
    rows = []
    for knobs in a.sweep or [dict(num_sms=a.num_sms)]:
        for recipe in a.recipes:
            new: list[Row] = []

            def emit(raw: dict, extra: dict) -> None:
                new.append(make_row(raw))
                sink(dict(asdict(new[-1]), **extra))

            for mode, tokens in (("ht", ht), ("ll", ll)):
                if a.only in (None, mode):
                    bench_loopback(mode, QuantConfig(recipe), a.world, tokens, a.iters, knobs,
                                   a.breakdown, emit, a.check)
            print(f"knobs {knobs}", flush=True)
            print(_fmt(new), flush=True)
            rows += new
    return rows


def bench_ranks(a, backends, ht, ll, world: int, device: str, sink) -> list[Row]:
    """Every backend on `world` real ranks (comm_ranks), rows with same-run DeepEP ratios."""
    from epmoe.bench.comm_ranks import plan_jobs, run_job, with_ratios

    kw = dict(world=world, device=device, iters=a.iters, hidden=a.hidden,
              num_experts=a.num_experts, top_k=TOP_K, num_sms=a.num_sms, timing=a.timing,
              breakdown=a.breakdown)
    jobs = []
    for n, knobs in enumerate(a.sweep or [{}]):  # the others run with the first set
        names_n = [b for b in backends if n == 0 or b.startswith("symm")]
        for mode, tokens, names in (("ht", ht, HT_BACKENDS), ("ll", ll, LL_BACKENDS)):
            if a.only in (None, mode):
                jobs += plan_jobs([b for b in names_n if b in names], mode,
                                  a.recipes, tokens,
                                  **dict(kw, knobs=tuple(knobs.items())))
    merged = []
    for i, job in enumerate(jobs):
        print(f"[{i + 1}/{len(jobs)}] {job.mode} {job.recipe}: {', '.join(job.backends)} on "
              f"{world} {device} ranks{' (' + job.label + ')' if job.label else ''}",
              file=sys.stderr, flush=True)
        merged += run_job(job, a.job_timeout)
    where = {"cuda": f"{world} ranks, one GPU each", "cpu": f"{world} gloo ranks (CPU)",
             "cuda-shared": f"shared: {world} ranks on one GPU (time-sliced)"}[device]
    rows = []
    for r in with_ratios(merged):
        if r["status"] != "ok":
            print(f"note: {r['backend']} {r['mode']} {r['recipe']} {r['status']}: "
                  f"{r['error']}")
            continue
        rows.append(make_row(dict(r, where=where), a.hidden))
        sink(dict(asdict(rows[-1]), **({"kernels": r["kernels"]} if r.get("kernels") else {})))
    for label in dict.fromkeys(r.knobs for r in rows):
        print(f"knobs: {label}" if label else "knobs: defaults")
        print(_fmt([r for r in rows if r.knobs == label]), flush=True)
    ratios = [r for r in rows if r.vs_deepep_dispatch is not None]
    if ratios:
        print("time / DeepEP's, same run and inputs (dispatch / combine):")
        for r in ratios:
            print(f"  {r.backend:<9} {r.recipe:<9} {r.tokens:>5} tok: "
                  f"{r.vs_deepep_dispatch:.2f} / {r.vs_deepep_combine:.2f}"
                  + (f"  (+permute {r.vs_deepep_layout:.2f})" if r.vs_deepep_layout else "")
                  + (f"  ({r.knobs})" if r.knobs else ""))
        print("  (+permute: dispatch over DeepEP's dispatch + the permute into the experts' "
              "layout, which symm-ht's dispatch writes itself)")
    for r in rows:
        if r.permute_us:
            print(f"  {r.backend} {r.recipe} {r.tokens} tok: permute into the layout "
                  f"{r.permute_us:.1f} us after the dispatch")
    return rows


if __name__ == "__main__":
    run_main(main)
