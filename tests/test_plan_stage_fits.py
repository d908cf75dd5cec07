"""The calibrated stage terms (shared-MLP curves, the local backend's dispatch / combine, the
router) in the cost model: their arithmetic on synthetic profiles, their JSON round trip and
the spec-derived fallbacks when a profile lacks them."""

import dataclasses

import pytest

from epmoe.bench.calibrate import UNBOUNDED_GBPS, fit_ab
from epmoe.config import MoEConfig, QuantConfig
from epmoe.plan import traffic as tr
from epmoe.plan.comm_cost import DISPATCH_OPS
from epmoe.plan.cost import Candidate, Workload, predict_layer
from epmoe.plan.profile import AlphaBeta, MlpCurve, Provenance, load_profile
from epmoe.plan.synthetic import synthetic_profile
from epmoe.plan.topology import Topology

M = Provenance("measured", "test")
CFG = MoEConfig("t", hidden=256, moe_intermediate=128, num_experts=16, top_k=4,
                num_shared_experts=1, num_moe_layers=1)
FP8, BF16 = QuantConfig("fp8_block"), QuantConfig("bf16")
ONE = Topology.parse("1x1")
LOCAL = Candidate("ep_dp", "local", "triton")


def _curve(overlapped=False, pts=((128, 100.0), (4096, 1000.0)), width=128, hidden=256):
    return MlpCurve("triton", "fp8_block", width, hidden, overlapped, pts, M)


def test_mlp_curve_interpolates_log_log_and_scales_by_flops():
    c = _curve()
    assert c.time_us(128) == 100.0 and c.time_us(4096) == 1000.0
    assert c.time_us(16) == 100.0  # below the first point: its (fixed-cost bound) time
    assert c.time_us(8192) == pytest.approx(2000.0)  # above the last: linear in tokens
    mid = (128 * 4096) ** 0.5  # geometric middle -> geometric mean of the times
    assert c.time_us(mid) == pytest.approx((100.0 * 1000.0) ** 0.5)
    assert c.time_us(4096, width=64) == pytest.approx(500.0)
    assert c.time_us(4096, width=128, hidden=512) == pytest.approx(2000.0)
    with pytest.raises(ValueError, match="tokens must increase"):
        _curve(pts=((4096, 1.0), (128, 2.0)))
    with pytest.raises(ValueError, match="needs points"):
        _curve(pts=((0, 1.0),))


def test_mlp_curve_lookup_prefers_overlapped_then_alone():
    prof = synthetic_profile().replace(mlp=(_curve(False), _curve(True, ((128, 300.0),))))
    assert prof.mlp_curve("triton", "fp8_block", 128, 256, True).overlapped
    assert not prof.mlp_curve("triton", "fp8_block", 128, 256, False).overlapped
    alone = synthetic_profile().replace(mlp=(_curve(False),))
    assert not alone.mlp_curve("triton", "fp8_block", 128, 256, True).overlapped
    assert alone.mlp_curve("deepgemm", "fp8_block", 128, 256, False) is None


def _calibrated(prof):
    kern = {**prof.kernels, "local": {"dispatch": AlphaBeta(200.0, 1.0, M),
                                      "combine": AlphaBeta(7.0, 2.0, M)},
            "router": {CFG.router: AlphaBeta(30.0, 4.0, M)}}
    return prof.replace(kernels=kern, mlp=(_curve(False), _curve(True, ((128, 300.0),
                                                                          (4096, 3000.0)))))


@pytest.mark.parametrize("overlap", [True, False])
def test_calibrated_terms_set_their_stages(overlap):
    base = synthetic_profile(kernel_GBps=10.0)
    prof = _calibrated(base)
    n = 1024
    p = predict_layer(LOCAL, Workload(CFG, FP8, n, overlap_shared=overlap), ONE, prof)
    s = p.stages_us
    q = tr.quantize_bytes(n, CFG.hidden, FP8) / 10e3
    assert s["dispatch.quantize"] == pytest.approx(q)
    assert s["dispatch"] == pytest.approx(q + 200.0 + tr.local_dispatch_bytes(n, 4) / 1e3)
    assert s["combine"] == pytest.approx(7.0 + tr.local_combine_bytes(n, 256) / 2e3)
    assert s["router"] == pytest.approx(30.0 + tr.router_bytes(n, 256, 16) / 4e3)
    assert s["shared"] == pytest.approx(prof.mlp_curve("triton", "fp8_block", 128, 256,
                                                       overlap).time_us(n))
    # the same workload without the calibrated terms: the model's own terms
    p0 = predict_layer(LOCAL, Workload(CFG, FP8, n, overlap_shared=overlap), ONE, base)
    assert p0.stages_us["dispatch"] == pytest.approx(q)  # launch_us 0 in the synthetic one
    assert p0.stages_us["shared"] != s["shared"]


