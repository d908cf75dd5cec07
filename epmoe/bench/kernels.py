"""Kernel benchmark (GPU only): every Triton kernel of the expert path and the router at
DeepSeek-V3 shapes, each with a baseline measured in the same run.

    python -m epmoe.bench.kernels [--json FILE] [--quick | --tokens 4096,16384]

Shapes: hidden 7168, moe intermediate 2048 (GEMM1 N=4096, K=7168; GEMM2 N=7168, K=2048),
32 local experts, 4096 and 16384 tokens x top-8, routing uniform random; router: 256 experts,
8 groups, 4 kept, top-8 (DeepSeek-V3). Baselines: bandwidth kernels vs an HBM copy of the same
byte count (read + write counted); fp8-block GEMM vs DeepGEMM `m_grouped_fp8_gemm_nt_contiguous`
when importable, else `torch._scaled_grouped_mm` (row-wise scales: cheaper than 128x128
blocks); bf16 GEMM vs `torch._grouped_mm`; router vs the torch router (fp32 gate matmul + torch
top-k). "before" rows run the previous kernel in the same process (the pointer GEMM, the
exact-size permute with its host sync, the plain-torch quantizer). Times: median of many runs
(`triton.testing.do_bench`, L2 flushed between runs).
"""

from __future__ import annotations

import argparse
import sys

import torch

from epmoe.argtypes import int_list, name_list
from epmoe.config import MoEConfig, QuantConfig
from epmoe.outputs import dump_json, run_main, writable_file

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 7168, 2048, 32, 8
ROUTER_CFG = MoEConfig("dsv3-router", hidden=HIDDEN, moe_intermediate=INTER, num_experts=256,
                       top_k=8, router="sigmoid_grouped", n_group=8, topk_group=4,
                       routed_scaling_factor=2.5)
FP8 = QuantConfig("fp8_block")
VOCAB = 4096  # the hash router's table rows (the lookup's cost does not depend on it)


