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
from epmoe.plan.profile import AlphaBeta, GemmCurve, Provenance, from_dict, to_dict
from epmoe.plan.synthetic import SYN, synthetic_profile
from epmoe.plan.topology import Topology

CFG = MoEConfig("t", hidden=256, moe_intermediate=128, num_experts=16, top_k=4,
                num_shared_experts=1)
Q = QuantConfig("fp8_block")
P = Provenance("measured", "test")


def _profile():
    """Alone fits 10 us, fits beside the shared MLP 50 us; the overlapped GEMM curve at a
    quarter of the alone curve's TFLOPS."""
    prof = synthetic_profile(hbm_GBps=1e9)
    k = {t: dict(v) for t, v in prof.kernels.items()}
    for name in ("permute", "gather", "act_quant.fp8_block"):
        k["triton"][name] = AlphaBeta(10.0, 1e9, SYN)
        k["triton"][f"{name}.overlapped"] = AlphaBeta(50.0, 1e9, SYN)
    alone = [c for c in prof.gemm if c.backend == "triton" and c.recipe == "fp8_block"]
    beside = tuple(dataclasses.replace(c, points=tuple((m, t / 4) for m, t in c.points),
                                       overlapped=True) for c in alone)
    return dataclasses.replace(prof, kernels=k, gemm=prof.gemm + beside)


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
    # no shared experts: nothing runs beside the routed path, whatever overlap_shared says
    plain = _stages(prof, CFG.replace(num_shared_experts=0))
    assert plain["experts.permute"] == pytest.approx(10.0, rel=1e-3)
    assert plain["experts.gemm1"] == pytest.approx(alone["experts.gemm1"], rel=1e-6)


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


def test_calibration_times_the_routed_stages_beside_the_shared_mlp(tmp_path):
    """measure_layer with beside_shared: every routed fit and GEMM curve also comes timed with
    the shared MLP on (CPU: no side stream, so this checks the bookkeeping, not contention)."""
    import torch

    from epmoe.bench.calibrate import Clock
    from epmoe.bench.calibrate_layer import LayerFits, finish, measure_layer
    from epmoe.bench.calibrate import fit_ab
    from epmoe.config import get_preset

    cfg = get_preset("deepseek-v3-tiny")
    assert cfg.num_shared_experts > 0
    fits, clock = LayerFits(), Clock([], 120.0, "test")
    measure_layer("deepseek-v3-tiny", cfg, QuantConfig("bf16"), "torch", torch.device("cpu"),
                  clock, fits, quick=True, reps=1, beside_shared=True)
    kernels = finish(fits, clock, fit_ab)["torch"]
    for name in ("permute", "gather", "act_quant", "act_quant.bf16"):
        assert name in kernels and f"{name}.overlapped" in kernels
        assert kernels[f"{name}.overlapped"].prov.source == "measured"
    sides = {(c.n, c.k, c.overlapped) for c in fits.gemm}
    i, d = cfg.moe_intermediate, cfg.hidden
    assert sides == {(2 * i, d, False), (2 * i, d, True), (d, i, False), (d, i, True)}
    assert all("beside the shared MLP" in c.prov.note for c in fits.gemm if c.overlapped)
