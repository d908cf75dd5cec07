"""A profile moved to another host's speed (`HardwareProfile.at_host_speed`): host time
scales, GPU time stays."""

import pytest

from epmoe.plan.profile import Provenance, load_profile


def test_at_host_speed_scales_the_host_time_only():
    """A host f times as slow per op: the layer's issue time scales by f; a stage fit timed
    on an idle GPU that has a queued twin (its GPU time) scales only by what each of its
    terms takes beyond the twin's (a bandwidth-bound stage not at all); the twins, fits
    without one, GEMMs and links stay."""
    from epmoe.plan.profile import HOST_OP, AlphaBeta, Figure

    base = load_profile("h200")
    assert base.host_op_us is None  # spec-derived: no host measured
    m = Provenance("measured", "t")
    kern = {**base.kernels,
            "router": {"softmax": AlphaBeta(200.0, 1e3, m, 150.0),
                       "softmax.queued": AlphaBeta(40.0, 2e3, m, 90.0),
                       "sigmoid": AlphaBeta(70.0, 1e3, m)},
            "triton": {**base.kernels["triton"],  # HBM-bound: idle or queued, the same
                       "act_quant": AlphaBeta(10.0, 3e3, m, 17.0),
                       "act_quant.queued": AlphaBeta(30.0, 3e3, m, 17.0),
                       # beside the shared MLP on an idle GPU: the plain fit's twin is its own
                       "permute.overlapped": AlphaBeta(300.0, 2e3, m),
                       "permute.queued": AlphaBeta(0.0, 2e3, m, 25.0)},
            "layer": {"issue": AlphaBeta(1000.0, 1e3, m),
                      "issue.triton": AlphaBeta(900.0, 1e3, m),
                      "tail": AlphaBeta(300.0, 1e3, m)}}
    prof = base.replace(kernels=kern, device={**base.device, HOST_OP: Figure(8.0, m)})
    assert prof.host_op_us == 8.0 and prof.at_host_speed(1.0) is prof
    for f in (2.5, 0.4):
        s = prof.at_host_speed(f)
        for nbytes in (1e3, 1e6, 1e8):
            for name in ("issue", "issue.triton"):  # all host
                assert s.kernel("layer", name).time_us(nbytes) == \
                    pytest.approx(prof.kernel("layer", name).time_us(nbytes) * f)
            # softmax: the twin's 40 us + 0.5 us/MB + its 90 us floor are GPU time, the
            # 160 us + 0.5 us/MB + 60 us of floor beyond them the host's
            want = max(90.0 + 60.0 * f, 40.0 + 160.0 * f + nbytes * (0.5 + 0.5 * f) / 1e6)
            assert s.kernel("router", "softmax").time_us(nbytes) == pytest.approx(want)
            assert s.kernel("triton", "act_quant").time_us(nbytes) == \
                pytest.approx(prof.kernel("triton", "act_quant").time_us(nbytes))
            assert s.kernel("triton", "permute.overlapped").time_us(nbytes) == \
                pytest.approx(300.0 * f + nbytes / 2e6)
        for table, name in (("router", "softmax.queued"), ("router", "sigmoid"),
                            ("layer", "tail"), ("triton", "act_quant.queued")):
            assert s.kernel(table, name) == prof.kernel(table, name)
        assert s.gemm == prof.gemm and s.comm == prof.comm
        assert s.host_op_us == pytest.approx(8.0 * f)  # it now describes that host
        back = s.at_host_speed(1 / f).kernel("router", "softmax")  # f then 1 / f: itself
        want = prof.kernel("router", "softmax")
        assert (back.alpha_us, back.beta_GBps, back.floor_us) == pytest.approx(
            (want.alpha_us, want.beta_GBps, want.floor_us))
    twice = prof.at_host_speed(2.0).at_host_speed(1.5).kernel("router", "softmax")
    once = prof.at_host_speed(3.0).kernel("router", "softmax")
    assert (twice.alpha_us, twice.beta_GBps, twice.floor_us) == pytest.approx(
        (once.alpha_us, once.beta_GBps, once.floor_us))


def test_at_host_speed_scales_the_shared_mlp_beside_the_routed_path_by_its_host_part():
    """The shared MLP on its side stream of an idle GPU: each point's time beyond the same
    MLP timed alone (behind the routed path: its GPU time) scales; the alone and queued
    curves, and a curve without an alone twin, stay; f then g is f x g."""
    from epmoe.plan.profile import HOST_OP, Figure, MlpCurve

    m = Provenance("measured", "t")
    alone = MlpCurve("triton", "bf16", 64, 128, False, ((128, 50.0), (4096, 700.0)), m)
    over = MlpCurve("triton", "bf16", 64, 128, True, ((128, 600.0), (4096, 1000.0)), m)
    queued = MlpCurve("triton", "bf16", 64, 128, True, ((128, 2000.0), (4096, 4000.0)), m, True)
    lone = MlpCurve("torch", "bf16", 64, 128, True, ((128, 900.0),), m)  # no alone twin
    base = load_profile("h200")
    prof = base.replace(mlp=(alone, over, queued, lone),
                        device={**base.device, HOST_OP: Figure(8.0, m)})
    for f in (0.5, 2.0):
        s = prof.at_host_speed(f)
        got = {c.key: c for c in s.mlp}
        assert [t for _, t in got[over.key].points] == pytest.approx(
            [50.0 + 550.0 * f, 700.0 + 300.0 * f])
        for c in (alone, queued, lone):
            assert got[c.key] == c
        n = 1000.0  # between the points: the scaled points, interpolated
        assert s.mlp_curve("triton", "bf16", 64, 128, True).time_us(n) == \
            pytest.approx(got[over.key].time_us(n))
    twice = prof.at_host_speed(2.0).at_host_speed(1.5).mlp_curve("triton", "bf16", 64, 128, True)
    once = prof.at_host_speed(3.0).mlp_curve("triton", "bf16", 64, 128, True)
    assert [t for _, t in twice.points] == pytest.approx([t for _, t in once.points])
