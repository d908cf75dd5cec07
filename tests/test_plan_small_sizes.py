"""Two calibrated mechanisms of the cost model at decode sizes: a kernel fit's floor (no size
costs less than the fastest size measured: a launch or one wave of CTAs however few bytes), and
the GEMM curve below one aligned group per expert, looked up by the real rows per expert (a
128-row tile holding 4 real rows runs faster than a full one)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from epmoe.config import QuantConfig
from epmoe.plan.cost import _gemm_us
from epmoe.plan.grouped import expert_us
from epmoe.plan.profile import AlphaBeta, GemmCurve, Provenance, from_dict, to_dict
from epmoe.plan.synthetic import SYN, synthetic_profile
from epmoe.plan import traffic as tr

P = Provenance("measured", "test")


def test_a_fit_never_goes_below_its_floor():
    ab = AlphaBeta(10.0, 1.0, P, floor_us=100.0)  # 1 GB/s: 1 us per kB
    assert ab.time_us(0) == 100.0
    assert ab.time_us(50_000) == 100.0
    assert ab.time_us(200_000) == pytest.approx(210.0)
    assert AlphaBeta(10.0, 1.0, P).time_us(0) == 10.0  # no floor: the line


def test_floor_survives_json_and_old_profiles_read_as_no_floor():
    prof = synthetic_profile()
    k = dict(prof.kernels)
    k["router"] = {"sigmoid_grouped": AlphaBeta(5.0, 2.0, SYN, floor_us=117.0)}
    prof = dataclasses.replace(prof, kernels=k)
    back = from_dict(json.loads(json.dumps(to_dict(prof))))
    assert back.kernels["router"]["sigmoid_grouped"].floor_us == 117.0
    d = to_dict(prof)
    del d["kernels"]["router"]["sigmoid_grouped"]["floor_us"]  # a profile from before
    assert from_dict(d).kernels["router"]["sigmoid_grouped"].floor_us == 0.0


def _with_curve(points):
    prof = synthetic_profile(hbm_GBps=1e9)  # no HBM floor: the curve alone
    gemm = tuple(c for c in prof.gemm if c.backend != "triton") + (
        GemmCurve("triton", "fp8_block", "contiguous", 256, 512, points, P),)
    return dataclasses.replace(prof, gemm=gemm)


def test_below_one_aligned_group_per_expert_the_curve_is_read_at_the_real_rows():
    prof = _with_curve(((4.0, 100.0), (128.0, 800.0), (512.0, 1000.0)))
    q, e, n, k = QuantConfig("fp8_block"), 8, 256, 512
    curve = prof.curve("triton", "fp8_block", "contiguous", n, k)
    flops_us = tr.gemm_flops(128, n, k) / 1e6  # one expert, one 128-row group
    # 4 real rows: the point measured at m = 4 (100 TFLOPS), not the full tile's
    assert expert_us(curve, q, 128, 4.0, n, k, 1e9) == pytest.approx(flops_us / 100.0)
    # the same aligned rows, full: 800 TFLOPS
    assert expert_us(curve, q, 128, 128.0, n, k, 1e9) == pytest.approx(flops_us / 800.0)
    # above one group: the aligned rows (300 real -> 384 aligned)
    assert expert_us(curve, q, 384, 384.0, n, k, 1e9) == pytest.approx(
        3 * flops_us / curve.tflops(384.0))
    # in a step, 4 expected rows per expert: each count x ~ Poisson(4) read at its own rows,
    # near the m = 4 point; an expert with no row (e^-4 of the steps) costs nothing
    pmf = [math.exp(-4.0) * 4.0 ** x / math.factorial(x) for x in range(60)]
    want = e * sum(pmf[x] * flops_us / curve.tflops(float(x)) for x in range(1, 60))
    step = _gemm_us(prof, "triton", q, "contiguous", [4.0] * e, n, k, align=128)
    assert step == pytest.approx(want, rel=1e-6)
    assert want < e * (1 - pmf[0]) * flops_us / 100.0  # above 4 rows the curve runs faster


def test_calibration_fits_take_the_fastest_size_as_their_floor():
    from epmoe.bench.calibrate import fit_ab
    from epmoe.bench.layer_points import LayerFits, finish

    class Clock:
        def prov(self, what=""):
            return Provenance("measured", what)

    fits = LayerFits()
    for nbytes, us in ((1e3, 117.0), (1e6, 118.0), (4e6, 121.0), (64e6, 400.0)):
        fits.add_point("router", "sigmoid_grouped", nbytes, us)
        fits.add_point("layer", "tail", nbytes, us)
    out = finish(fits, Clock(), fit_ab)
    router = out["router"]["sigmoid_grouped"]
    assert router.floor_us == 117.0
    assert router.time_us(1e3) >= 117.0 > router.alpha_us + 1e3 / (router.beta_GBps * 1e3)
    assert out["layer"]["tail"].floor_us == 0.0  # a residual, not a kernel: no floor


def test_the_layer_tail_is_read_per_experts_backend_first():
    from epmoe.plan.cost import _tail_us
    from epmoe.config import get_preset

    cfg = get_preset("deepseek-v3-tiny")
    prof = synthetic_profile()
    k = dict(prof.kernels)
    k["layer"] = {"tail": AlphaBeta(1000.0, 1e9, SYN), "tail.triton": AlphaBeta(40.0, 1e9, SYN)}
    prof = dataclasses.replace(prof, kernels=k)
    assert _tail_us(cfg, prof, 8, "triton") == pytest.approx(40.0, rel=1e-6)
    assert _tail_us(cfg, prof, 8, "deepgemm") == pytest.approx(1000.0, rel=1e-6)  # pooled
    del k["layer"]
    assert _tail_us(cfg, dataclasses.replace(prof, kernels=k), 8, "triton") == 0.0


def test_act_quant_is_read_per_recipe_first():
    """The act+quant pass quantizes for fp8 and only casts for bf16: a calibration fits each
    recipe (and the pool); the model takes the recipe's fit when the profile has one."""
    from epmoe.config import get_preset
    from epmoe.plan.cost import _experts_stages

    cfg = get_preset("deepseek-v3-tiny")
    prof = synthetic_profile()
    k = {t: dict(v) for t, v in prof.kernels.items()}
    k["triton"]["act_quant"] = AlphaBeta(1000.0, 1e9, SYN)
    k["triton"]["act_quant.fp8_block"] = AlphaBeta(30.0, 1e9, SYN)
    prof = dataclasses.replace(prof, kernels=k)

    def act_quant(recipe):
        st = _experts_stages("triton", "tokens", cfg, QuantConfig(recipe), prof, 16, 64,
                             [4.0] * 16, cfg.moe_intermediate)
        return st["experts.act_quant"]

    assert act_quant("fp8_block") == pytest.approx(30.0, rel=1e-3)
    assert act_quant("bf16") == pytest.approx(1000.0, rel=1e-3)  # no bf16 fit: the pool
    assert prof.most_specific("triton", "nope", "act_quant.fp8_block").alpha_us == 30.0
    assert prof.most_specific("triton", "nope") is None


