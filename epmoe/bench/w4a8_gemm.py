"""W4A8 grouped GEMM benchmark (GPU only): the fp8-MMA kernel (`epmoe.kernels.gemm_w4a8`,
`kernel='auto'`) against the bf16-decode pointer kernel and fp8_block's TMA kernel on the same
weights (the W4A8 ones dequantized and re-quantized), all in the same run.

    python -m epmoe.bench.w4a8_gemm [--tokens 128,512,4096] [--json FILE] [--small]

Shapes: DeepSeek-V4-Flash (hidden 4096, moe intermediate 2048: GEMM1 N=4096 K=4096, GEMM2
N=4096 K=2048), 256 experts, top-6, routing uniform random; the contiguous layout aligned to
128 (the auto kernel at the BLOCK_M TritonExperts picks, `w4a8_block_m`; the others at 128) and
the masked one (capacity 64, BLOCK_M 16 vs the pointer kernel's 64). --small: 16 experts,
N=K=512 (a smoke run). Times: median of many runs (`triton.testing.do_bench`).
"""

from __future__ import annotations

import argparse
import sys

import torch

from epmoe.argtypes import int_list
from epmoe.outputs import dump_json, run_main, writable_file

FLASH = dict(experts=256, top_k=6, shapes=(("GEMM1", 4096, 4096), ("GEMM2", 4096, 2048)))
SMALL = dict(experts=16, top_k=6, shapes=(("GEMM1", 512, 512), ("GEMM2", 512, 256)))
CAPACITY = 64


def _weights(e: int, n: int, k: int):
    """W4A8 weights (quantized 16 experts at a time: all at once runs out of memory at full
    width) and the same values as fp8_block."""
    from epmoe.config import QuantConfig
    from epmoe.quant import QWeight, dequantize_weight, quantize_weight

    w4, w8 = [], []
    for c in range(0, e, 16):
        q = quantize_weight(torch.randn(min(16, e - c), n, k, device="cuda") / k ** 0.5,
                            QuantConfig("w4a8_mxfp4"))
        w4.append(q)
        w8.append(quantize_weight(dequantize_weight(q), QuantConfig("fp8_block")))
    return (QWeight(torch.cat([q.data for q in w4]), torch.cat([q.scale for q in w4]),
                    "w4a8_mxfp4"),
            QWeight(torch.cat([q.data for q in w8]), torch.cat([q.scale for q in w8]),
                    "fp8_block"))


def _case(name: str, n: int, k: int, tokens: int, e: int, top_k: int, w4, w8) -> list[dict]:
    import triton.testing

    from epmoe.config import QuantConfig
    from epmoe.kernels.gemm_w4a8 import w4a8_block_m
    from epmoe.kernels.grouped_gemm import (triton_m_grouped_gemm_nt_contiguous as contig,
                                            triton_m_grouped_gemm_nt_masked as masked)
    from epmoe.layout import make_contiguous_layout, permute_qtensor
    from epmoe.quant import quantize_act

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")

    ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(tokens)]).int()
    lay = make_contiguous_layout(ids, e, 128)
    x = torch.randn(tokens, k, device="cuda")
    x4 = permute_qtensor(quantize_act(x, QuantConfig("w4a8_mxfp4")), lay)
    x8 = permute_qtensor(quantize_act(x, QuantConfig("fp8_block")), lay)
    y = torch.empty(lay.num_rows, n, dtype=torch.bfloat16, device="cuda")
    bm = w4a8_block_m(tokens * top_k / e, 128)
    shape = f"{name} N={n} K={k} T={tokens}"
    old = ms(lambda: contig(x4, w4, lay, out=y, kernel="pointer"))
    valid = lay.row_expert_M >= 0
    ref = y[valid].float()
    new = ms(lambda: contig(x4, w4, lay, out=y, block_m=bm))
    diff = float((y[valid].float() - ref).abs().max() / ref.abs().max())
    fp8 = ms(lambda: contig(x8, w8, lay, out=y))
    rows = [dict(layout="contiguous", shape=shape, block_m=bm, auto_us=new * 1e3,
                 pointer_us=old * 1e3, fp8_block_us=fp8 * 1e3, rel_diff=diff)]
    if tokens * top_k / e <= CAPACITY:
        counts = torch.bincount(ids.flatten().long(), minlength=e).int().clamp(max=CAPACITY)
        xm = quantize_act(torch.randn(e, CAPACITY, k, device="cuda"), QuantConfig("w4a8_mxfp4"))
        ym = torch.empty(e, CAPACITY, n, dtype=torch.bfloat16, device="cuda")
        old = ms(lambda: masked(xm, w4, counts, block_m=64, out=ym, kernel="pointer"))
        live = torch.arange(CAPACITY, device="cuda")[None, :] < counts[:, None]
        ref = ym[live].float()
        new = ms(lambda: masked(xm, w4, counts, block_m=16, out=ym))
        diff = float((ym[live].float() - ref).abs().max() / ref.abs().max())
        rows.append(dict(layout="masked", shape=shape, block_m=16, auto_us=new * 1e3,
                         pointer_us=old * 1e3, fp8_block_us=None, rel_diff=diff))
    return rows


def line(r: dict) -> str:
    fp8 = "" if r["fp8_block_us"] is None else (
        f" fp8_block {r['fp8_block_us']:7.0f} ({r['auto_us'] / r['fp8_block_us']:.2f}x)")
    return (f"{r['layout'][:6]:<6} {r['shape']:<24} bm{r['block_m']:<3} {r['auto_us']:7.0f}us "
            f"ptr {r['pointer_us'] / r['auto_us']:4.2f}x" + fp8 + f" diff {r['rel_diff']:.0e}")


def run(tokens, spec=FLASH, json_path=None) -> list[dict]:
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  us of the auto "
          f"kernel; ptr = pointer kernel time / auto; fp8_block: its time (auto / it); diff: "
          f"max |auto - pointer| / max |pointer| (summation order; 1e-2 fails the run)")
    rows = []
    for name, n, k in spec["shapes"]:
        w4, w8 = _weights(spec["experts"], n, k)
        for t in tokens:
            for r in _case(name, n, k, t, spec["experts"], spec["top_k"], w4, w8):
                print(line(r), flush=True)
                rows.append(r)
                if not r["rel_diff"] <= 1e-2:
                    raise SystemExit(f"the auto and pointer kernels disagree at {r['shape']} "
                                     f"({r['layout']}): {r['rel_diff']:.2e} > 1e-2")
        del w4, w8
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            dump_json({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.w4a8_gemm",
                                description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int_list(1), default="128,512,4096",
                   help="token counts, comma-separated")
    p.add_argument("--json", type=writable_file, help="write the results as JSON to this file")
    p.add_argument("--small", action="store_true", help="16 experts, N=K=512: a smoke run")
    args = p.parse_args(argv)
    tokens = args.tokens
    if not torch.cuda.is_available():
        print("epmoe.bench.w4a8_gemm needs a CUDA GPU; run it on a GPU machine",
              file=sys.stderr)
        return 2
    run(tokens, SMALL if args.small else FLASH, args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