def test_fallbacks_on_spec_profiles():
    """Spec profiles have no calibrated stage terms: the local dispatch is its quantize plus
    the id mapping's launches; the shared MLP comes from the GEMM curves."""
    cfg = CFG.replace(hidden=7168, moe_intermediate=2048, num_experts=256, top_k=8,
                      n_group=8, topk_group=4)
    for name in ("h200", "h100", "b200"):
        prof = load_profile(name)
        assert not prof.mlp and "local" not in prof.kernels and "router" not in prof.kernels
        p = predict_layer(Candidate("ep_dp", "local", "deepgemm"), Workload(cfg, FP8, 4096),
                          ONE, prof)
        s = p.stages_us
        assert s["dispatch"] == pytest.approx(s["dispatch.quantize"] + DISPATCH_OPS["local"]
                                              * prof.fig("launch_us"))
        assert s["shared"] > 0 and s["router"] > 0


def test_router_fallback_on_a_gpu_is_the_split_way_and_on_a_cpu_the_torch_path():
    """Without a router fit: on a GPU profile the bf16 gate GEMM (its fixed time plus its
    compute at GATE_GEMM_EFFICIENCY of the bf16 peak, or its bytes at HBM rate), plus the
    routing kernel (its fixed time and its selection work), at least two launches; on the CPU
    profile the fp32 GEMM and the torch router's ops."""
    from epmoe.plan.cost import (FP32_EFFICIENCY, GATE_GEMM_EFFICIENCY, GATE_GEMM_FLOOR_US,
                                 ROUTE_KERNEL_FLOOR_US, ROUTE_PS_PER_SM, ROUTER_OPS,
                                 _router_us)

    cfg = CFG.replace(hidden=7168, num_experts=256, top_k=8)
    prof = load_profile("h100")
    flops = 2.0 * 16384 * 7168 * 256
    want = (GATE_GEMM_FLOOR_US + flops / (prof.fig("peak_tflops_bf16") * GATE_GEMM_EFFICIENCY
                                          * 1e6)
            + ROUTE_KERNEL_FLOOR_US + 16384 * 256 * 8 * ROUTE_PS_PER_SM * 1e-6 / prof.fig("sms"))
    got = _router_us(cfg, prof, 16384)
    assert got == pytest.approx(want)
    # independent of that formula: never under the bf16 peak's time, and well under the fp32
    # SIMT GEMM the GPU profiles priced before
    peak = flops / (prof.fig("peak_tflops_bf16") * 1e6)
    assert peak < got < 3 * peak
    assert got < flops / (prof.fig("peak_tflops_fp32") * FP32_EFFICIENCY * 1e6) / 3
    one = _router_us(cfg, prof, 1)
    assert one == pytest.approx(GATE_GEMM_FLOOR_US + ROUTE_KERNEL_FLOOR_US, rel=1e-3)
    assert one >= 2 * prof.fig("launch_us")
    # a narrow gate over many tokens streams them at HBM rate, its fixed time hidden
    narrow = CFG.replace(hidden=4096, num_experts=128, top_k=8)
    stream = (2.0 * (16384 + 128) * 4096 + 4.0 * 16384 * 128) / (prof.fig("hbm_GBps") * 1e3)
    select = 16384 * 128 * 8 * ROUTE_PS_PER_SM * 1e-6 / prof.fig("sms")
    assert _router_us(narrow, prof, 16384) == pytest.approx(stream + ROUTE_KERNEL_FLOOR_US
                                                            + select)
    cpu = load_profile("cpu")
    assert cpu.fig("sm_arch") == 0
    gpu_cpu = flops / (cpu.fig("peak_tflops_fp32") * FP32_EFFICIENCY * 1e6)
    assert _router_us(cfg, cpu, 16384) >= gpu_cpu
    assert _router_us(cfg, cpu, 1) >= ROUTER_OPS[cfg.router] * cpu.fig("launch_us")


