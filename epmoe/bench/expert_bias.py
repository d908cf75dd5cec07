"""What gpt-oss's expert biases cost (GPU only): the experts' forward with and without them.

    python -m epmoe.bench.expert_bias [--tokens 128,4096] [--experts 32] [--recipes bf16,mxfp8]
                                      [--json FILE]

gpt-oss-120b's expert shapes (hidden 2880, intermediate 2880, top-4), one rank holding
`--experts` of the 128 (32 = EP 4's share), tokens x top-4 pairs routed uniformly over them.
Each row runs the Triton experts' `apply` (permute, GEMM1, act+quant, GEMM2, gather) on the
same weights in the same process: with b13 / b2 (b13 fused into act+quant, b2 into GEMM2's
epilogue) and, as the baseline, with both dropped. Also the separate b2 pass that DeepGEMM's
experts run (`kernels.expert_bias`; DeepGEMM has no epilogue hook) against an HBM copy of its
bytes. Times: median of many runs (`triton.testing.do_bench`); the two
variants alternate twice and each keeps its faster median.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from epmoe.argtypes import int_list, name_list
from epmoe.config import QuantConfig, get_preset
from epmoe.outputs import dump_json, run_main, writable_file


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def run_case(tokens: int, num_experts: int, recipe: str) -> list[dict]:
    from epmoe.experts.triton_experts import TritonExperts
    from epmoe.kernels.act_quant import ValidRows
    from epmoe.kernels.expert_bias import triton_add_expert_bias_
    from epmoe.weights import synthetic_layer

    cfg = get_preset("gpt-oss-120b")
    quant = QuantConfig(recipe)
    ew = synthetic_layer(cfg, quant, 0, 0, range(num_experts), with_shared=False,
                         device="cuda").experts
    plain = dataclasses.replace(ew, b13=None, b2=None)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.randint(0, num_experts, (tokens, cfg.top_k), device="cuda", generator=g,
                        dtype=torch.int32)
    w = torch.softmax(torch.randn(tokens, cfg.top_k, device="cuda", generator=g), -1)
    x = torch.randn(tokens, cfg.hidden, device="cuda", generator=g).to(torch.bfloat16)
    rows = []
    calls = {}
    for name, weights in (("no bias", plain), ("biased", ew)):
        ex = TritonExperts(weights, cfg, quant)
        xq = ex.quantize_input(x)
        calls[name] = (lambda ex=ex, xq=xq: ex.apply(xq, ids, w))
        calls[name]()  # compile and tune before anything is timed
    torch.cuda.synchronize()
    # alternated twice, the faster median of each kept: the first timing of a process runs
    # while the GPU's clocks still ramp up
    times = {n: float("inf") for n in calls}
    for _ in range(2):
        for name, fn in calls.items():
            times[name] = min(times[name], bench_ms(fn))
    tag = f"{recipe} T={tokens} E={num_experts}"
    rows.append(dict(case="experts apply, biased", shape=tag, ms=times["biased"],
                     base="no bias", base_ms=times["no bias"]))
    m = tokens * cfg.top_k
    y = torch.randn(m, cfg.hidden, device="cuda").to(torch.bfloat16)
    expert = torch.sort(ids.view(-1)).values
    vr = ValidRows.contiguous(expert)
    ms = bench_ms(lambda: triton_add_expert_bias_(y, ew.b2, vr))
    src = torch.empty(m * cfg.hidden * 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rows.append(dict(case="b2 pass (deepgemm)", shape=f"M={m} D={cfg.hidden}", ms=ms,
                     base="HBM copy, same bytes", base_ms=bench_ms(lambda: dst.copy_(src))))
    return rows


def table(rows: list[dict]) -> str:
    out = [f"{'case':<24}{'shape':<26}{'ms':>8}{'baseline':>10}{'ratio':>7}"]
    for r in rows:
        out.append(f"{r['case']:<24}{r['shape']:<26}{r['ms']:>8.4f}{r['base_ms']:>10.4f}"
                   f"{r['ms'] / r['base_ms']:>7.2f}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.expert_bias", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int_list(1), default="128,4096")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--recipes", type=name_list(("bf16", "mxfp8")), default="bf16,mxfp8",
                   help="gpt-oss's hidden 2880 takes bf16 and mxfp8 (groups of 32)")
    p.add_argument("--json", default=None, type=writable_file)
    a = p.parse_args(argv)
    tokens, recipes = a.tokens, a.recipes
    if not 1 <= a.experts <= 128:
        p.error(f"--experts ({a.experts}) must be in [1, 128]")
    if not torch.cuda.is_available():
        print("error: the expert-bias benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [r for t in tokens for rc in recipes for r in run_case(t, a.experts, rc)]
    print(f"{torch.cuda.get_device_name()}: gpt-oss-120b experts, with biases vs without")
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            dump_json(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
