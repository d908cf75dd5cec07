"""The split router measured against the cost model's price for it.

    python -m epmoe.bench.router_model [--models deepseek-v3,kimi-k2,qwen3-235b-a22b]
        [--tokens 1,32,128,512,1024,2048,4096,8192,16384] [--profile h100] [--json FILE]

A profile without a measured router fit (every spec profile) prices the router stage from
the split way's mechanisms (`epmoe.plan.cost._router_us`: the gate GEMM's fixed time and
compute, or its bytes; the routing kernel's fixed time and selection work). This times what
that prices, on this GPU: `route_tokens` (the way the launch runs at those tokens) and the
gate GEMM alone (`gate_logits`), each the median of CUDA events over `--iters` calls on fresh
random tokens and gate, and prints the prediction beside it with the ratio. The profile
defaults to this GPU's spec one (h100 on an H100, h200 on an H200), whose constants the
comparison checks.
"""

from __future__ import annotations

import argparse
import sys

import torch

from epmoe.argtypes import at_least, int_list, name_list
from epmoe.bench.timers import event_median_us
from epmoe.config import PRESETS, get_preset
from epmoe.outputs import dump_json, run_main, writable_file

TOKENS = "1,32,128,512,1024,2048,4096,8192,16384"


def measure(model: str, tokens: int, iters: int, prof, seed: int = 0) -> dict:
    """One row: the split router and its gate GEMM timed here, and the profile's price."""
    from epmoe.bench.router_tune import router_inputs
    from epmoe.kernels.gate_topk import gate_logits, gate_way
    from epmoe.plan.cost import _router_us
    from epmoe.router import route_tokens

    cfg = get_preset(model)
    x, gate, bias = router_inputs(cfg, tokens, seed * 1_000_003 + tokens, "cuda")
    route = event_median_us(lambda: route_tokens(x, gate, cfg, bias), iters)
    gemm = event_median_us(lambda: gate_logits(x, gate), iters)
    pred = _router_us(cfg, prof, tokens)
    return dict(model=model, tokens=tokens, way=gate_way(cfg.num_experts, tokens),
                route_us=route, gemm_us=gemm, predicted_us=pred, ratio=pred / route)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.router_model",
                                description=__doc__.splitlines()[0])
    p.add_argument("--models", type=name_list(PRESETS),
                   default="deepseek-v3,kimi-k2,qwen3-235b-a22b")
    p.add_argument("--tokens", type=int_list(1), default=TOKENS)
    p.add_argument("--iters", type=at_least(5), default=60)
    p.add_argument("--profile", default=None,
                   help="profile whose price to compare (default: this GPU's spec one)")
    p.add_argument("--json", type=writable_file, default=None)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("error: router_model needs a CUDA GPU", file=sys.stderr)
        return 2
    from epmoe.plan.profile import load_profile
    from epmoe.plan.topology import gpu_kind_of

    name = torch.cuda.get_device_name()
    kind = gpu_kind_of(name.lower())
    if a.profile is None and kind is None:
        print(f"error: no spec profile names this GPU ({name!r}): pass --profile",
              file=sys.stderr)
        return 2
    prof = load_profile(a.profile or kind)
    if prof.has_kernel("router", get_preset(a.models[0]).router):
        print(f"note: {prof.name} has a measured router fit: it prices the router by it",
              file=sys.stderr)
    print(f"{name}, profile {prof.name}: split router, us (CUDA events, median of {a.iters})")
    print(f"{'model':<18}{'tokens':>7} {'way':<6}{'gemm':>9}{'router':>9}{'model':>9}"
          f"{'ratio':>7}")
    rows = []
    for m in a.models:
        for t in a.tokens:
            r = measure(m, t, a.iters, prof)
            rows.append(r)
            print(f"{m[:18]:<18}{t:>7} {r['way']:<6}{r['gemm_us']:>9.2f}{r['route_us']:>9.2f}"
                  f"{r['predicted_us']:>9.2f}{r['ratio']:>7.2f}", flush=True)
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print(f"worst: {worst['model']} at {worst['tokens']} tokens, x{worst['ratio']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            dump_json(dict(device=name, profile=prof.name, iters=a.iters, rows=rows), f)
    return 0


if __name__ == "__main__":
    run_main(main)