# The split way measured on one H100 (BENCHMARKS.md 50, CUDA events, median of 60 calls, us)
# at these tokens: what the spec profile's router should land near.
H100_ROUTER_TOKENS = (1, 32, 128, 512, 1024, 2048, 4096, 8192, 16384)
H100_SPLIT_ROUTER_US = {
    "deepseek-v3": (12.06, 12.64, 13.31, 16.74, 19.42, 29.44, 45.33, 76.58, 140.59),
    "kimi-k2": (12.69, 13.54, 15.46, 18.46, 23.55, 37.1, 55.62, 101.68, 190.8),
    "qwen3-235b-a22b": (10.94, 11.36, 11.62, 12.83, 13.79, 17.44, 19.55, 41.12, 75.28),
}


@pytest.mark.parametrize("model", sorted(H100_SPLIT_ROUTER_US))
def test_router_fallback_lands_near_the_measured_split_way(model):
    """The spec H100 profile's router (no router fit: the fallback) within 20% of the split
    way measured on an H100 from 1 to 16,384 tokens, for three gates (K 4,096 / 7,168; 128 /
    256 / 384 experts)."""
    from epmoe.config import get_preset
    from epmoe.plan.cost import _router_us

    prof = load_profile("h100")
    cfg = get_preset(model)
    assert not prof.has_kernel("router", cfg.router)
    for tokens, measured in zip(H100_ROUTER_TOKENS, H100_SPLIT_ROUTER_US[model], strict=True):
        assert _router_us(cfg, prof, tokens) == pytest.approx(measured, rel=0.20), tokens


def test_fit_ab_fixed_cost_and_no_fixed_cost():
    a, b = fit_ab([(1e3, 300.0), (1e5, 290.0), (1e6, 295.0)])  # host-bound: flat in bytes
    assert a == pytest.approx(295.0) and b == UNBOUNDED_GBPS
    assert AlphaBeta(a, b, M).time_us(1e9) == pytest.approx(295.0, abs=0.01)


def test_json_round_trip_keeps_the_new_terms(tmp_path):
    prof = _calibrated(synthetic_profile())
    path = tmp_path / "p.json"
    prof.save(path)
    back = load_profile(str(path))
    assert back == prof and back.mlp[1].overlapped
    legacy = dataclasses.replace(prof, mlp=())  # a profile written before these terms
    legacy.save(path)
    assert load_profile(str(path)).mlp == ()


def test_layer_tail_adds_to_the_total_only_when_measured():
    """kernels["layer"]["tail"] (the measured forward minus its composed stages) is added to
    the layer's total, over the output's bytes; never negative; absent -> 0."""
    work = Workload(CFG, FP8, 512)
    base = predict_layer(LOCAL, work, ONE, synthetic_profile())
    assert base.tail_us == 0.0
    tail = AlphaBeta(40.0, 100.0, M)  # 40 us + bytes / (100 GB/s)
    prof = synthetic_profile()
    prof = prof.replace(kernels={**prof.kernels, "layer": {"tail": tail}})
    p = predict_layer(LOCAL, work, ONE, prof)
    want = 40.0 + 512 * CFG.hidden * 2.0 / (100.0 * 1e3)
    assert p.tail_us == pytest.approx(want)
    assert p.total_us == pytest.approx(base.total_us + want)
    assert p.stages_us == base.stages_us  # a term of the total, not a stage
    with pytest.raises(ValueError, match=r"alpha_us \(-1000000.0\) must be a finite number "
                                         r">= 0"):  # a fit never predicts a negative time
        AlphaBeta(-1e6, 1e9, M)


