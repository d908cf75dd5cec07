"""The router's way (split or fused) and launch configs per expert-row width, timed.

    python -m epmoe.bench.router_tune [--models deepseek-v3,kimi-k2,qwen3-235b-a22b]
                                      [--tokens 4096] [--ways split,fused] [--quick]
                                      [--json FILE]

For each model's router (its real hidden, experts, groups, top-k and scoring): the split way
(cuBLAS's GEMM with fp32 logits out, then the routing kernel on them) at each candidate
config of that kernel and each fused candidate `RouterConfig` (tokens per program, K step,
warps, stages), each the median time over many runs, and its agreement with the torch
router on the same bf16 inputs' float64 logits (the share of tokens whose expert set
differs: near-ties only, so a correct way stays under `--max-mismatch`). The way the launch
runs at those tokens (`gate_way`, and `router_config` where it fuses) is timed in the same
run and every row is printed as a ratio to it; the routing kernel alone (on logits already
in memory) shows the split way's own latency. The picks are baked into
`epmoe.kernels.gate_topk` (LOGITS_ROUTER, TUNED_ROUTERS, FUSED_FROM_TOKENS) by hand.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from epmoe.argtypes import at_least, int_list, name_list
from epmoe.bench.timers import event_median_us
from epmoe.config import PRESETS, get_preset
from epmoe.kernels._common import next_pow2
from epmoe.kernels.gate_topk import (LOGITS_ROUTER, RouterConfig, gate_logits, gate_way,
                                     router_config, triton_gate_route, triton_route_logits)
from epmoe.outputs import dump_json, run_main, writable_file

MAX_MISMATCH = 0.005
WAYS = ("split", "fused")


def logits_candidates() -> list[RouterConfig]:
    """The routing kernel on logits (the split way's second launch): 1 .. 32 tokens a
    program, 1 .. 8 warps (no GEMM to feed; fewer, narrower programs shorten the chain of
    cross-warp reductions a decode-sized batch waits on)."""
    return [RouterConfig(bm, LOGITS_ROUTER.block_k, w, 1)
            for bm, w in itertools.product((1, 4, 16, 32), (1, 2, 4, 8))]


def candidates(block_e: int) -> list[RouterConfig]:
    """Tokens per program up to the launch's register cap (16384 // BLOCK_E fp32 scores),
    K step 32 / 64, 4 / 8 / 16 warps, 3 / 4 stages."""
    cap = max(16, 16384 // block_e)
    bms = [b for b in (16, 32, 64, 128) if b <= cap][-2:]
    return [RouterConfig(bm, bk, w, s)
            for bm, bk, w, s in itertools.product(bms, (32, 64), (4, 8, 16), (3, 4))]


def router_inputs(cfg, t: int, seed: int, device: str):
    """(tokens [t, hidden] bf16, gate [E, hidden] bf16, selection bias or None) of a model's
    router, random from `seed`."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, cfg.hidden, device=device, generator=g).to(torch.bfloat16)
    gate = (torch.randn(cfg.num_experts, cfg.hidden, device=device, generator=g)
            / cfg.hidden ** 0.5).to(torch.bfloat16)
    bias = None
    if cfg.router != "softmax":
        bias = torch.randn(cfg.num_experts, device=device, generator=g) * 0.01
    return x, gate, bias


def mismatch(ids: torch.Tensor, ref_ids: torch.Tensor) -> float:
    """The share of tokens whose set of chosen experts differs from the reference's."""
    return float((ids.long().sort(-1).values != ref_ids.long().sort(-1).values)
                 .any(-1).float().mean())


def tune_model(model: str, t: int, iters: int, max_mismatch: float, device: str = "cuda",
               timer=event_median_us, configs: list[RouterConfig] | None = None,
               split_configs: list[RouterConfig] | None = None,
               ways: tuple[str, ...] = WAYS) -> dict:
    """The way the launch runs at t tokens (`gate_way`: the split way at LOGITS_ROUTER or
    the fused one at `router_config`) first, then the split way at each of
    `logits_candidates` (or `split_configs`) and the fused way at each of `candidates` (or
    `configs`), of the `ways` asked for; every row printed as it is timed, as a ratio to the
    first. kernel_us: the routing kernel alone at LOGITS_ROUTER."""
    from epmoe.router import route

    cfg = get_preset(model)
    block_e = max(16, next_pow2(cfg.num_experts))
    x, gate, bias = router_inputs(cfg, t, 0, device)
    ref = route((x.double() @ gate.double().T).float(), cfg, bias, backend="torch")
    launch_way = gate_way(cfg.num_experts, t)
    current = router_config(cfg.num_experts)
    launch = ("split", LOGITS_ROUTER) if launch_way == "split" else ("fused", current)
    tried = [launch]
    if "split" in ways:
        splits = logits_candidates() if split_configs is None else split_configs
        tried += [("split", c) for c in [LOGITS_ROUTER] + splits]
    if "fused" in ways:
        others = candidates(block_e) if configs is None else configs
        tried += [("fused", c) for c in [current] + others]
    rows = []
    for way, c in dict.fromkeys(tried):  # in order, each once
        row = dict(way=way, config=c.__dict__, current=(way, c) == launch)
        try:
            ids, w = triton_gate_route(x, gate, cfg, bias, config=c, way=way)
            row["mismatch"] = mismatch(ids, ref.topk_ids_TK)
            row["us"] = timer(lambda c=c, way=way: triton_gate_route(x, gate, cfg, bias,
                                                                     config=c, way=way), iters)
        except Exception as exc:  # noqa: BLE001  (out of shared memory: recorded, skipped)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        print(_line(row, rows[0].get("us")), flush=True)
    base = rows[0]
    # the split way's second launch alone, on logits already in memory: its own latency
    logits = gate_logits(x, gate)
    kernel_us = timer(lambda c=LOGITS_ROUTER: triton_route_logits(logits, cfg, bias, config=c),
                      iters)
    print(f"  {'routing kernel alone':<22} {kernel_us:9.1f} us  (of the split way)", flush=True)
    ok = [r for r in rows if "us" in r and r["mismatch"] <= max_mismatch]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    return dict(model=model, tokens=t, experts=cfg.num_experts, block_e=block_e,
                hidden=cfg.hidden, launch_way=launch_way, rows=rows, best=best,
                current_us=base.get("us"), kernel_us=kernel_us,
                speedup=base["us"] / best["us"] if best and "us" in base else None)


def _line(row: dict, base_us: float | None) -> str:
    c = RouterConfig(**row["config"])
    name = (f"{row['way']} {c.block_m}x{c.block_k} w{c.num_warps}"
            + (f" s{c.num_stages}" if row["way"] == "fused" else ""))
    if "error" in row:
        return f"  {name:<22} {row['error'][:54]}"
    ratio = f"{row['us'] / base_us:6.3f}" if base_us else "     -"
    mark = "  (launch)" if row["current"] else ""
    return f"  {name:<22} {row['us']:9.1f} us  x{ratio}  mismatch {row['mismatch']:.4f}{mark}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.router_tune",
                                description=__doc__.splitlines()[0])
    p.add_argument("--models", type=name_list(PRESETS),
                   default="deepseek-v3,kimi-k2,qwen3-235b-a22b")
    p.add_argument("--tokens", type=int_list(1), default="4096")
    p.add_argument("--iters", type=at_least(1), default=50)
    p.add_argument("--max-mismatch", type=float, default=MAX_MISMATCH,
                   help="largest share of tokens whose experts may differ from the torch "
                        "router on float64 logits (near-ties)")
    p.add_argument("--ways", type=name_list(WAYS), default=",".join(WAYS),
                   help="whose candidates to time (the launch's way is timed always); the "
                        "fused way compiles a kernel per candidate over the whole gate: slow")
    p.add_argument("--quick", action="store_true",
                   help="the two ways at the launch's configs only (no other candidates)")
    p.add_argument("--json", type=writable_file, default=None)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("router_tune needs a CUDA GPU", file=sys.stderr)
        return 2
    out = []
    for m in a.models:
        for t in a.tokens:
            print(f"{m}: {t} tokens (time x ratio to the launch's way, the first row)",
                  flush=True)
            r = tune_model(m, t, a.iters, a.max_mismatch, configs=[] if a.quick else None,
                           split_configs=[] if a.quick else None, ways=tuple(a.ways))
            if r["best"]:
                b = RouterConfig(**r["best"]["config"])
                print(f"  best: {r['best']['way']} {b} {r['best']['us']:.1f} us, "
                      f"{r['speedup']:.2f}x the launch's way ({r['launch_way']})")
            out.append(r)
            if a.json:  # after each model: a run cut short keeps what it measured
                with open(a.json, "w") as f:
                    dump_json(out, f)
    return 0


if __name__ == "__main__":
    run_main(main)
