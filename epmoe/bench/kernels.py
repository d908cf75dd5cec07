"""Kernel benchmark (GPU only): Triton permute / gather / act+quant / grouped GEMMs at
DeepSeek-V3 shapes, each with a ratio to a baseline measured in the same run.

    python -m epmoe.bench.kernels [--json FILE] [--quick]

Shapes: hidden 7168, moe intermediate 2048 (GEMM1 N=4096, K=7168; GEMM2 N=7168, K=2048),
32 local experts, 4096 and 16384 tokens x top-8, routing uniform random.
Baselines: memory-bound kernels vs an HBM copy of a comparable byte count
(`torch.empty_like(x).copy_(x)`, read + write counted); fp8-block GEMM vs DeepGEMM
`m_grouped_fp8_gemm_nt_contiguous` when importable, else torch's fp8 grouped / per-expert
scaled GEMM (row-wise scales: a cheaper scaling than 128x128 blocks, said in the line);
bf16 GEMM vs `torch._grouped_mm`. Times: median of >= 20 runs (triton.testing.do_bench).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from epmoe.config import MoEConfig, QuantConfig

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 7168, 2048, 32, 8


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # ms


def _copy_ms(num_bytes: int) -> float:
    x = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return _bench(lambda: y.copy_(x))


def _mem_row(name, shape, ms, num_bytes):
    """Bytes = read + write; ratio = achieved bandwidth / copy bandwidth at the same bytes."""
    base = _copy_ms(num_bytes // 2)  # copy of n bytes moves 2n
    gbs = num_bytes / ms / 1e6
    return dict(name=name, shape=shape, ms=ms, metric=f"{gbs:.0f} GB/s", value=gbs,
                baseline="HBM copy", baseline_ms=base, ratio=base / ms)


def _gemm_row(name, shape, ms, flops, base_name, base_ms):
    tf = flops / ms / 1e9
    return dict(name=name, shape=shape, ms=ms, metric=f"{tf:.0f} TFLOPS", value=tf,
                baseline=base_name, baseline_ms=base_ms,
                ratio=(base_ms / ms) if base_ms else None)


def _fp8_baseline(xq, wq, layout, m, n, k):
    """(name, ms) of the best available fp8 grouped GEMM baseline."""
    try:
        import deep_gemm  # noqa: F401

        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        scale = xq.scale  # DeepGEMM SM90 wants MN-major fp32 activation scales
        fn = lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(  # noqa: E731
            (xq.data, scale), (wq.data, wq.scale), out, layout.row_expert_M)
        return "DeepGEMM m_grouped_fp8_gemm_nt_contiguous", _bench(fn)
    except (ImportError, OSError, RuntimeError, AttributeError, TypeError):
        pass
    a = xq.data
    b = wq.data  # [E, N, K]
    sa = torch.rand(m, device="cuda", dtype=torch.float32) + 0.5
    sb = torch.rand(b.shape[0], n, device="cuda", dtype=torch.float32) + 0.5
    offs = layout.offsets_E1[1:].contiguous()
    try:
        fn = lambda: torch._scaled_grouped_mm(  # noqa: E731
            a, b.transpose(1, 2), sa, sb, offs=offs, out_dtype=torch.bfloat16)
        fn()
        return "torch._scaled_grouped_mm (row-wise scales)", _bench(fn)
    except (RuntimeError, AttributeError, TypeError):
        pass
    bounds = layout.offsets_E1.tolist()

    def loop():
        for e in range(b.shape[0]):
            s, t = bounds[e], bounds[e + 1]
            if t > s:
                torch._scaled_mm(a[s:t], b[e].t(), sa[s:t, None], sb[e][None, :],
                                 out_dtype=torch.bfloat16)
    loop()
    return "torch._scaled_mm per-expert loop (row-wise scales)", _bench(loop)


def _bf16_baseline(x, w, layout):
    try:
        offs = layout.offsets_E1[1:].contiguous()
        fn = lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)  # noqa: E731
        fn()
        return "torch._grouped_mm", _bench(fn)
    except (RuntimeError, AttributeError, TypeError) as exc:
        return f"torch._grouped_mm unavailable ({type(exc).__name__})", None


def run_case(num_tokens: int) -> list[dict]:
    from epmoe.kernels.act_quant import triton_act_quant
    from epmoe.kernels.gather import triton_unpermute_reduce
    from epmoe.kernels.grouped_gemm import triton_m_grouped_gemm_nt_contiguous
    from epmoe.kernels.permute import triton_permute
    from epmoe.quant import quantize_act, quantize_weight

    torch.manual_seed(0)
    dev = "cuda"
    t, k, e, d, i = num_tokens, TOP_K, NUM_EXPERTS, HIDDEN, INTER
    cfg = MoEConfig("bench", hidden=d, moe_intermediate=i, num_experts=e, top_k=k)
    fp8 = QuantConfig("fp8_block")
    ids = torch.rand(t, e, device=dev).argsort(dim=1)[:, :k].to(torch.int32)  # uniform top-k
    weights = torch.rand(t, k, device=dev)
    x = quantize_act(torch.randn(t, d, device=dev), fp8)
    rows = []
    tag = f"T={t} K={k} E={e}"

    xp, layout = triton_permute(x, ids, e, alignment=128)
    m = layout.num_rows
    pairs = t * k
    ms = _bench(lambda: triton_permute(x, ids, e, alignment=128))
    rows.append(_mem_row("permute fp8+scales", f"{tag} D={d}", ms,
                         2 * pairs * (d + 4 * (d // 128))))

    y = torch.randn(m, d, device=dev).to(torch.bfloat16)
    ms = _bench(lambda: triton_unpermute_reduce(y, layout, weights))
    rows.append(_mem_row("gather-reduce bf16", f"{tag} D={d}", ms, pairs * d * 2 + t * d * 2))

    h = torch.randn(m, 2 * i, device=dev).to(torch.bfloat16)
    ms = _bench(lambda: triton_act_quant(h, cfg, fp8))
    rows.append(_mem_row("silu*up + fp8 quant", f"M={m} 2I={2 * i}", ms,
                         m * 2 * i * 2 + m * i + m * (i // 128) * 4))

    for gname, n_out, k_in in (("GEMM1", 2 * i, d), ("GEMM2", d, i)):
        w = torch.randn(e, n_out, k_in, device=dev) / k_in ** 0.5
        wq = quantize_weight(w, fp8)
        xq = quantize_act(torch.randn(m, k_in, device=dev), fp8)
        flops = 2 * pairs * n_out * k_in
        ms = _bench(lambda: triton_m_grouped_gemm_nt_contiguous(xq, wq, layout))
        base_name, base_ms = _fp8_baseline(xq, wq, layout, m, n_out, k_in)
        rows.append(_gemm_row(f"fp8-block grouped {gname}", f"M={m} N={n_out} K={k_in}", ms,
                              flops, base_name, base_ms))
        wb = quantize_weight(w, QuantConfig("bf16"))
        xb = quantize_act(torch.randn(m, k_in, device=dev), QuantConfig("bf16"))
        ms = _bench(lambda: triton_m_grouped_gemm_nt_contiguous(xb, wb, layout))
        base_name, base_ms = _bf16_baseline(xb.data, wb.data, layout)
        rows.append(_gemm_row(f"bf16 grouped {gname}", f"M={m} N={n_out} K={k_in}", ms, flops,
                              base_name, base_ms))
        del w, wq, wb, xq, xb
    return rows


def _line(r: dict) -> str:
    ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
    return (f"{r['name']:<26} {r['shape']:<28} {r['ms'] * 1e3:9.1f} us  {r['metric']:>12}  "
            f"vs {r['baseline']}: {ratio}")


def _table(rows: list[dict]) -> str:
    out = ["| kernel | shape | time (us) | throughput | baseline | baseline (us) | ratio |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        b = "n/a" if r["baseline_ms"] is None else f"{r['baseline_ms'] * 1e3:.1f}"
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        out.append(f"| {r['name']} | {r['shape']} | {r['ms'] * 1e3:.1f} | {r['metric']} | "
                   f"{r['baseline']} | {b} | {ratio} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results as JSON to this file")
    p.add_argument("--quick", action="store_true", help="4096 tokens only")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("epmoe.bench.kernels needs a CUDA GPU (the CPU interpreter's timings mean "
              "nothing); run it on a GPU machine", file=sys.stderr)
        return 2
    rows = []
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"memory-bound ratio = achieved / HBM-copy bandwidth; GEMM ratio = baseline time / "
          f"Triton time", flush=True)
    for t in (4096,) if args.quick else (4096, 16384):
        for r in run_case(t):
            print(_line(r), flush=True)
            rows.append(r)
        torch.cuda.empty_cache()
    print()
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
