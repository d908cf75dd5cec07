"""`python -m epmoe.bench.calibrate`: the fits, and a --quick CPU run that writes a profile
the planner loads (measured figures marked with machine, date and command)."""

import pytest

from epmoe.bench.calibrate import fit_ab, main
from epmoe.plan.profile import load_profile


def test_fit_ab_recovers_alpha_and_beta():
    alpha, beta = 12.5, 300.0  # us, GB/s
    pts = [(b, alpha + b / (beta * 1e3)) for b in (1e5, 1e6, 1e7, 5e7)]
    a, b = fit_ab(pts)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
    a, b = fit_ab([(1e6, 10.0)])  # one point: no fixed cost visible
    assert a == 0.0 and b == pytest.approx(1e6 / 10.0 / 1e3)
    with pytest.raises(ValueError, match="no positive"):
        fit_ab([])


def _check(path):
    prof = load_profile(str(path))
    assert prof.gpu == "cpu" and prof.fig("sm_arch") == 0
    assert prof.device["launch_us"].prov.source == "measured"
    assert "python -m epmoe.bench.calibrate" in prof.device["hbm_GBps"].prov.note
    curve = prof.curve("torch", "bf16", "contiguous", 256, 256)
    assert curve.prov.source == "measured" and len(curve.points) >= 2
    assert prof.kernel("torch", "permute").prov.source == "measured"
    # the layer's own stages (calibrate_layer.py): the local backend, the router, shared MLP
    for table, name in (("local", "dispatch"), ("local", "combine"),
                        ("router", "sigmoid_grouped"), ("layer", "tail")):
        fit = prof.kernel(table, name)
        assert fit.prov.source == "measured" and "MoELayer.forward" in fit.prov.note
    mlp = prof.mlp_curve("torch", "bf16", 128, 256, overlapped=False)
    assert mlp is not None and mlp.prov.source == "measured" and len(mlp.points) == 3
    assert not mlp.overlapped  # CPU: no side stream
    return prof


def test_quick_cpu_one_rank(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert main(["--quick", "--ranks", "1", "--out", str(out), "--name", "t",
                 "--device", "cpu"]) == 0
    assert "not measured: comm" in capsys.readouterr().out
    _check(out)


@pytest.mark.slow
def test_quick_cpu_two_ranks_measures_gloo(tmp_path):
    out = tmp_path / "cpu.json"
    assert main(["--quick", "--out", str(out), "--device", "cpu"]) == 0
    prof = _check(out)
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        assert prof.collective(kind, "tcp").prov.source == "measured"
    assert prof.comm_fit("all2all", "tcp", "dispatch").prov.source == "measured"


@pytest.mark.parametrize("recipes,msg", [("fp9", "each must be one of"),
                                         ("fp8_block", "hidden (2880) must be a multiple")])
def test_recipes_are_checked_before_anything_is_measured(tmp_path, capsys, recipes, msg):
    out = tmp_path / "p.json"
    assert main(["--out", str(out), "--device", "cpu", "--model", "gpt-oss-120b",
                 "--recipes", recipes]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and not out.exists()
