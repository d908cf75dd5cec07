"""The host's issue time of a comm call in the cost model: `epmoe.bench.symm_host`'s fits
(kernels["comm"]["host.<backend>.<direction>"]) replace the op count where a profile has them,
scale with the host's speed, and the bench refuses to run without CUDA."""

from dataclasses import replace

import pytest
import torch

from epmoe.bench.symm_host import host_fits, main, write_profile
from epmoe.plan.comm_cost import COMBINE_OPS, DISPATCH_OPS, issue_us
from epmoe.plan.figures import AlphaBeta, Provenance
from epmoe.plan.profile import HOST_OP, Figure, load_profile
from epmoe.plan.synthetic import synthetic_profile

P = Provenance("measured", "test")


def with_host(prof, **fits):
    comm = {**prof.kernels.get("comm", {}),
            **{f"host.{k.replace('_', '-', 1).replace('_', '.')}": AlphaBeta(v, 1e9, P)
               for k, v in fits.items()}}
    return replace(prof, kernels={**prof.kernels, "comm": comm})


def test_issue_time_is_the_fit_where_measured_else_the_ops_launched():
    prof = synthetic_profile(launch_us=10.0)
    assert issue_us(prof, "symm-ht", "dispatch") == 10.0 * DISPATCH_OPS["symm-ht"]
    assert issue_us(prof, "deepep-ll", "combine") == 10.0 * COMBINE_OPS["deepep-ll"]
    fitted = with_host(prof, symm_ht_dispatch=700.0, symm_ll_combine=150.0)
    assert set(fitted.kernels["comm"]) >= {"host.symm-ht.dispatch", "host.symm-ll.combine"}
    assert issue_us(fitted, "symm-ht", "dispatch") == 700.0
    assert issue_us(fitted, "symm-ll", "combine") == 150.0
    assert issue_us(fitted, "symm-ht", "combine") == 10.0 * COMBINE_OPS["symm-ht"]


def test_issue_fits_scale_with_the_hosts_speed():
    prof = with_host(synthetic_profile(), symm_ht_dispatch=700.0)
    prof = replace(prof, device={**prof.device, HOST_OP: Figure(10.0, P)})
    slow = prof.at_host_speed(1.5)
    assert issue_us(slow, "symm-ht", "dispatch") == pytest.approx(1050.0)


def test_host_fits_are_the_median_of_send_plus_receive_per_backend(tmp_path):
    def r(ds, dr, cs, cr):
        return dict(dispatch_send=ds, dispatch_recv=dr, combine_send=cs, combine_recv=cr)

    res = {"symm-ht fp8_block 128": r(500, 200, 100, 50),
           "symm-ht bf16 4096": r(400, 100, 90, 60),
           "symm-ht fp8_block 4096": r(450, 150, 95, 55),
           "symm-ll fp8_block 1": r(200, 100, 80, 60)}
    fits = host_fits(res)
    assert fits == {"host.symm-ht.dispatch": 600.0, "host.symm-ht.combine": 150.0,
                    "host.symm-ll.dispatch": 300.0, "host.symm-ll.combine": 140.0}
    out = tmp_path / "p.json"
    write_profile("h200", str(out), fits, "a test")
    prof = load_profile(str(out))
    assert issue_us(prof, "symm-ll", "dispatch") == 300.0
    assert prof.kernels["comm"]["host.symm-ht.combine"].prov.source == "measured"
    assert load_profile("h200").kernels.get("comm", {}).get("host.symm-ht.combine") is None


def test_the_shipped_calibrated_profiles_carry_the_measured_issue_times():
    for name in ("h200-calibrated", "h200x2-calibrated"):
        comm = load_profile(name).kernels["comm"]
        for b in ("symm-ht", "symm-ll"):
            for d in ("dispatch", "combine"):
                fit = comm[f"host.{b}.{d}"]
                assert fit.prov.source == "measured" and 50.0 < fit.alpha_us < 2000.0


def test_without_cuda_it_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["--profile", "h200"]) == 2  # --out missing
    assert "--profile and --out go together" in capsys.readouterr().err


@pytest.mark.gpu
def test_measure_times_every_phase_on_a_gpu():
    from epmoe.bench.symm_host import PHASES, measure

    r = measure("symm-ll", 1, "fp8_block", iters=2, warmup=2)
    assert all(r[p] > 0 for p in PHASES)
    # every symm-ll kernel is a bound Launcher: none goes through Triton's per-call binding
    assert all(n == 0 for n in r["triton_launches"].values()), r["triton_launches"]


def test_write_profile_scales_the_fits_to_the_profiles_host(tmp_path):
    """Measured on a host twice as slow per op as the profile's: written at half."""
    src = tmp_path / "src.json"
    prof = load_profile("h200")
    replace(prof, device={**prof.device, HOST_OP: Figure(5.0, P)}).save(str(src))
    out = tmp_path / "p.json"
    write_profile(str(src), str(out), {"host.symm-ll.dispatch": 300.0}, "a test",
                  host_op_us=10.0)
    fit = load_profile(str(out)).kernels["comm"]["host.symm-ll.dispatch"]
    assert fit.alpha_us == 150.0
    assert "x0.500" in fit.prov.note
