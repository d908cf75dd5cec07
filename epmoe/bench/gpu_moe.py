"""GPU benchmarks of the production path, each case against a same-run baseline.

    python -m epmoe.bench.gpu_moe --json runs/gpu_moe.json [--only a,b,c,d,e]

(a) grouped GEMM through DeepGemmExperts vs the raw deep_gemm call (DeepSeek-V3 shapes, E=32,
    512 tokens/expert)                                      goal: overhead <= 5%
(b) one-GPU experts (permute -> GEMM1 -> act+quant -> GEMM2 -> gather), 4096 tokens x top-8
    over 32 local experts vs raw GEMM1 + GEMM2 at the same rows          goal: <= 1.15x
(c) two GPUs, HT dispatch+combine, 4096 tokens/rank, hidden 7168, 256 experts, top-8:
    deepep-ht (ours) vs raw DeepEP vs all2all (NCCL), GB/s
(d) LL dispatch (fp8) / combine at 128 tokens/rank: ours vs raw DeepEP, us
(e) one layer step at ep=2 (HT and LL, DeepGEMM experts) vs the sum of its parts
(t) Triton experts path (same shapes as (b)) vs its own raw Triton GEMM1 + GEMM2   <= 1.15x
(s) whole one-rank layer step, DeepSeek-V3 at ep 1 (256 local experts, router + routed +
    shared, 4096 tokens, DeepGEMM) vs the sum of its raw GEMMs (routed + shared)   <= 1.25x;
    fp8 step vs bf16 step (< 1); overlap = (sum of stage times - step) / sum; weights
    generated on the device (seconds to build the layer)
Needs CUDA; (a), (b), (t), (s) one GPU; (c)-(e) 2 GPUs, deep_ep and deep_gemm. One line per
case. `--only a,b,t,s` on one GPU (the default there).
"""

from __future__ import annotations

import argparse
import os

import torch

from epmoe.argtypes import name_list
from epmoe.config import QuantConfig, get_preset
from epmoe.outputs import dump_json, run_main, writable_file

CASES = ("a", "b", "t", "s", "c", "d", "e")  # the docstring's cases

DSV3 = get_preset("deepseek-v3")
FP8 = QuantConfig("fp8_block")
BF16 = QuantConfig("bf16")


