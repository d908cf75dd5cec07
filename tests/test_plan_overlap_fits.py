"""Routed stages beside the shared MLP: on CUDA the runtime runs the shared MLP on a side stream
next to the routed path, and the kernels that overlap it run slower (they share SMs and HBM).
The calibration times the routed stages both ways; the model reads the fits timed beside the
shared MLP when the layer runs one so (".overlapped" kernel fits, overlapped GEMM curves) and
the ones timed alone otherwise."""

from __future__ import annotations

import dataclasses
import json

import pytest

from epmoe.config import MoEConfig, QuantConfig
from epmoe.plan.cost import Candidate, Workload, predict_layer
from epmoe.plan.profile import AlphaBeta, MlpCurve, Provenance, from_dict, to_dict
from epmoe.plan.synthetic import SYN, synthetic_profile
from epmoe.plan.topology import Topology

CFG = MoEConfig("t", hidden=256, moe_intermediate=128, num_experts=16, top_k=4,
                num_shared_experts=1)
Q = QuantConfig("fp8_block")
P = Provenance("measured", "test")


def _profile(shared_us: float = 1e6):
    """Alone fits 10 us, fits beside the shared MLP 50 us; the overlapped GEMM curve at a
    quarter of the alone curve's TFLOPS; the shared MLP beside the routed path `shared_us`
    (default: longer than the whole routed path, so every routed stage runs beside it)."""
    prof = synthetic_profile(hbm_GBps=1e9)
    k = {t: dict(v) for t, v in prof.kernels.items()}
    for name in ("permute", "gather", "act_quant.fp8_block"):
        k["triton"][name] = AlphaBeta(10.0, 1e9, SYN)
        k["triton"][f"{name}.overlapped"] = AlphaBeta(50.0, 1e9, SYN)
    alone = [c for c in prof.gemm if c.backend == "triton" and c.recipe == "fp8_block"]
    beside = tuple(dataclasses.replace(c, points=tuple((m, t / 4) for m, t in c.points),
                                       overlapped=True) for c in alone)
    mlp = (MlpCurve("triton", "fp8_block", CFG.shared_intermediate, CFG.hidden, True,
                    ((1.0, shared_us), (1e6, shared_us)), P),)
    return dataclasses.replace(prof, kernels=k, gemm=prof.gemm + beside, mlp=mlp)


def _stages(prof, cfg=CFG, overlap=True):
    work = Workload(cfg, Q, tokens=256, overlap_shared=overlap)
    cand = Candidate("ep_dp", "local", "triton")
    return predict_layer(cand, work, Topology(1, 1, "h200"), prof).stages_us


def test_beside_the_shared_mlp_the_overlapped_fits_are_read():
    prof = _profile()
    beside, alone = _stages(prof), _stages(prof, overlap=False)
    for s in ("experts.permute", "experts.gather", "experts.act_quant"):
        assert beside[s] == pytest.approx(50.0, rel=1e-3)
        assert alone[s] == pytest.approx(10.0, rel=1e-3)
    for g in ("experts.gemm1", "experts.gemm2"):
        assert beside[g] == pytest.approx(4 * alone[g], rel=1e-6)
    # an overlapped fit below the alone one (extrapolated from larger sizes): never faster
    k = {t: dict(v) for t, v in prof.kernels.items()}
    k["triton"]["permute.overlapped"] = AlphaBeta(2.0, 1e9, SYN)
    low = _stages(dataclasses.replace(prof, kernels=k))
    assert low["experts.permute"] == pytest.approx(10.0, rel=1e-3)
    assert low["experts.gather"] == pytest.approx(50.0, rel=1e-3)
    # no shared experts: nothing runs beside the routed path, whatever overlap_shared says
    plain = _stages(prof, CFG.replace(num_shared_experts=0))
    assert plain["experts.permute"] == pytest.approx(10.0, rel=1e-3)
    assert plain["experts.gemm1"] == pytest.approx(alone["experts.gemm1"], rel=1e-6)
    # a shared MLP that ends as the experts start (1 ns beside the first stage): all alone
    early = _stages(_profile(shared_us=1e-3))
    for s in ("experts.permute", "experts.gemm1", "experts.act_quant"):
        assert early[s] == pytest.approx(alone[s], rel=1e-3)


def test_a_profile_without_overlapped_fits_reads_the_alone_ones():
    prof = synthetic_profile(hbm_GBps=1e9)
    beside, alone = _stages(prof), _stages(prof, overlap=False)
    for s in ("experts.permute", "experts.gemm1", "experts.act_quant"):
        assert beside[s] == pytest.approx(alone[s], rel=1e-9)


