"""Eager steps against steps replayed from a CUDA graph (`launch --cuda-graph`), in one run.

    python -m epmoe.bench.graph_step [--model deepseek-v3] [--recipes fp8_block,bf16]
        [--experts triton] [--tokens 128,4096] [--layers 1] [--steps 30]
        [--timing launched|device] [--json F]

Per (recipe, tokens): one Runtime at ep 1 (the local backend, the layers' own router, the
shared MLP on its side stream: what `launch --ep 1` runs) stepped eagerly, then one with
`cuda_graph=True` on the same seed; each the median over steps 1.. of the step time, and of the
host's time to issue a step. The last step's outputs of both must be equal bit for bit (same
kernels, same inputs), else the row says so. `--timing launched` (default) is what a decode
loop sees; `device` holds the GPU while the host issues (GPU time only, the ratio ~1 unless the
graph changes the GPU's work).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from epmoe.argtypes import at_least, int_list, model_name, name_list
from epmoe.config import RECIPES
from epmoe.outputs import dump_json, run_main, writable_file


def measure(model: str, recipe: str, experts: str, tokens: int, layers: int, steps: int,
            timing: str) -> dict:
    import torch

    from epmoe.config import QuantConfig
    from epmoe.plan.run import RunConfig
    from epmoe.runtime import Runtime

    row, outs = dict(recipe=recipe, tokens=tokens, experts=experts), {}
    for mode in ("eager", "graph"):
        run = RunConfig(model=model, quant=QuantConfig(recipe), tokens=tokens, layers=layers,
                        steps=steps, backend="local", experts=experts, timing=timing,
                        cuda_graph=mode == "graph")
        rt = Runtime(run)
        for s in range(steps):
            rt.step(s)
        row[f"{mode}_ms"] = statistics.median(rt.step_ms[1:])
        row[f"{mode}_host_ms"] = statistics.median(rt.host_ms[1:])
        outs[mode] = [rec["out"] for rec in rt.last]  # the last step's, on the host
        row["experts"] = rt.layers[0].experts.name
        del rt
        torch.cuda.empty_cache()
    row["ratio"] = row["graph_ms"] / row["eager_ms"]
    row["same_outputs"] = all(torch.equal(a, b) for a, b in zip(outs["eager"], outs["graph"]))
    return row


def table(rows: list[dict], timing: str) -> str:
    head = (f"{'recipe':<10}{'tokens':>7}{'experts':>9}{'eager ms':>10}{'graph ms':>10}"
            f"{'ratio':>7}{'host eager':>11}{'host graph':>11}  same")
    out = [f"one layer step, eager vs CUDA graph, --timing {timing} (median, steps 1..)", head,
           "-" * len(head)]
    out += [f"{r['recipe']:<10}{r['tokens']:>7}{r['experts']:>9}{r['eager_ms']:>10.3f}"
            f"{r['graph_ms']:>10.3f}{r['ratio']:>7.2f}{r['eager_host_ms']:>11.3f}"
            f"{r['graph_host_ms']:>11.3f}  {'yes' if r['same_outputs'] else 'NO'}" for r in rows]
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.graph_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_name, default="deepseek-v3")
    p.add_argument("--recipes", type=name_list(RECIPES), default="fp8_block,bf16")
    p.add_argument("--experts", default="triton", choices=("triton", "deepgemm", "auto"))
    p.add_argument("--tokens", type=int_list(1), default="128,4096",
                   help="tokens per step, comma separated")
    p.add_argument("--layers", type=at_least(1), default=1)
    p.add_argument("--steps", type=at_least(3), default=30, help="steps per mode (step 0: warm-up)")
    p.add_argument("--timing", default="launched", choices=("launched", "device"))
    p.add_argument("--json", default=None, type=writable_file, help="write the rows here")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    tokens = a.tokens
    import torch

    if not torch.cuda.is_available():
        print("error: graph_step needs a CUDA GPU (it captures CUDA graphs)", file=sys.stderr)
        return 2
    rows = []
    for recipe in a.recipes:
        for n in tokens:
            rows.append(measure(a.model, recipe, a.experts, n, a.layers, a.steps, a.timing))
            print(f"[{len(rows)}] {rows[-1]}", file=sys.stderr, flush=True)
    print(table(rows, a.timing))
    if a.json:
        with open(a.json, "w") as f:
            dump_json(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