def test_act_quant_costs_the_real_rows_in_kernel_blocks_not_the_padding():
    """The act+quant kernel skips padding rows (blocks of ACT_BLOCK_ROWS with no valid row), so
    its bytes follow each expert's rows rounded up to a block, in the contiguous layout (whose
    groups are padded to 128) and the masked one (whose capacity can be far larger)."""
    from epmoe.config import get_preset
    from epmoe.kernels.act_quant import BLOCK_M_GPU
    from epmoe.plan.cost import _aligned_rows, _experts_stages

    assert tr.ACT_BLOCK_ROWS == BLOCK_M_GPU  # the model's block is the kernel's
    cfg = get_preset("deepseek-v3-tiny")
    prof = synthetic_profile()
    k = {t: dict(v) for t, v in prof.kernels.items()}
    k["triton"]["act_quant"] = AlphaBeta(0.0, 1.0, SYN)  # 1 GB/s: 1 us per kB, no alpha
    prof = dataclasses.replace(prof, kernels=k)
    q, inter = QuantConfig("fp8_block"), cfg.moe_intermediate

    def act_quant(kind, slot_rows):
        return _experts_stages("triton", kind, cfg, q, prof, 16, sum(slot_rows), slot_rows,
                               inter)["experts.act_quant"]

    per_row = tr.act_quant_bytes(1, inter, q) / 1e3
    few = [0.5] * 8 + [40.0] * 8  # experts with < 1 row expected, and 40 (3 blocks of 16)
    expect = _aligned_rows(few, 16) * per_row
    assert act_quant("tokens", few) == pytest.approx(expect)
    assert act_quant("masked", few) == pytest.approx(expect)  # not capacity x experts
    assert _aligned_rows([40.0], 16) == pytest.approx(48.0, abs=4.0)  # ~3 blocks of 16
    assert expect < _aligned_rows(few, 128) * per_row / 3  # vs the GEMM groups


def test_an_overlapped_shared_mlp_is_held_back_at_most_until_the_routed_path_ends():
    """An overlapped curve measured beside a long routed path (one rank, every expert) must not
    make the shared stage outlast a shorter routed path elsewhere by more than its own time."""
    from epmoe.config import get_preset
    from epmoe.plan.cost import Candidate, Workload, predict_layer
    from epmoe.plan.profile import MlpCurve
    from epmoe.plan.topology import Topology

    cfg = get_preset("deepseek-v3-tiny")
    assert cfg.num_shared_experts
    width = cfg.shared_intermediate
    slow = MlpCurve("triton", "bf16", width, cfg.hidden, True, ((1.0, 5e4), (1e6, 5e4)), P)
    alone = MlpCurve("triton", "bf16", width, cfg.hidden, False, ((1.0, 7.0), (1e6, 7.0)), P)
    prof = dataclasses.replace(synthetic_profile(), mlp=(slow, alone))
    work = Workload(cfg, QuantConfig("bf16"), 64, overlap_shared=True)
    pred = predict_layer(Candidate("ep_dp", "local", "triton"), work, Topology.parse("1x1"),
                         prof)
    st = pred.stages_us
    routed = st["dispatch"] + st["experts"] + st["combine"]
    assert st["shared"] == pytest.approx(routed + 7.0)
    # a curve below that bound is taken as measured
    fast = dataclasses.replace(slow, points=((1.0, 3.0), (1e6, 3.0)))
    prof = dataclasses.replace(prof, mlp=(fast, alone))
    pred = predict_layer(Candidate("ep_dp", "local", "triton"), work, Topology.parse("1x1"),
                         prof)
    assert pred.stages_us["shared"] == pytest.approx(3.0)
