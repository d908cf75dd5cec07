"""Where one layer's time goes: per stage, the time a launch reports, the GPU's own time and the
host's time to issue it, so a stage that waits on its launches is told from one that waits on
the GPU.

    python -m epmoe.bench.profile_layer [--model deepseek-v3] [--recipe fp8_block]
        [--experts triton] [--tokens 128,4096] [--reps 20] [--host-top N] [--json F]

One layer at ep 1 (the local backend, the layer's own router, as a launch runs it), three
ways per forward, each the median of `--reps` forwards:
  launched  each forward after a synchronize, as `launch` and `bench.calibrate` time it: a
            stage's CUDA events also hold any time the GPU waited for the host's launches
  device    the same forward queued behind a device hold (`timing.DeviceSleep`, as
            `--timing device` runs a step), so the host has issued every launch before
            the GPU reaches them: the events hold GPU time only
  host      the host's clock over each stage while it issues it (launched forwards)
A stage is host-bound when `launched` is well above `device` and close to `host`.
`--host-top N` adds the N functions the host spends most time in while it issues forwards
(cProfile, own time), to say where a host-bound stage's time goes.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from epmoe.argtypes import at_least, int_list, model_name
from epmoe.config import RECIPES
from epmoe.outputs import dump_json, run_main, writable_file

HOLD_MS = 10.0  # longer than the host takes to issue a forward (a warning says if not)


def _forward(layer, x, dev, hold=None) -> float:
    """One forward (behind a device hold if given); -> its host time in ms (the stage events
    stay in the layer's timer)."""
    import time

    import torch

    torch.cuda.synchronize(dev)
    if hold is not None:
        hold.hold(HOLD_MS)
    t0 = time.perf_counter()
    layer.forward(x)
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(dev)
    return host


def _medians(d: dict) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in d.items() if v}


def _host_top(layer, x, dev, hold, reps: int, top: int) -> list[dict]:
    """The functions with the most own host time over `reps` queued forwards (cProfile)."""
    import cProfile
    import pstats

    import torch

    prof = cProfile.Profile()
    for _ in range(reps):
        torch.cuda.synchronize(dev)
        hold.hold(HOLD_MS)
        prof.enable()
        layer.forward(x)
        prof.disable()
    torch.cuda.synchronize(dev)
    st = pstats.Stats(prof)
    rows = [(v[2], v[0], f"{k[0].rsplit('/', 2)[-1]}:{k[1]}({k[2]})")  # tottime, calls, where
            for k, v in st.stats.items()]
    rows.sort(reverse=True)
    return [{"where": w, "own_ms_per_forward": t * 1e3 / reps, "calls_per_forward": c / reps}
            for t, c, w in rows[:top]]


def profile(model: str, recipe: str, experts: str, tokens: int, reps: int, dev,
            host_top: int = 0) -> dict:
    """-> {"stages": {stage: {launched, device, host}} in ms, "forward": {...}, ...}."""
    import torch

    from epmoe.bench.calibrate_layer import _build
    from epmoe.config import QuantConfig
    from epmoe.timing import DeviceSleep, StageTimer

    rt, layer, built = _build(model, QuantConfig(recipe), experts, tokens, dev)
    timer = StageTimer(enabled=True, device=dev, host=True)
    layer.timer = layer.experts.timer = layer.comm.timer = timer
    x = torch.randn(tokens, layer.cfg.hidden, device=dev, dtype=torch.bfloat16)
    out: dict = {"tokens": tokens, "experts": built, "recipe": recipe, "model": model}
    hold = DeviceSleep(dev)
    for _ in range(2):  # compile, autotune, warm the allocator
        _forward(layer, x, dev)
    for mode in ("launched", "device"):
        timer.collect()
        timer.reset()
        hosts = [_forward(layer, x, dev, hold if mode == "device" else None)
                 for _ in range(reps)]
        ms, host = _medians(timer.collect()), _medians(timer.collect_host())
        out.setdefault("forward_host_ms", statistics.median(hosts))
        for stage, v in ms.items():
            row = out.setdefault("stages", {}).setdefault(stage, {})
            row[mode] = v
            if mode == "launched":
                row["host"] = host.get(stage, 0.0)
    if host_top:
        out["host_top"] = _host_top(layer, x, dev, hold, reps, host_top)
    if out["forward_host_ms"] > HOLD_MS:
        out["warning"] = "the host took longer than the device sleep: 'device' holds host time"
    del layer, rt
    torch.cuda.empty_cache()
    return out


def table(res: dict) -> str:
    lines = [f"{res['model']} {res['recipe']} {res['experts']}, {res['tokens']} tokens, ep 1",
             f"the host issues a forward in {res['forward_host_ms']:.3f} ms",
             f"{'stage':<22} {'launched ms':>12} {'device ms':>10} {'host ms':>9} "
                   f"{'launch/dev':>10}"]
    for stage, r in res["stages"].items():
        ratio = r["launched"] / r["device"] if r.get("device") else float("nan")
        lines.append(f"{stage:<22} {r['launched']:>12.3f} {r.get('device', 0):>10.3f} "
                     f"{r['host']:>9.3f} {ratio:>10.2f}")
    for h in res.get("host_top", []):
        lines.append(f"  host {h['own_ms_per_forward']:7.3f} ms {h['calls_per_forward']:6.1f} "
                     f"calls  {h['where'][:46]}")
    if res.get("warning"):
        lines.append(f"warning: {res['warning']}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.profile_layer",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=model_name, default="deepseek-v3")
    p.add_argument("--recipe", choices=RECIPES, default="fp8_block")
    p.add_argument("--experts", choices=("triton", "deepgemm", "torch", "auto"),
                   default="triton")
    p.add_argument("--tokens", type=int_list(1), default="128,4096",
                   help="comma-separated token counts")
    p.add_argument("--reps", type=at_least(1), default=20)
    p.add_argument("--host-top", type=at_least(0), default=0,
                   help="list the N functions with the most host time (cProfile)")
    p.add_argument("--json", default=None, type=writable_file,
                   help="write the results here as JSON")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    tokens = args.tokens
    import torch

    if not torch.cuda.is_available():
        print("error: profile_layer needs a CUDA GPU (it compares stream and host time)",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    results = []
    for n in tokens:
        res = profile(args.model, args.recipe, args.experts, n, args.reps, dev, args.host_top)
        print(table(res), flush=True)
        results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            dump_json(results, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
