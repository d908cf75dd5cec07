"""A synthetic hardware profile with round numbers, for tests and examples: every fit is
alpha-free unless asked, every GEMM curve flat, so a prediction's arithmetic can be checked by
hand and a planner's choice known by construction.

    prof = synthetic_profile(link_eff=0.5, all_reduce_GBps=1e9)   # near-free all-reduce
"""

from __future__ import annotations

from epmoe.plan.profile import AlphaBeta, Figure, GemmCurve, HardwareProfile, LinkFit, \
    Provenance

SYN = Provenance("estimate", "synthetic profile for tests (epmoe/plan/synthetic.py)")
COMM = ("deepep-ht", "deepep-ll", "symm-ht", "symm-ll")


def synthetic_profile(*, gpu: str = "h200", sm_arch: int = 90, tflops: dict | None = None,
                      hbm_GBps: float = 1e6, hbm_GiB: float = 1e4, launch_us: float = 0.0,
                      sync_us: float = 0.0, kernel_GBps: float = 1e6, alpha_us: float = 0.0,
                      link_eff: float = 1.0, per_sm_GBps: float | None = None,
                      sms: int | None = None, count_us: float = 0.0,
                      collective_GBps: float = 1e3, all_reduce_GBps: float | None = None,
                      nccl_extra_us: float = 0.0) -> HardwareProfile:
    """tflops: experts backend -> flat TFLOPS (default torch 1, triton 100, deepgemm 200)."""
    tflops = tflops or {"torch": 1.0, "triton": 100.0, "deepgemm": 200.0}
    device = {"sm_arch": sm_arch, "sms": 100, "hbm_GBps": hbm_GBps, "hbm_GiB": hbm_GiB,
              "peak_tflops_fp8": 1e3, "peak_tflops_bf16": 1e3, "peak_tflops_fp32": 1e3,
              "launch_us": launch_us, "sync_us": sync_us}
    gemm = []
    for backend, tf in tflops.items():
        for recipe in ("bf16", "fp8_block"):
            for layout in ("contiguous", "masked"):
                gemm.append(GemmCurve(backend, recipe, layout, 128, 128, ((1, tf),), SYN))
    ab = AlphaBeta(0.0, kernel_GBps, SYN)
    kernels = {b: {"permute": ab, "gather": ab, "act_quant": ab} for b in tflops}
    kernels["comm"] = {"quantize": ab}
    comm = {}
    for b in COMM:
        fits = {}
        for cls, link in (("nvlink", 100.0), ("rdma", 10.0), ("pcie", 10.0), ("tcp", 1.0)):
            f = LinkFit(alpha_us, link * link_eff, link, SYN, per_sm_GBps, sms, count_us)
            fits[cls] = {"dispatch": f, "combine": LinkFit(alpha_us, link * link_eff, link,
                                                           SYN, per_sm_GBps, sms)}
        comm[b] = fits
    for b in ("all2all", "allgather"):
        comm[b] = {cls: {d: LinkFit(nccl_extra_us, 1.0, 1.0, SYN) for d in ("dispatch",
                                                                           "combine")}
                   for cls in ("nvlink", "rdma", "pcie", "tcp")}
    coll = {}
    for c in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce"):
        bw = all_reduce_GBps if c == "all_reduce" and all_reduce_GBps else collective_GBps
        coll[c] = {cls: LinkFit(alpha_us, bw, link, SYN)
                   for cls, link in (("nvlink", 100.0), ("rdma", 10.0), ("pcie", 10.0),
                                     ("tcp", 1.0))}
    return HardwareProfile("synthetic", gpu, "synthetic (tests)",
                           {k: Figure(float(v), SYN) for k, v in device.items()}, tuple(gemm),
                           kernels, comm, coll)