def _bench(fn, iters: int = 20, warmup: int = 3) -> float:
    """Mean over `iters` back-to-back calls, in us (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / iters


def _line(rows: list, case: str, shape: str, us: float, base_name: str, base_us: float,
          extra: str = "", **kw) -> None:
    ratio = us / base_us if base_us else float("nan")
    print(f"{case:<34} {shape:<40} {us:10.1f} us  vs {base_name}: {base_us:10.1f} us  "
          f"ratio {ratio:5.3f} {extra}", flush=True)
    rows.append(dict(case=case, shape=shape, us=us, baseline=base_name, baseline_us=base_us,
                     ratio=ratio, **kw))


def _experts(num_experts: int, device, quant=FP8):
    from epmoe.experts.base import ExpertWeights
    from epmoe.experts.deepgemm_experts import DeepGemmExperts
    from epmoe.quant import quantize_weight

    i, d = DSV3.moe_intermediate, DSV3.hidden
    w13 = [quantize_weight(torch.randn(1, 2 * i, d, device=device) / d ** 0.5, quant)
           for _ in range(num_experts)]
    w2 = [quantize_weight(torch.randn(1, d, i, device=device) / i ** 0.5, quant)
          for _ in range(num_experts)]

    def cat(ws):
        from epmoe.quant import QWeight

        return QWeight(torch.cat([w.data for w in ws]),
                       None if ws[0].scale is None else torch.cat([w.scale for w in ws]),
                       ws[0].recipe, ws[0].scale_fmt)

    ew = ExpertWeights(cat(w13), cat(w2), torch.arange(num_experts, device=device))
    return DeepGemmExperts(ew, DSV3, quant)


def _routing(t: int, num_experts: int, k: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(t, num_experts, device=device, generator=g).topk(k, dim=1).indices
    w = torch.rand(t, k, device=device, generator=g)
    return ids.to(torch.int64), w


def bench_gemm(rows, device):
    """(a) and (b)."""
    import deep_gemm as dg

    from epmoe.quant import quantize_act

    e, per = 32, 512
    ex = _experts(e, device)
    m = e * per
    m_idx = torch.arange(e, device=device, dtype=torch.int32).repeat_interleave(per)
    for name, w, n, k in (("gemm1", ex.w13, 2 * DSV3.moe_intermediate, DSV3.hidden),
                          ("gemm2", ex.w2, DSV3.hidden, DSV3.moe_intermediate)):
        xq = quantize_act(torch.randn(m, k, device=device), FP8)
        out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        raw = _bench(lambda: dg.m_grouped_fp8_gemm_nt_contiguous(
            (xq.data, xq.scale), w, out, m_idx))
        ours = _bench(lambda: ex.gemm_contiguous(xq, w, m_idx, n))
        tflops = 2 * m * n * k / ours / 1e6
        _line(rows, f"(a) DeepGemmExperts {name}", f"E={e} M={m} N={n} K={k}", ours,
              "raw deep_gemm", raw, f"{tflops:.0f} TFLOPS", tflops=tflops)
    # (b) one-GPU experts: 4096 tokens x top-8 over 32 local experts
    t, topk = 4096, 8
    x = quantize_act(torch.randn(t, DSV3.hidden, device=device), FP8)
    ids, w = _routing(t, e, topk, device)
    ids = ids.to(torch.int32)
    from epmoe.kernels.permute import triton_permute

    xp, lay = triton_permute(x, ids, e, alignment=ex.alignment)
    i = DSV3.moe_intermediate
    h_in = quantize_act(torch.randn(lay.num_rows, i, device=device), FP8)
    o1 = torch.empty(lay.num_rows, 2 * i, device=device, dtype=torch.bfloat16)
    o2 = torch.empty(lay.num_rows, DSV3.hidden, device=device, dtype=torch.bfloat16)

    def raw_pair():
        dg.m_grouped_fp8_gemm_nt_contiguous((xp.data, xp.scale), ex.w13, o1, lay.row_expert_M)
        dg.m_grouped_fp8_gemm_nt_contiguous((h_in.data, h_in.scale), ex.w2, o2,
                                            lay.row_expert_M)

    raw = _bench(raw_pair)
    ours = _bench(lambda: ex.apply(x, ids, w))
    _line(rows, "(b) experts.apply (1 GPU)", f"T={t} K={topk} E={e} M={lay.num_rows}", ours,
          "raw GEMM1+GEMM2", raw, "goal <= 1.10x")


def bench_triton(rows, device):
    """(t) the Triton experts path against its own GEMMs at the rows of (b)."""
    from epmoe.experts.triton_experts import TritonExperts
    from epmoe.kernels.grouped_gemm import triton_m_grouped_gemm_nt_contiguous as tgemm
    from epmoe.kernels.permute import triton_permute
    from epmoe.quant import quantize_act

    e, t, topk = 32, 4096, 8
    ex = TritonExperts(_experts(e, device).weights, DSV3, FP8)
    x = quantize_act(torch.randn(t, DSV3.hidden, device=device), FP8)
    ids, w = _routing(t, e, topk, device)
    ids = ids.to(torch.int32)
    xp, lay = triton_permute(x, ids, e, alignment=ex.alignment)
    h_in = quantize_act(torch.randn(lay.num_rows, DSV3.moe_intermediate, device=device), FP8)
    raw = _bench(lambda: (tgemm(xp, ex.weights.w13, lay), tgemm(h_in, ex.weights.w2, lay)))
    ours = _bench(lambda: ex.apply(x, ids, w))
    _line(rows, "(t) TritonExperts.apply (1 GPU)", f"T={t} K={topk} E={e} M={lay.num_rows}",
          ours, "raw Triton GEMM1+GEMM2", raw, "goal <= 1.15x")


def _step_case(quant, device, tokens: int = 4096, steps: int = 10):
    """One DeepSeek-V3 layer at ep 1: -> (build s, step us, stage ms, raw GEMMs us, layer)."""
    import time

    from epmoe.plan.run import RunConfig

    from epmoe.runtime import Runtime
    from epmoe.timing import StageTimer

    run = RunConfig(model="deepseek-v3", quant=quant, experts="auto", tokens=tokens, layers=1,
                    steps=1, check=False)
    t0 = time.perf_counter()
    rt = Runtime(run, device=device)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    layer, x = rt.layers[0], rt.tokens_for(0)
    step = _bench(lambda: layer.forward(x), iters=steps)
    timer = StageTimer(enabled=True, device=device)
    layer.timer = layer.experts.timer = layer.comm.timer = timer
    for _ in range(steps):
        layer.forward(x)
    stage_ms = {k: sorted(v)[len(v) // 2] for k, v in timer.collect().items() if "." not in k}
    layer.timer = layer.experts.timer = layer.comm.timer = StageTimer(enabled=False)
    return build_s, step, stage_ms, _raw_layer_gemms(layer, x), layer


def _raw_layer_gemms(layer, x) -> float:
    """The layer's GEMMs alone at its real routing: routed GEMM1 + GEMM2 over the exact layout
    rows, shared GEMM1 + GEMM2 over the tokens (the experts' own GEMM wrappers, same buffers)."""
    from epmoe.kernels.act_quant import ValidRows

    ex, sh = layer.experts, layer.shared_experts
    r = layer.route(x)
    xq = ex.quantize_input(x)
    lay = ex.make_layout(r.topk_ids_TK.to(torch.int32))
    xp = ex.permute(xq, lay)
    i, d = ex.weights.intermediate, ex.weights.hidden
    a = ex._act_quant(ex.gemm_contiguous(xp, ex.w13, lay.row_expert_M, 2 * i, name="h"),
                      rows=ValidRows.contiguous(lay.row_expert_M))
    xs = sh.quantize_input(x)
    a_s = sh._act_quant(sh.gemm_dense(xs, sh.w13, 2 * sh.weights.intermediate, name="h"))

    def gemms():
        ex.gemm_contiguous(xp, ex.w13, lay.row_expert_M, 2 * i, name="h")
        ex.gemm_contiguous(a, ex.w2, lay.row_expert_M, d, name="y")
        sh.gemm_dense(xs, sh.w13, 2 * sh.weights.intermediate, name="h")
        sh.gemm_dense(a_s, sh.w2, d, name="y")
    return _bench(gemms)


def bench_layer_step(rows, device):
    """(s) the whole one-rank DeepSeek-V3 layer step, fp8 then bf16 (same tokens)."""
    from epmoe.overlap import overlap_fraction

    steps = {}
    for quant in (FP8, BF16):
        build_s, step, stage_ms, raw, layer = _step_case(quant, device)
        if layer.experts.name != "deepgemm":
            print(f"(s) skipped: experts backend is {layer.experts.name}, not deepgemm")
            return
        steps[quant.recipe] = step
        ov = overlap_fraction(stage_ms, step / 1e3)
        stages = " ".join(f"{k} {v:.2f}" for k, v in stage_ms.items())
        _line(rows, f"(s) layer step {quant.recipe} ep=1", f"DSV3 T=4096 E=256 build "
              f"{build_s:.0f}s", step, "raw GEMMs", raw, f"goal <= 1.25x; overlap {ov:.2f}; "
              f"ms: {stages}", overlap=ov, stage_ms=stage_ms, build_s=build_s)
        del layer
        torch.cuda.empty_cache()
    _line(rows, "(s) fp8 step vs bf16 step", "DSV3 T=4096 ep=1", steps["fp8_block"],
          "bf16 step", steps["bf16"], "goal < 1")


def _expert_map(rank, world, num_experts, device):
    per = num_experts // world
    m = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    m[rank * per:(rank + 1) * per] = torch.arange(per, dtype=torch.int32, device=device)
    return m


def _two_gpu(rank, world, port, only, out_path):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    group = dist.group.WORLD
    log: list = []
    say = _line if rank == 0 else (lambda *a, **kw: None)  # rank 0 prints and records
    if rank == 0 and ("a" in only or "b" in only):
        bench_gemm(log, dev)
    dist.barrier()
    import deep_ep

    from epmoe.comm.all2all import All2AllComm
    from epmoe.comm.context import CommContext
    from epmoe.comm.deepep import DeepEPHighThroughputComm, DeepEPLowLatencyComm

    emap = _expert_map(rank, world, DSV3.num_experts, dev)
    t, k, d = 4096, DSV3.top_k, DSV3.hidden
    ids, w = _routing(t, DSV3.num_experts, k, dev, seed=rank)
    x = torch.randn(t, d, device=dev).to(torch.bfloat16)
    ctx = CommContext(group, rank, world, dev, max_tokens_per_rank=128)
    if "c" in only or "e" in only:
        ht = DeepEPHighThroughputComm(DSV3, BF16, emap, ctx, num_sms=48)
    if "c" in only:
        buf = ht.buffer

        def raw_dispatch():
            pr, _, pe, ir, _ = buf.get_dispatch_layout(ids, DSV3.num_experts)
            return buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir,
                                num_tokens_per_expert=pe, topk_idx=ids, topk_weights=w,
                                config=ht.dispatch_config)

        recv_x, _, _, _, raw_h, _ = raw_dispatch()
        nbytes = recv_x.shape[0] * d * 2
        t_raw_d = _bench(raw_dispatch)
        t_raw_c = _bench(lambda: buf.combine(recv_x, raw_h, config=ht.combine_config))

        def ours_dispatch():
            ht._cache = None  # the uncached path (new routing every step)
            return ht.dispatch(x, ids, w)

        batch, h = ours_dispatch()
        y = batch.x.data  # bf16 rows [N, D]
        t_d = _bench(ours_dispatch)
        t_c = _bench(lambda: ht.combine(y, h))
        a2a = All2AllComm(DSV3, BF16, emap, ctx)
        b2, h2 = a2a.dispatch(x, ids, w)
        t_a_d = _bench(lambda: a2a.dispatch(x, ids, w), iters=10)
        t_a_c = _bench(lambda: a2a.combine(b2.x.data, h2), iters=10)
        gbs = lambda us: nbytes / us / 1e3  # noqa: E731
        shape = f"T={t}/rank D={d} E={DSV3.num_experts} K={k} 48 SMs"
        say(log, "(c) deepep-ht dispatch bf16", shape, t_d, "raw DeepEP", t_raw_d,
              f"{gbs(t_d):.0f} GB/s (raw {gbs(t_raw_d):.0f}, anchor 244)", gbs=gbs(t_d))
        say(log, "(c) deepep-ht combine bf16", shape, t_c, "raw DeepEP", t_raw_c,
              f"{gbs(t_c):.0f} GB/s (raw {gbs(t_raw_c):.0f}, anchor 228)", gbs=gbs(t_c))
        say(log, "(c) all2all (NCCL) dispatch bf16", shape, t_a_d, "deepep-ht", t_d,
              f"{gbs(t_a_d):.0f} GB/s", gbs=gbs(t_a_d))
        say(log, "(c) all2all (NCCL) combine bf16", shape, t_a_c, "deepep-ht", t_c,
              f"{gbs(t_a_c):.0f} GB/s", gbs=gbs(t_a_c))
        qx = DeepEPHighThroughputComm(DSV3, FP8, emap, ctx)
        t_f = _bench(lambda: (setattr(qx, "_cache", None), qx.dispatch(x, ids, w)))
        say(log, "(c) deepep-ht dispatch fp8", shape, t_f, "deepep-ht bf16", t_d,
              "(anchor 149 us raw)")
    t_ll = 128
    if "d" in only or "e" in only:
        ll = DeepEPLowLatencyComm(DSV3, FP8, emap, ctx)
        xs, ids_s, w_s = x[:t_ll].contiguous(), ids[:t_ll].contiguous(), w[:t_ll].contiguous()
    if "d" in only:
        buf = ll.buffer
        recv, _, raw_h, _, _ = buf.low_latency_dispatch(xs, ids_s, t_ll, DSV3.num_experts,
                                                       use_fp8=True)
        y_ll = torch.randn(recv[0].shape, device=dev).to(torch.bfloat16)
        t_raw_d = _bench(lambda: buf.low_latency_dispatch(xs, ids_s, t_ll, DSV3.num_experts,
                                                          use_fp8=True))
        t_raw_c = _bench(lambda: buf.low_latency_combine(y_ll, ids_s, w_s, raw_h))
        b, h = ll.dispatch(xs, ids_s, w_s)
        t_d = _bench(lambda: ll.dispatch(xs, ids_s, w_s))
        t_c = _bench(lambda: ll.combine(y_ll, h))
        shape = f"T={t_ll}/rank D={d} E={DSV3.num_experts} K={k}"
        say(log, "(d) deepep-ll dispatch fp8", shape, t_d, "raw DeepEP", t_raw_d, "(anchor 29)")
        say(log, "(d) deepep-ll combine", shape, t_c, "raw DeepEP", t_raw_c, "(anchor 46)")
    if "e" in only:
        ex = _experts(DSV3.num_experts // world, dev)
        for name, comm, xx, ii, ww in (("HT", ht, x, ids, w), ("LL", ll, xs, ids_s, w_s)):
            q = DeepEPHighThroughputComm(DSV3, FP8, emap, ctx) \
                if name == "HT" else comm

            def run_experts(batch):
                return ex.run(batch)

            def step():
                if name == "HT":
                    q._cache = None
                batch, h = q.dispatch(xx, ii, ww)
                return q.combine(run_experts(batch), h)

            batch, h = q.dispatch(xx, ii, ww)
            y = run_experts(batch)
            t_step = _bench(step, iters=10)
            if name == "HT":
                t_disp = _bench(lambda: (setattr(q, "_cache", None), q.dispatch(xx, ii, ww)),
                                iters=10)
            else:
                t_disp = _bench(lambda: q.dispatch(xx, ii, ww), iters=10)
                batch, h = q.dispatch(xx, ii, ww)
            t_exp = _bench(lambda: run_experts(batch), iters=10)
            t_comb = _bench(lambda: q.combine(y, h), iters=10)
            parts = t_disp + t_exp + t_comb
            say(log, f"(e) layer step ep=2 {name} fp8", f"T={xx.shape[0]}/rank DSV3 "
                  f"E_local={ex.weights.num_experts}", t_step, "sum of parts", parts,
                  f"(dispatch {t_disp:.0f} + experts {t_exp:.0f} + combine {t_comb:.0f} us)")
    dist.barrier()
    if rank == 0 and out_path:
        info = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                    deep_ep=getattr(deep_ep, "__file__", "?"))
        with open(out_path, "w") as f:
            dump_json(dict(info=info, cases=log), f, indent=1)
    ctx.close()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.gpu_moe",
                                description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, type=writable_file, help="write the cases here")
    p.add_argument("--only", type=name_list(CASES), default=",".join(CASES),
                   help="comma-separated cases")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_moe needs CUDA")
    only = set(args.only)
    from epmoe.env import SAFETY_ENV

    for k, v in SAFETY_ENV.items():
        os.environ.setdefault(k, v)
    if torch.cuda.device_count() < 2:
        rows: list = []
        dev = torch.device("cuda", 0)
        for case, fn in (("s", bench_layer_step), ("a", bench_gemm), ("t", bench_triton)):
            if case in only or (case == "a" and "b" in only):
                fn(rows, dev)
        if args.json:
            with open(args.json, "w") as f:
                dump_json(dict(cases=rows), f, indent=1)
        return
    import torch.multiprocessing as mp

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_gpu, args=(2, port, only, args.json), nprocs=2, join=True)


if __name__ == "__main__":
    run_main(main)