def test_dispatch_quantize_reads_the_experts_backends_own_fit():
    """kernels["comm"]["quantize.<experts>"] (each backend's quantizer, its scale layout)
    wins over the pooled "quantize" fit; a backend without its own fit uses the pooled one."""
    prof = synthetic_profile()
    comm = {**prof.kernels.get("comm", {}), "quantize": AlphaBeta(100.0, 1e9, M),
            "quantize.deepgemm": AlphaBeta(300.0, 1e9, M)}
    prof = prof.replace(kernels={**prof.kernels, "comm": comm})
    work = Workload(CFG, FP8, 512)
    dg = predict_layer(Candidate("ep_dp", "local", "deepgemm"), work, ONE, prof)
    tri = predict_layer(LOCAL, work, ONE, prof)
    assert dg.stages_us["dispatch.quantize"] == pytest.approx(300.0, rel=1e-3)
    assert tri.stages_us["dispatch.quantize"] == pytest.approx(100.0, rel=1e-3)
    # per backend and recipe where calibrated so (W4A8's quantizer beside its own shared MLP)
    comm["quantize.triton.fp8_block"] = AlphaBeta(40.0, 1e9, M)
    prof = prof.replace(kernels={**prof.kernels, "comm": comm})
    tri = predict_layer(LOCAL, work, ONE, prof)
    w4 = predict_layer(LOCAL, Workload(CFG, QuantConfig("w4a8_mxfp4"), 512), ONE, prof)
    assert tri.stages_us["dispatch.quantize"] == pytest.approx(40.0, rel=1e-3)
    assert w4.stages_us["dispatch.quantize"] == pytest.approx(100.0, rel=1e-3)


def test_routed_kernels_read_the_recipes_own_fit():
    """permute / gather "<name>.<recipe>" (beside the shared MLP its kernels differ by recipe)
    win over the pooled fit, overlapped ones first beside the shared MLP; a recipe without its
    own fit uses the pooled one."""
    prof = synthetic_profile()
    tri = {**prof.kernels["triton"], "permute": AlphaBeta(100.0, 1e9, M),
           "permute.fp8_block": AlphaBeta(200.0, 1e9, M),
           "gather.fp8_block": AlphaBeta(50.0, 1e9, M),
           "permute.fp8_block.overlapped": AlphaBeta(400.0, 1e9, M)}
    prof = prof.replace(kernels={**prof.kernels, "triton": tri})
    fp8 = predict_layer(LOCAL, Workload(CFG, FP8, 512), ONE, prof).stages_us
    bf16 = predict_layer(LOCAL, Workload(CFG, BF16, 512), ONE, prof).stages_us
    assert fp8["experts.permute"] == pytest.approx(200.0, rel=1e-2)
    assert fp8["experts.gather"] == pytest.approx(50.0, rel=1e-2)
    assert bf16["experts.permute"] == pytest.approx(100.0, rel=1e-2)
    assert bf16["experts.gather"] == pytest.approx(
        tri["gather"].time_us(tr.gather_bytes(512, 512 * CFG.top_k, CFG.hidden)), rel=1e-2)
    from epmoe.plan.cost import _experts_stages

    slot_rows = [512 * CFG.top_k / CFG.num_experts] * CFG.num_experts
    beside = _experts_stages("triton", "tokens", CFG, FP8, prof, 512, 512 * CFG.top_k,
                             slot_rows, CFG.moe_intermediate, overlapped=True)
    assert beside["experts.permute"] == pytest.approx(400.0, rel=1e-2)


def test_a_permute_that_copies_no_rows_is_priced_by_its_index():
    """The Triton experts' bf16 permute writes the layout's row -> token index, no rows: its
    bytes are the index's (an id read, a row and a token written per pair), every other
    permute's the rows'; calibration fits its points per recipe only, out of the pooled fit
    that prices the recipes without one of their own (all of which copy rows)."""
    from epmoe.bench.layer_points import LayerFits, Size, kernel_points

    n, pairs, d = 64, 256, CFG.hidden
    assert tr.permute_bytes(n, pairs, d, BF16, "triton") == pairs * 3 * tr.INDEX_BYTES
    for experts, quant in (("torch", BF16), ("deepgemm", BF16), ("triton", FP8)):
        row = tr.act_row_bytes(d, quant)
        assert tr.permute_bytes(n, pairs, d, quant, experts) == n * row + pairs * row
    size = Size(n, pairs, 128, 4 * 128, pairs)
    st = {"experts.permute": 50.0, "experts.gather": 40.0, "experts.act_quant": 30.0}
    for quant in (BF16, FP8):
        fits = LayerFits()
        kernel_points(fits, st, size, CFG, quant, "triton", quant.recipe, "")
        names = {name for _, name in fits.points}
        assert {f"permute.{quant.recipe}", "gather", f"gather.{quant.recipe}"} <= names
        assert ("permute" in names) == (quant.recipe != "bf16")
        [(nbytes, us)] = fits.points[("triton", f"permute.{quant.recipe}")]
        assert us == 50.0 and nbytes == tr.permute_bytes(n, pairs, d, quant, "triton")