def bench_ms(fn, rep: int = 100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_ms(num_bytes: int) -> float:
    x = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return bench_ms(lambda: y.copy_(x))


def mem_row(name, shape, ms, num_bytes, base=None):
    """Bytes = read + write; ratio = achieved bandwidth / copy bandwidth at the same bytes."""
    base = copy_ms(num_bytes // 2) if base is None else base  # a copy of n bytes moves 2n
    gbs = num_bytes / ms / 1e6
    return dict(name=name, shape=shape, ms=ms, metric=f"{gbs:.0f} GB/s", value=gbs,
                baseline="HBM copy", baseline_ms=base, ratio=base / ms)


def gemm_row(name, shape, ms, flops, base_name, base_ms):
    tf = flops / ms / 1e9
    return dict(name=name, shape=shape, ms=ms, metric=f"{tf:.0f} TFLOPS", value=tf,
                baseline=base_name, baseline_ms=base_ms,
                ratio=(base_ms / ms) if base_ms else None)


def fp8_baseline(xq, wq, layout, m, n):
    """(name, ms) of the best available fp8 grouped GEMM baseline."""
    try:
        import deep_gemm

        from epmoe.experts.deepgemm_experts import sm90_act_scale

        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        scale = sm90_act_scale(xq.scale)  # DeepGEMM SM90 reads MN-major fp32 scales
        fn = lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(  # noqa: E731
            (xq.data, scale), (wq.data, wq.scale), out, layout.row_expert_M)
        fn()
        return "DeepGEMM m_grouped_fp8_gemm_nt_contiguous", bench_ms(fn)
    except (ImportError, OSError):
        pass
    except Exception as exc:  # noqa: BLE001  (a refused call: fall back, say why)
        print(f"# DeepGEMM baseline failed: {type(exc).__name__}: {str(exc)[:200]}",
              file=sys.stderr)
    sa = torch.rand(m, device="cuda", dtype=torch.float32) + 0.5
    sb = torch.rand(wq.data.shape[0], n, device="cuda", dtype=torch.float32) + 0.5
    offs = layout.offsets_E1[1:].contiguous()
    try:
        fn = lambda: torch._scaled_grouped_mm(  # noqa: E731
            xq.data, wq.data.transpose(1, 2), sa, sb, offs=offs, out_dtype=torch.bfloat16)
        fn()
        return "torch._scaled_grouped_mm (row-wise scales)", bench_ms(fn)
    except (RuntimeError, AttributeError, TypeError) as exc:
        return f"no fp8 grouped baseline ({type(exc).__name__})", None


def bf16_baseline(x, w, layout):
    try:
        offs = layout.offsets_E1[1:].contiguous()
        fn = lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)  # noqa: E731
        fn()
        return "torch._grouped_mm", bench_ms(fn)
    except (RuntimeError, AttributeError, TypeError) as exc:
        return f"torch._grouped_mm unavailable ({type(exc).__name__})", None


def routing(t: int, dev="cuda"):
    ids = torch.rand(t, NUM_EXPERTS, device=dev).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    return ids, torch.rand(t, TOP_K, device=dev)


def gemm_inputs(layout, recipe: str, n: int, k: int):
    """(x QTensor [M, K], w QWeight [E, N, K]) with random values."""
    from epmoe.quant import quantize_act, quantize_weight

    q = QuantConfig(recipe)
    w = quantize_weight(torch.randn(NUM_EXPERTS, n, k, device="cuda") / k ** 0.5, q)
    return quantize_act(torch.randn(layout.num_rows, k, device="cuda"), q), w


def bandwidth_rows(t: int, picks: dict, before: bool = True) -> list[dict]:
    from epmoe.kernels.act_quant import triton_act_quant
    from epmoe.kernels.gather import triton_unpermute_reduce
    from epmoe.kernels.permute import PermuteWorkspace, triton_permute
    from epmoe.kernels.quantize import quantize_tokens
    from epmoe.quant import quantize_act

    k, e, d, i = TOP_K, NUM_EXPERTS, HIDDEN, INTER
    cfg = MoEConfig("bench", hidden=d, moe_intermediate=i, num_experts=e, top_k=k)
    tag, rows = f"T={t} K={k} E={e}", []
    xb = torch.randn(t, d, device="cuda").to(torch.bfloat16)
    qb = t * d * 2 + t * d  # bf16 in, fp8 out (scales: under 2% more, not counted)
    for name, quant, extra in (("fp8 fp32 scales", FP8, {}),
                               ("fp8 fp32 MN-major", FP8, dict(mn_major=True)),
                               ("fp8 UE8M0 packed", QuantConfig("fp8_block", "ue8m0_packed"), {}),
                               ("mxfp8 e8m0", QuantConfig("mxfp8"), {})):
        out = quantize_tokens(xb, quant, **extra)
        qcfg = picks.get(f"quant{quant.act_group}")
        ms = bench_ms(lambda: quantize_tokens(xb, quant, out=out, config=qcfg, **extra))
        rows.append(mem_row(f"quantize_tokens {name}", f"T={t} D={d}", ms, qb))
    if before:
        ms = bench_ms(lambda: quantize_act(xb, FP8))
        rows.append(mem_row("before: torch quantize_act fp8", f"T={t} D={d}", ms, qb))

    ids, weights = routing(t)
    x = quantize_act(xb, FP8)
    pb = 2 * t * k * (d + 4 * (d // 128))
    ms = bench_ms(lambda: triton_permute(x, ids, e, alignment=128))
    rows.append(mem_row("permute exact size (host sync)", f"{tag} D={d}", ms, pb))
    ws = PermuteWorkspace.create(t, k, e, 128, d, FP8, "cuda")
    ms = bench_ms(lambda: triton_permute(x, ids, e, alignment=128, workspace=ws))
    rows.append(mem_row("permute workspace (no sync)", f"{tag} D={d}", ms, pb))

    _, layout = triton_permute(x, ids, e, alignment=128)
    m = layout.num_rows
    y = torch.randn(m, d, device="cuda").to(torch.bfloat16)
    ms = bench_ms(lambda: triton_unpermute_reduce(y, layout, weights))
    rows.append(mem_row("gather-reduce bf16", f"{tag} D={d}", ms, t * k * d * 2 + t * d * 2))
    h = torch.randn(m, 2 * i, device="cuda").to(torch.bfloat16)
    ms = bench_ms(lambda: triton_act_quant(h, cfg, FP8))
    rows.append(mem_row("silu*up + fp8 quant", f"M={m} 2I={2 * i}", ms,
                        m * 2 * i * 2 + m * i + m * (i // 128) * 4))
    rows += _act_quant_padding_rows(t, x, ids, ws, cfg, before)
    return rows + residual_rows(t, xb, before)


def residual_rows(t: int, xb, before: bool) -> list[dict]:
    """Between two layers of the runtime's stack: the pre-norm (rms_norm of the residual) and
    the residual add (bf16 in and out, fp32 sum): the runtime's "norm" and "residual" stages."""
    from epmoe.plan.traffic import norm_bytes, residual_bytes
    from epmoe.runtime import pre_norm, residual_add

    d, rows = xb.shape[1], []
    out = torch.randn_like(xb)
    ms = bench_ms(lambda: pre_norm(xb))
    rows.append(mem_row("pre-norm rms_norm bf16", f"T={t} D={d}", ms, norm_bytes(t, d)))
    ms = bench_ms(lambda: residual_add(xb, out))
    rows.append(mem_row("residual add bf16 (fp32 opmath)", f"T={t} D={d}", ms,
                        residual_bytes(t, d)))
    if before:
        ms = bench_ms(lambda: (xb.float() + out.float()).to(torch.bfloat16))
        rows.append(mem_row("before: residual add via fp32 copies", f"T={t} D={d}", ms,
                            residual_bytes(t, d)))
    return rows


def _act_quant_padding_rows(t: int, x, ids, ws, cfg, before: bool) -> list[dict]:
    """act+quant over the no-sync path's worst-case layout: the valid rows only (what the
    experts run) and, as the baseline in the same run, every row (before padding was skipped).
    Bytes: the valid rows' (the work both do for the layer)."""
    from epmoe.kernels.act_quant import ValidRows, triton_act_quant
    from epmoe.kernels.permute import triton_permute

    i = cfg.moe_intermediate
    _, lay = triton_permute(x, ids, cfg.num_experts, alignment=128, workspace=ws)
    m = lay.num_rows
    h = torch.randn(m, 2 * i, device="cuda").to(torch.bfloat16)
    valid = int((lay.row_expert_M >= 0).sum())
    b = valid * (2 * i * 2 + i + (i // 128) * 4)
    rows = []
    for name, quant in (("fp8", FP8), ("bf16", QuantConfig("bf16"))):
        ms = bench_ms(lambda: triton_act_quant(h, cfg, quant,
                                               rows=ValidRows.contiguous(lay.row_expert_M)))
        rows.append(mem_row(f"act+quant {name}, valid rows", f"T={t} rows {valid}/{m}", ms, b))
        if before:
            ms = bench_ms(lambda: triton_act_quant(h, cfg, quant))
            rows.append(mem_row(f"before: act+quant {name}, all rows", f"T={t} M={m}", ms, b))
    return rows


def gemm_rows(t: int, picks: dict, before: bool = True) -> list[dict]:
    from epmoe.kernels.grouped_gemm import triton_m_grouped_gemm_nt_contiguous as gemm
    from epmoe.kernels.permute import triton_make_contiguous_layout

    ids, _ = routing(t)
    layout = triton_make_contiguous_layout(ids, NUM_EXPERTS, alignment=128)
    m, rows = layout.num_rows, []
    for gname, n, k in (("GEMM1", 2 * INTER, HIDDEN), ("GEMM2", HIDDEN, INTER)):
        flops = 2 * t * TOP_K * n * k
        shape = f"M={m} N={n} K={k}"
        for recipe in ("fp8_block", "bf16"):
            x, w = gemm_inputs(layout, recipe, n, k)
            out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
            cfg = picks.get(f"{recipe}/{gname}")
            ms_new = bench_ms(lambda: gemm(x, w, layout, config=cfg, out=out))
            ms_old = bench_ms(lambda: gemm(x, w, layout, out=out, kernel="pointer")) \
                if before else None
            if recipe == "fp8_block":
                base_name, base_ms = fp8_baseline(x, w, layout, m, n)
            else:
                base_name, base_ms = bf16_baseline(x.data, w.data, layout)
            label = "fp8-block" if recipe == "fp8_block" else "bf16"
            rows.append(gemm_row(f"{label} {gname} TMA", shape, ms_new, flops, base_name,
                                 base_ms))
            if before:
                rows.append(gemm_row(f"before: {label} {gname} pointer", shape, ms_old, flops,
                                     base_name, base_ms))
            del x, w, out
    return rows


def router_rows(t: int, picks: dict) -> list[dict]:
    from epmoe.kernels.gate_topk import triton_gate_route
    from epmoe.router import hash_gate_route, hash_route, route

    x = torch.randn(t, HIDDEN, device="cuda").to(torch.bfloat16)
    gate = torch.randn(ROUTER_CFG.num_experts, HIDDEN, device="cuda") / HIDDEN ** 0.5
    gate_bf16 = gate.to(torch.bfloat16)
    bias = torch.randn(ROUTER_CFG.num_experts, device="cuda") * 0.01

    def torch_router():
        return route(x.float() @ gate.T, ROUTER_CFG, bias, backend="torch")

    base = bench_ms(torch_router)
    ms = bench_ms(lambda: triton_gate_route(x, gate_bf16, ROUTER_CFG, bias,
                                            config=picks.get("router")))
    flops = 2 * t * ROUTER_CFG.num_experts * HIDDEN
    shape = f"T={t} E=256 D={HIDDEN}"
    # a hash layer (DeepSeek-V4's first layers) on the same gate: the table's experts, their
    # sqrt(softplus) scores; before: fp32 logits and the torch lookup (the runtime's old path)
    hcfg = ROUTER_CFG.replace(router="sqrtsoftplus", n_group=1, topk_group=1, num_moe_layers=1,
                              hash_layers=(0,), vocab_size=VOCAB)
    table = torch.stack([torch.randperm(256, device="cuda")[:hcfg.top_k]
                         for _ in range(VOCAB)]).int()
    tok = torch.randint(0, VOCAB, (t,), device="cuda")
    hbase = bench_ms(lambda: hash_route(x.float() @ gate.T, hcfg, table, tok, backend="torch"))
    hms = bench_ms(lambda: hash_gate_route(x, gate_bf16, hcfg, table, tok))
    return [dict(name="router fused gate+top-k", shape=shape, ms=ms,
                 metric=f"{flops / ms / 1e9:.0f} TFLOPS", value=ms * 1e3,
                 baseline="torch router (fp32 matmul)", baseline_ms=base, ratio=base / ms),
            dict(name="hash router fused (V4 hash layer)", shape=shape, ms=hms,
                 metric=f"{flops / hms / 1e9:.0f} TFLOPS", value=hms * 1e3,
                 baseline="torch hash route (fp32 matmul)", baseline_ms=hbase,
                 ratio=hbase / hms)]


GROUPS = ("router", "bandwidth", "gemm")


def run_case(t: int, picks: dict | None = None, before: bool = True,
             groups=GROUPS) -> list[dict]:
    """The groups' rows at T tokens; before=False skips the previous kernels' rows."""
    picks = picks or {}
    torch.manual_seed(0)
    fns = {"router": router_rows, "bandwidth": lambda t, p: bandwidth_rows(t, p, before),
           "gemm": lambda t, p: gemm_rows(t, p, before)}
    rows = []
    for g in groups:
        rows += fns[g](t, picks)
        torch.cuda.empty_cache()
    return rows


def line(r: dict) -> str:
    ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
    base = "" if r["baseline_ms"] is None else f" vs {r['baseline_ms'] * 1e3:.1f}us"
    return f"{r['name'][:28]:<28} {r['ms'] * 1e3:8.1f}us {r['metric']:>11} {ratio:>6}{base}"


def table(rows: list[dict]) -> str:
    out = ["| kernel | shape | time (us) | throughput | baseline | baseline (us) | ratio |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        b = "n/a" if r["baseline_ms"] is None else f"{r['baseline_ms'] * 1e3:.1f}"
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        out.append(f"| {r['name']} | {r['shape']} | {r['ms'] * 1e3:.1f} | {r['metric']} | "
                   f"{r['baseline']} | {b} | {ratio} |")
    return "\n".join(out)


def run(token_counts, picks=None, json_path=None, before: bool = True,
        groups=GROUPS) -> list[dict]:
    rows = []
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  bandwidth ratio = "
          f"achieved / HBM copy; GEMM and router ratio = baseline time / ours", flush=True)
    for t in token_counts:
        for r in run_case(t, picks, before, groups):
            r["tokens"] = t
            print(f"T={t:<6}" + line(r), flush=True)
            rows.append(r)
        if json_path:  # after each token count: a run cut short keeps what it measured
            with open(json_path, "w") as f:
                dump_json({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "rows": rows}, f, indent=1)
    print()
    print(table(rows))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.kernels",
                                description=__doc__.splitlines()[0])
    p.add_argument("--json", type=writable_file, help="write the results as JSON to this file")
    p.add_argument("--quick", action="store_true", help="4096 tokens only")
    p.add_argument("--tokens", type=int_list(1), default="4096,16384",
                   help="token counts, comma-separated")
    p.add_argument("--skip-before", action="store_true",
                   help="skip the previous kernels' rows (pointer GEMM, torch quantizer)")
    p.add_argument("--only", type=name_list(GROUPS), default=",".join(GROUPS),
                   help=f"row groups, comma-separated (default all: {','.join(GROUPS)})")
    args = p.parse_args(argv)
    groups = args.only
    if not torch.cuda.is_available():
        print("epmoe.bench.kernels needs a CUDA GPU (the CPU interpreter's timings mean "
              "nothing); run it on a GPU machine", file=sys.stderr)
        return 2
    tokens = (4096,) if args.quick else args.tokens
    run(tokens, json_path=args.json, before=not args.skip_before, groups=groups)
    return 0


if __name__ == "__main__":
    run_main(main)
