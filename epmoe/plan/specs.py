"""The shipped GPU profiles, built from the H200 measurements and vendors' data sheets.

`build_profiles()` -> {"h200", "h100", "h800", "h20", "b200", "gb200"}; `python -m epmoe.plan.specs`
rewrites `epmoe/plan/profiles/<name>.json` from it (a test checks the files match, so every
number's provenance lives here, next to the number). The CPU profile is measured by
`python -m epmoe.bench.calibrate --quick` instead.

h200: measured where a measurement exists (shared/device/README.md and BENCHMARKS.md, lent
H200s, 2026-11-29 .. 2026-12-01), spec or a stated estimate elsewhere. The other GPUs are
derived from it: compute curves scaled by the spec peak ratio and capped by the spec HBM
roofline; bandwidth kernels scaled by HBM; comm fits inherited (their bandwidth scales with
the topology's link figures, which come from the data sheets in topology.LINK_SPECS).
None of these numbers is fitted to a published EP benchmark (see epmoe/sim/validate.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from epmoe.config import QuantConfig
from epmoe.plan import traffic as tr
from epmoe.outputs import run_main
from epmoe.plan.profile import (AlphaBeta, Figure, GemmCurve, HardwareProfile, LinkFit,
                                Provenance)
from epmoe.plan.specs_symm import symm_comm

P = Provenance
DEV = "lent H200, shared/device/README.md (2026-11-29)"
BENCH = "lent H200, BENCHMARKS.md (2026-11-30)"
FP8, BF16 = QuantConfig("fp8_block"), QuantConfig("bf16")
D, I, K = 7168, 2048, 8  # DeepSeek-V3 dims of every H200 measurement below
NVL_H200 = 450.0  # per-direction NVLink of the H200 (topology.LINK_SPECS)
HBM_SPEC = {"h200": 4800.0}

# GPU data sheets (dense tensor TFLOPS = half the sparsity figure; memory in GB of 1e9).
SHEETS = {
    "h100": dict(arch=90, desc="H100 SXM5 80GB", sms=132, hbm=3350.0, gb=80.0, fp8=1979.0,
                 bf16=989.0, fp32=67.0, src="NVIDIA H100 SXM5 data sheet"),
    "h800": dict(arch=90, desc="H800 SXM5 80GB (NVLink 400 GB/s)", sms=132, hbm=3350.0,
                 gb=80.0, fp8=1979.0, bf16=989.0, fp32=67.0,
                 src="NVIDIA H800 SXM5 (H100 compute, NVLink 400 GB/s)"),
    "h20": dict(arch=90, desc="H20 96GB", sms=78, hbm=4000.0, gb=96.0, fp8=296.0, bf16=148.0,
                fp32=44.0, src="NVIDIA H20 product brief (78 SMs as the device reports them)"),
    "b200": dict(arch=100, desc="HGX B200 180GB", sms=148, hbm=8000.0, gb=180.0, fp8=4500.0,
                 bf16=2250.0, fp32=75.0, src="NVIDIA HGX B200 data sheet (per GPU)"),
    "gb200": dict(arch=100, desc="GB200 NVL72 (per Blackwell GPU)", sms=148, hbm=8000.0, gb=186.0,
                  fp8=5000.0, bf16=2500.0, fp32=80.0, src="NVIDIA GB200 NVL72 data sheet / 72"),
}


def _fit2(points, nbytes) -> tuple[float, float]:
    """alpha (us), beta (GB/s) through two (size, us) points given a byte count function."""
    (s0, t0), (s1, t1) = points
    b0, b1 = nbytes(*s0), nbytes(*s1)
    beta = (b1 - b0) / (t1 - t0) / 1e3
    alpha = t0 - b0 / (beta * 1e3)
    if alpha < 0:  # no fixed cost visible: the bandwidth of the larger point
        return 0.0, b1 / t1 / 1e3
    return alpha, beta


def _h200_kernels() -> dict:
    perm = _fit2([((4096, 32768), 196.9), ((16384, 131072), 406.8)],
                 lambda n, p: tr.permute_bytes(n, p, D, FP8))
    gath = _fit2([((4096, 32768), 166.8), ((16384, 131072), 614.2)],
                 lambda n, p: tr.gather_bytes(n, p, D))
    aq = _fit2([((34688,), 101.0), ((132608,), 390.1)],
               lambda m: tr.act_quant_bytes(m, I, FP8))
    note = (f"measured {BENCH} section 1 (python -m epmoe.bench.kernels, after fa24c6b), two "
            f"sizes (T=4096 / 16384, 32 local experts, top-8) fitted through the byte counts "
            f"of epmoe/plan/traffic.py")
    triton = {"permute": AlphaBeta(*perm, P("measured", note)),
              "gather": AlphaBeta(*gath, P("measured", note)),
              "act_quant": AlphaBeta(*aq, P("measured", note)),
              "act_quant.mxfp8": AlphaBeta(33.98, 1967.5, _OSS_PROV, 60.64)}
    torch_note = P("estimate", "torch reference index ops: a few launches, half the measured "
                               "HBM copy bandwidth")
    comm = {"quantize": AlphaBeta(5.0, aq[1], P("estimate", "the per-128 token quantizer at "
                                                "act_quant's measured bytes/s; one launch"))}
    return {"triton": triton, "deepgemm": dict(triton), "comm": comm,
            "torch": {k: AlphaBeta(15.0, 2147.0, torch_note) for k in triton}}


def _h200_gemm() -> list[GemmCurve]:
    dg = P("measured", "DeepGEMM 2.5.0 on one H200: m=128 and 2048 rows/expert from "
                       "shared/device/README.md (E=32, 2026-12-01), m=512 from BENCHMARKS.md "
                       "2a (E=32, M=16384, python -m epmoe.bench.gpu_moe)")
    dgm = P("measured", "DeepGEMM 2.5.0 masked, E=32, 512 rows/expert, shared/device/README.md")
    tri = P("measured", f"Triton fp8-block grouped GEMM, {BENCH} section 1 (M=34688 and "
                        f"132608 over 32 experts); GEMM2 at T=4096: 0.64 x the same-run "
                        f"_scaled_grouped_mm (821 = 501 / 0.61)")
    trib = P("derived", f"Triton bf16 grouped GEMM, {BENCH} section 1: ratio after the rework "
                        f"x the same-run torch._grouped_mm TFLOPS (TFLOPS before / ratio before)")
    dgb = P("derived", "DeepGEMM fp8 curve x bf16/fp8 peak (989/1979); torch._grouped_mm bf16 "
                       "measured 672 TFLOPS at 512 rows/expert (device README) agrees")
    tor = P("estimate", "torch reference experts: fp32 matmul per expert at ~70% of the 67 "
                        "TFLOPS fp32 peak for large groups")
    curves = [
        GemmCurve("deepgemm", "fp8_block", "contiguous", 2 * I, D,
                  ((128, 788), (512, 1271), (2048, 1205)), dg),
        GemmCurve("deepgemm", "fp8_block", "contiguous", D, I,
                  ((128, 722), (512, 1227), (2048, 1109)), dg),
        GemmCurve("deepgemm", "fp8_block", "masked", 2 * I, D, ((512, 1056),), dgm),
        GemmCurve("deepgemm", "fp8_block", "masked", D, I, ((512, 1050),), dgm),
        GemmCurve("triton", "fp8_block", "contiguous", 2 * I, D, ((1084, 540), (4144, 576)), tri),
        GemmCurve("triton", "fp8_block", "contiguous", D, I, ((1084, 526), (4144, 531)), tri),
        GemmCurve("triton", "bf16", "contiguous", 2 * I, D, ((1084, 547), (4144, 534)), trib),
        GemmCurve("triton", "bf16", "contiguous", D, I, ((1084, 513), (4144, 519)), trib),
        GemmCurve("torch", "bf16", "contiguous", 2 * I, D, ((4096, 47.0),), tor),
    ]
    for c in list(curves[:2]):
        curves.append(GemmCurve("deepgemm", "bf16", c.layout, c.n, c.k,
                                tuple((m, t * 989 / 1979) for m, t in c.points), dgb))
    # gpt-oss-120b's shapes (hidden = intermediate = 2880): Triton runs mxfp8 dequantizing in
    # the kernel, at about half its bf16 rate there; fp8_block cannot run these shapes
    for recipe, gemm1, gemm2 in (
            ("mxfp8", ((4, 254.2), (128, 253.7), (512, 290.2)),
             ((4, 233.2), (128, 233.7), (512, 263.6))),
            ("bf16", ((4, 406.7), (128, 408.1), (512, 717.9)),
             ((4, 426.9), (128, 424.7), (512, 679.1)))):
        curves += [GemmCurve("triton", recipe, "contiguous", 2 * OSS, OSS, gemm1, _OSS_PROV),
                   GemmCurve("triton", recipe, "contiguous", OSS, OSS, gemm2, _OSS_PROV)]
    return curves


OSS = 2880  # gpt-oss-120b's hidden and expert intermediate sizes
_OSS_PROV = P("measured", "Triton experts at gpt-oss-120b's shapes (E=128 at ep 1) on one H200, "
                          "MoELayer.forward stages, launched timing, 2026-12-03: python -m "
                          "epmoe.bench.calibrate --model gpt-oss-120b --recipes mxfp8,bf16 "
                          "--quick (BENCHMARKS.md section 9)")


def _h200_comm() -> tuple[dict, dict]:
    # DeepEP LL, 2xH200, 128 tokens/rank, top-8: half the 1024 selections cross NVLink.
    sel = 128 * K / 2
    fp8_b = sel * (tr.act_row_bytes(D, FP8) + tr.LL_HEADER_BYTES)
    bf16_b = sel * (tr.act_row_bytes(D, BF16) + tr.LL_HEADER_BYTES)
    ll_beta = (bf16_b - fp8_b) / (42.0 - 29.0) / 1e3
    ll_a_d = 29.0 - fp8_b / (ll_beta * 1e3)
    ll_a_c = 46.0 - sel * 2 * D / (ll_beta * 1e3)
    ll = P("derived", f"{DEV}: DeepEP v1 LL at 128 tokens/rank, dispatch fp8 29 us / bf16 42 "
                      f"us (slope = bandwidth, intercept = alpha), combine 46 us at that "
                      f"bandwidth; bytes = selections crossing NVLink")
    # DeepEP HT, 2xH200, 4096 tokens/rank, E=256, top-8, bf16: ~4081 rows cross NVLink.
    rows = 4096 * (1 - 0.0036617)
    d_b = rows * (tr.act_row_bytes(D, BF16) + K * 8)
    c_b = rows * 2 * D
    ht_a_d = 240.0 - d_b / (ll_beta * 1e3)
    ht_a_c = 257.0 - c_b / (ll_beta * 1e3)
    # At 20 SMs the SMs bound the time; they copy the rank's own rows too (as many as cross
    # at EP 2), so the per-SM rate is over twice the crossing bytes.
    sm_d = 2 * d_b / ((c_b / 127.0 / 1e3 - ht_a_d) * 20) / 1e3
    sm_c = 2 * c_b / ((c_b / 120.0 / 1e3 - ht_a_c) * 20) / 1e3
    ht = P("derived", f"{DEV}: DeepEP v1 HT bf16 at 4096 tokens/rank: 240 / 257 us with 48 SMs "
                      f"(alpha, at the SM-driven NVLink cap measured by LL), 127 / 120 GB/s "
                      f"across NVLink with 20 SMs (the per-SM rate, over every row the SMs "
                      f"copy: the crossing ones and the rank's own)")
    cnt = 20.0  # estimate: get_dispatch_layout + notify_dispatch: two launches, one barrier
    rd = P("spec", "one 400 Gb/s NIC per GPU at the IB payload efficiency of a 4096-byte MTU "
                   "(4096 / (4096 + 42 header bytes)); alpha = the NVLink alpha + 2 x (3 - 1) us "
                   "of extra RDMA latency (topology.LINK_SPECS)")
    rdma_bw = 50.0 * 4096 / (4096 + 42)

    def pair(a_d, a_c, beta, link, prov, sm_d=None, sm_c=None, sms=None, count=0.0):
        return {"dispatch": LinkFit(a_d, beta, link, prov, sm_d, sms, count),
                "combine": LinkFit(a_c, beta, link, prov, sm_c, sms, 0.0)}

    comm = {
        "deepep-ht": {"nvlink": pair(ht_a_d, ht_a_c, ll_beta, NVL_H200, ht, sm_d, sm_c, 20, cnt),
                      "rdma": pair(ht_a_d + 4, ht_a_c + 4, rdma_bw, 50.0, rd, count=cnt + 6)},
        "deepep-ll": {"nvlink": pair(ll_a_d, ll_a_c, ll_beta, NVL_H200, ll),
                      "rdma": pair(ll_a_d + 4, ll_a_c + 4, rdma_bw, 50.0, rd)},
    }
    comm.update(symm_comm(comm))
    nccl = P("estimate", "NCCL per-call latency intranode (small messages)")
    a2a = 163.0 - 15.0
    coll = {
        "all_gather": {"nvlink": LinkFit(15.0, 518.0 / 2, NVL_H200, P(
            "measured", f"{DEV}: NCCL all_gather 1 GiB, 518 GB/s algbw on 2 GPUs -> bus bw"))},
        "reduce_scatter": {"nvlink": LinkFit(15.0, 502.0 / 2, NVL_H200, P(
            "measured", f"{DEV}: NCCL reduce_scatter 1 GiB, 502 GB/s algbw on 2 GPUs"))},
        "all_reduce": {"nvlink": LinkFit(15.0, 510.0 / 2, NVL_H200, P(
            "derived", "ring all-reduce = reduce-scatter + all-gather at their mean bus bw"))},
        "all_to_all": {"nvlink": LinkFit(15.0, 4096 * D * 2 / 2 / a2a / 1e3, NVL_H200, P(
            "measured", f"{DEV}: NCCL all_to_all_single 4096x7168 bf16 per rank, 163 us, "
                        f"half crossing NVLink (alpha: {nccl.note}, estimate)"))},
    }
    ib = P("estimate", "NCCL over one 400 Gb/s NIC per GPU at ~90% of line rate; 25 us calls")
    for name in coll:
        coll[name]["rdma"] = LinkFit(25.0, 45.0, 50.0, ib)
    return comm, coll


def _device_h200() -> dict:
    return {
        "sm_arch": Figure(90, P("measured", f"{DEV}: compute capability 9.0")),
        "sms": Figure(132, P("measured", DEV)),
        "hbm_GBps": Figure(4294.0, P("measured", f"{DEV}: HBM copy, read+write bytes / time")),
        "hbm_GiB": Figure(139.8, P("measured", DEV)),
        "peak_tflops_fp8": Figure(1979.0, P("spec", "NVIDIA H200 SXM data sheet (dense)")),
        "peak_tflops_bf16": Figure(989.0, P("spec", "NVIDIA H200 SXM data sheet (dense)")),
        "peak_tflops_fp32": Figure(67.0, P("spec", "NVIDIA H200 SXM data sheet")),
        "launch_us": Figure(5.0, P("estimate", "host cost of one eager torch op")),
        "sync_us": Figure(15.0, P("estimate", "one host synchronisation (stream drain + "
                                              "round trip)")),
    }


def _all2all_extra(comm, coll, kernels, gemm) -> dict:
    """The epmoe all2all backend's fixed cost beyond its modelled NCCL calls: the measured
    stage (BENCHMARKS.md 2c, 2xH200, 4096 tokens, bf16, DSV3) minus the model without it."""
    from epmoe.config import get_preset
    from epmoe.plan.comm_cost import CommCase, combine_cost, dispatch_cost
    from epmoe.plan.routing import RoutingSpec, routing_stats
    from epmoe.plan.topology import Topology

    prof = HardwareProfile("tmp", "h200", "tmp", _device_h200(), gemm, kernels, comm, coll)
    cfg = get_preset("deepseek-v3").replace(n_group=1, topk_group=1)
    topo = Topology.parse("1x2")
    case = CommCase(cfg, BF16, topo, prof, routing_stats(cfg, RoutingSpec(), 2, 2), 4096, 4096)
    prov = P("derived", f"{BENCH} 2c: epmoe all2all dispatch 1271 us / combine 824.6 us "
                        f"(2xH200, 4096 tokens, bf16) minus this model's NCCL and copy terms")
    return {"nvlink": {"dispatch": LinkFit(1271.0 - dispatch_cost("all2all", case).us, 1.0,
                                           NVL_H200, prov),
                       "combine": LinkFit(824.6 - combine_cost("all2all", case).us, 1.0,
                                          NVL_H200, prov)}}


def h200() -> HardwareProfile:
    kernels, gemm = _h200_kernels(), _h200_gemm()
    comm, coll = _h200_comm()
    comm["all2all"] = _all2all_extra(comm, coll, kernels, gemm)
    return HardwareProfile("h200", "h200", "H200 SXM 141GB: measured on the lent machines where "
                                   "possible, spec/estimate elsewhere", _device_h200(), gemm,
                           kernels, comm, coll)


def derive(base: HardwareProfile, name: str) -> HardwareProfile:
    """A spec-derived profile for GPU `name` from the measured `base` (see module doc)."""
    s = SHEETS[name]
    src = f"spec: {s['src']}"
    eff = base.fig("hbm_GBps") / HBM_SPEC[base.name]
    hbm = s["hbm"] * eff
    dev = {
        "sm_arch": Figure(s["arch"], P("spec", s["src"])),
        "sms": Figure(s["sms"], P("spec", s["src"])),
        "hbm_GBps": Figure(hbm, P("derived", f"{src} HBM {s['hbm']:g} GB/s x the copy "
                                             f"efficiency measured on {base.name} ({eff:.3f})")),
        "hbm_GiB": Figure(s["gb"] * 1e9 / 2**30, P("spec", s["src"])),
        "peak_tflops_fp8": Figure(s["fp8"], P("spec", f"{s['src']} (dense)")),
        "peak_tflops_bf16": Figure(s["bf16"], P("spec", f"{s['src']} (dense)")),
        "peak_tflops_fp32": Figure(s["fp32"], P("spec", s["src"])),
        "launch_us": Figure(base.fig("launch_us"), base.device["launch_us"].prov.inherit(
            base.name)),
        "sync_us": Figure(base.fig("sync_us"), base.device["sync_us"].prov.inherit(base.name)),
    }
    gemm = []
    for c in base.gemm:
        peak = "peak_tflops_bf16" if c.recipe == "bf16" and c.backend != "torch" else \
            "peak_tflops_fp32" if c.backend == "torch" else "peak_tflops_fp8"
        ratio = dev[peak].value / base.fig(peak)
        q = BF16 if c.recipe == "bf16" else FP8
        pts = []
        for m, t in c.points:
            roof = tr.gemm_flops(m, c.n, c.k) / (tr.gemm_bytes(m, 1, c.n, c.k, q) / (hbm * 1e3))
            pts.append((m, round(min(t * ratio, roof / 1e6), 1)))
        gemm.append(GemmCurve(c.backend, c.recipe, c.layout, c.n, c.k, tuple(pts), P(
            "derived", f"model, not measured: {base.name} curve x {peak} ratio ({ratio:.3f}), "
                       f"capped by the HBM roofline at {hbm:.0f} GB/s; base: {c.prov.note}")))
    kernels = {b: {k: AlphaBeta(v.alpha_us, v.beta_GBps * hbm / base.fig("hbm_GBps"), P(
        "derived", f"{base.name} fit, beta x HBM ratio; base: {v.prov.source}: {v.prov.note}"),
        v.floor_us) for k, v in t.items()} for b, t in base.kernels.items()}
    comm = {b: {l: {d: _inherit_fit(f, base.name) for d, f in t.items()}
                for l, t in lt.items()} for b, lt in base.comm.items()}
    coll = {c: {l: _inherit_fit(f, base.name) for l, f in t.items()}
            for c, t in base.collectives.items()}
    return HardwareProfile(name, name, f"{s['desc']}: derived from spec and the {base.name} "
                                 f"measurements (no measurement on this GPU)", dev, tuple(gemm),
                           kernels, comm, coll)


def _inherit_fit(f: LinkFit, frm: str) -> LinkFit:
    return LinkFit(f.alpha_us, f.beta_GBps, f.link_GBps, f.prov.inherit(frm), f.per_sm_GBps,
                   f.sms, f.count_us, f.peer_us)


def build_profiles() -> dict[str, HardwareProfile]:
    base = h200()
    return {"h200": base, **{n: derive(base, n) for n in SHEETS}}


def main(argv=None) -> int:
    out = Path(__file__).parent / "profiles"
    out.mkdir(exist_ok=True)
    for name, prof in build_profiles().items():
        prof.save(out / f"{name}.json")
        print(f"wrote {out / (name + '.json')}: {prof.provenance_counts()}")
    return 0


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