def test_overlapped_curves_survive_json_and_old_profiles_read_as_alone():
    prof = _profile()
    back = from_dict(json.loads(json.dumps(to_dict(prof))))
    assert sum(c.overlapped for c in back.gemm) == sum(c.overlapped for c in prof.gemm) > 0
    c = back.curve("triton", "fp8_block", "contiguous", 256, 256, overlapped=True)
    assert c.overlapped and c.key.endswith("+overlapped/" + c.key.rsplit("/", 1)[1])
    assert not back.curve("triton", "fp8_block", "contiguous", 256, 256).overlapped
    d = to_dict(prof)
    for c in d["gemm"]:
        del c["overlapped"]  # a profile from before: every curve timed alone
    assert not any(c.overlapped for c in from_dict(d).gemm)


def test_blend_places_each_stage_on_the_shared_mlps_timeline():
    from epmoe.plan.beside import blend

    alone = {"experts.permute": 10.0, "experts.gemm1": 100.0, "experts.act_quant": 10.0,
             "experts.gemm2": 50.0, "experts.gather": 10.0}
    alone["experts"] = sum(alone.values()) + 5.0  # + a backend's extra (kept)
    beside = {s: 2 * v for s, v in alone.items() if s != "experts"}
    # the shared MLP ends at 90 us from the fork; the experts start after a 20 us dispatch:
    # permute 20..40 beside (20 us), gemm1 from 40: 50 us beside does a quarter of its work
    # (its beside time is 200), the rest alone (75 us); everything after runs alone
    out = blend(alone, beside, 20.0, 90.0)
    assert out["experts.permute"] == pytest.approx(20.0)
    assert out["experts.gemm1"] == pytest.approx(50.0 + 75.0)
    for s in ("experts.act_quant", "experts.gemm2", "experts.gather"):
        assert out[s] == alone[s]
    assert out["experts"] == pytest.approx(alone["experts"] + 10.0 + 25.0)
    assert blend(alone, beside, 20.0, 0.0) == alone  # no shared MLP time: all alone
    everything = blend(alone, beside, 0.0, 1e9)
    assert all(everything[s] == beside[s] for s in beside)


def test_the_calibration_keeps_only_stages_that_ran_entirely_beside_the_shared_mlp():
    from epmoe.bench.layer_points import LayerFits, Size, routed_points
    from epmoe.config import get_preset

    cfg = get_preset("deepseek-v3-tiny")
    q = QuantConfig("bf16")
    size = Size(tokens=64, real=64 * cfg.top_k, align=1, rows=64 * cfg.top_k,
                 aq_rows=64 * cfg.top_k)
    # dispatch 10, permute 10..30, gemm1 30..80, act_quant 80..110: the shared ends at 100
    st = {"dispatch": 10.0, "experts.permute": 20.0, "experts.gemm1": 50.0,
          "experts.act_quant": 30.0, "experts.gemm2": 40.0, "experts.gather": 5.0,
          "shared": 100.0}
    fits, gemm = LayerFits(), {(g, side): {} for g in ("gemm1", "gemm2") for side in (0, 1)}
    routed_points(fits, gemm, st, size, cfg, q, "torch", "bf16", True)
    names = {n for _, n in fits.points}
    assert names == {"permute.overlapped", "permute.bf16.overlapped"}  # pooled, per recipe
    assert gemm[("gemm1", True)] and not gemm[("gemm2", True)]
    routed_points(fits, gemm, st, size, cfg, q, "torch", "bf16", False)  # alone: all of them
    assert {"permute", "gather", "act_quant", "permute.bf16", "gather.bf16",
            "act_quant.bf16"} <= {n for _, n in fits.points}
    assert gemm[("gemm2", False)]


def test_calibration_runs_beside_the_shared_mlp_on_request():
    """measure_layer with beside_shared on CPU (no side stream: the shared MLP runs after the
    routed path, so little or nothing counts as beside it): it runs and labels what it keeps."""
    import torch

    from epmoe.bench.calibrate import Clock, fit_ab
    from epmoe.bench.calibrate_layer import measure_layer
    from epmoe.bench.layer_points import LayerFits, finish
    from epmoe.config import get_preset

    cfg = get_preset("deepseek-v3-tiny")
    assert cfg.num_shared_experts > 0
    fits, clock = LayerFits(), Clock([], 120.0, "test")
    measure_layer("deepseek-v3-tiny", cfg, QuantConfig("bf16"), "torch", torch.device("cpu"),
                  clock, fits, quick=True, reps=1, beside_shared=True)
    kernels = finish(fits, clock, fit_ab)["torch"]
    assert {"permute", "gather", "act_quant", "act_quant.bf16"} <= set(kernels)
    assert all("beside the shared MLP" in c.prov.note for c in fits.gemm if c.overlapped)
    assert any(not c.overlapped for c in fits.gemm)
