"""The launch's float64 check where the ranks are (epmoe.launch.oracle): each layer's oracle runs
on a rank (on its GPU when it has one), the verdicts match the host's, a poisoned layer fails by
number, a rank that fails or hangs in the check is blamed by name, a GPU out of memory falls
back to the host, and a long check says how far it is."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.launch.oracle import (MIN_VALUES_PER_S, LayerCheck, check_correctness,
                                 check_deadline_s, layer_checks, solve, solve_here)
from epmoe.plan.run import RunConfig
from epmoe.runtime import Runtime


def _reports(run: RunConfig) -> list[dict]:
    rt = Runtime(run, device="cpu")
    try:
        for s in range(run.steps):
            rt.step(s)
        return [rt.report()]
    finally:
        rt.close()


def test_a_poisoned_layer_fails_by_number_and_the_others_pass(seed):
    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("fp8_block"), experts="torch",
                    tokens=12, layers=3, steps=1, seed=seed)
    rep = _reports(run)[0]
    clean = check_correctness(run, [rep])
    assert clean["passed"] and len(clean["per_layer"]) == 3
    assert clean["oracle"]["devices"] == ["cpu"] and clean["tokens_checked"] == 12
    # past the rounding slack (the oracle's own measure of a legitimate bf16 flip of GEMM1's
    # output) never more than the plain error
    assert 0 <= clean["max_rel_err"] <= clean["max_rel_err_raw"] <= clean["tolerance"]
    last = [dict(r) for r in rep["last"]]
    out = last[1]["out"].clone()  # poisoned: one element off by 10% of max|out|
    out[5, 7] += 0.1 * out.abs().max()
    last[1]["out"] = out
    bad = check_correctness(run, [dict(rep, last=last)])
    assert not bad["passed"]
    assert bad["per_layer"][1] > bad["tolerance"] >= max(bad["per_layer"][0],
                                                         bad["per_layer"][2])
    # the slack forgives a flip's worth at most: 10% of max|out| still fails by most of it
    assert bad["per_layer"][1] > 0.05


def test_a_row_past_the_tolerance_is_judged_past_its_rounding_slack(seed):
    """An output off by more than the tolerance gets its rounding slack (what a bf16 flip of
    GEMM1's output moves it by): the element with the most slack, set past the tolerance by
    half its slack, passes; by one and a half, it fails. (The margin, half the slack, is over
    twice a bf16 output's rounding at the sizes here.)"""
    from epmoe.launch.oracle import LazyOracleLayer
    from epmoe.reference import reference_moe, rounding_slack

    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("fp8_block"), experts="torch",
                    tokens=12, layers=1, steps=1, seed=seed)
    rep = _reports(run)[0]
    (c,) = layer_checks(run, [rep])
    oracle = LazyOracleLayer(run, 0).as_tuple()
    ref = reference_moe(c.x, oracle, run.cfg, run.quant, c.ids, c.w)
    slack = rounding_slack(c.x, oracle, run.cfg, run.quant, c.ids, c.w)
    tol = check_correctness(run, [rep])["tolerance"]
    m = ref.abs().max()
    row, col = divmod(int(slack.argmax()), slack.shape[1])
    s = slack[row, col]
    assert s > 0.005 * m  # 2^-9 (m + 3%): a bf16 output's rounding is below half of it

    def judged(past_tol):
        last = [dict(r) for r in rep["last"]]
        out = last[0]["out"].clone()
        out[row, col] = (ref[row, col] + tol * m + past_tol).to(out.dtype)
        last[0]["out"] = out
        return check_correctness(run, [dict(rep, last=last)])

    ok = judged(0.5 * s)
    assert ok["max_rel_err_raw"] > tol and ok["passed"], ok
    bad = judged(1.5 * s)
    assert not bad["passed"] and bad["max_rel_err"] > tol, bad


def test_a_device_out_of_memory_falls_back_to_the_host(monkeypatch, seed):
    """The ranks' weights and buffers are still on the GPU while their layers are checked: a
    GPU that cannot hold one float64 expert more checks on the host instead, and says so."""
    import epmoe.launch.oracle as oracle

    run = RunConfig(model="deepseek-v3-tiny", experts="torch", tokens=8, layers=1, steps=1,
                    seed=seed)
    (check,) = layer_checks(run, _reports(run))
    real, tried = oracle._solve_on, []

    def on(run_, check_, device):
        tried.append(device.type)
        if device.type != "cpu":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(run_, check_, device)

    monkeypatch.setattr(oracle, "_solve_on", on)
    v = solve(run, check, "cuda")
    assert tried == ["cuda", "cpu"] and v.device == "cpu (cuda out of memory)"
    host = solve(run, check)
    assert host.device == "cpu"
    torch.testing.assert_close(v.ref, host.ref, rtol=0, atol=0)
    def host_oom(*_):
        raise torch.OutOfMemoryError("host")

    monkeypatch.setattr(oracle, "_solve_on", host_oom)
    with pytest.raises(torch.OutOfMemoryError):  # on the host there is nowhere else to go
        solve(run, check)


def test_the_deadline_grows_with_the_weights_a_check_regenerates():
    run = RunConfig(model="deepseek-v3-tiny", timeout_s=7.0)
    cfg = run.cfg
    d, k = cfg.hidden, cfg.top_k

    def check(experts: list[int]) -> LayerCheck:
        ids = torch.tensor([experts[i:i + k] for i in range(0, len(experts), k)])
        return LayerCheck(0, torch.zeros(ids.shape[0], d), ids, torch.ones(ids.shape), None,
                          False)

    one = 3 * d * cfg.moe_intermediate / MIN_VALUES_PER_S  # seconds per expert at the floor
    few, many = check(list(range(k))), check(list(range(2 * k)))
    empty = LayerCheck(0, torch.zeros(1, d), torch.full((1, k), -1), torch.zeros(1, k), None,
                       False)
    assert check_deadline_s(run, [few]) == math.ceil(7.0 + k * one)
    assert check_deadline_s(run, [few, many]) == math.ceil(7.0 + 2 * k * one) > 7.0
    assert check_deadline_s(run, [empty]) == 7.0 and check_deadline_s(run, []) == 7.0


def test_a_long_check_reports_how_far_it_is():
    from rich.console import Console

    from epmoe.launch.console import Phases

    buf = io.StringIO()
    p = Phases(console=Console(file=buf, width=80))
    tick = p.counter("layers checked", every_s=0.0)
    for i in range(1, 4):
        tick(i, 3)
    lines = buf.getvalue().splitlines()  # the last one is the phase's end: no line
    assert [line.split("] ")[1] for line in lines] == ["layers checked: 1/3",
                                                       "layers checked: 2/3"]
    quiet = io.StringIO()
    slow = Phases(console=Console(file=quiet, width=80)).counter("x", every_s=3600)
    slow(1, 3)
    assert quiet.getvalue() == ""


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_the_ranks_check_the_layers_and_are_blamed_when_they_fail(seed, monkeypatch, tmp_path,
                                                                   capsys):
    """Three layers over two CPU ranks: the verdicts equal the host's bit for bit (the same
    oracle, layer by layer on the rank it was given to) and a poisoned layer fails there too;
    then a rank raising and a rank hanging in its check exit 3 naming it and the oracle."""
    from epmoe.launch.cli import main
    from epmoe.launch.driver import driver_for

    run = RunConfig(model="deepseek-v3-tiny", world=2, experts="torch", tokens=6, layers=3,
                    steps=1, seed=seed, timeout_s=60.0)
    with driver_for(run) as d:
        reports, _ = d.execute()
        checks = layer_checks(run, reports)
        on_ranks = list(d.solve_checks(checks))
        last = [dict(r) for r in reports[1]["last"]]
        out = last[2]["out"].clone()
        out[0, 0] += 0.1 * out.abs().max()
        last[2]["out"] = out
        bad = check_correctness(run, [reports[0], dict(reports[1], last=last)], d.solve_checks)
    assert [v.layer for v in on_ranks] == [0, 1, 2]
    for v, h in zip(on_ranks, solve_here(run, checks)):
        torch.testing.assert_close(v.ref, h.ref, rtol=0, atol=0)
        assert v.router == h.router
    assert not bad["passed"] and bad["per_layer"][2] > bad["tolerance"]
    assert max(bad["per_layer"][:2]) <= bad["tolerance"]

    args = ["--ep", "2", "--tokens", "4", "--layers", "3", "--steps", "1", "--experts",
            "torch", "--quiet", "--device", "cpu"]
    monkeypatch.setenv("EPMOE_FAULT", "1:oracle:raise")
    out = tmp_path / "f.json"
    assert main([*args, "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "rank 1 failed in oracle" in err and "injected fault on rank 1" in err, err
    assert json.loads(out.read_text())["failure"]["ranks"] == [1]
    monkeypatch.setenv("EPMOE_FAULT", "0:oracle:hang")
    assert main([*args, "--timeout", "8"]) == 3
    err = capsys.readouterr().err
    assert "rank 0" in err and "oracle" in err and "rank 1" not in err.split("rank 0")[0], err


@pytest.mark.gpu
def test_the_oracle_on_a_gpu_agrees_with_the_host(seed):
    """float64 on the GPU: the same weights (generated bit-identically there), the same loops.
    The oracle evaluates the activation in fp32 as the fused kernels do, and fp32 exp differs
    by an ulp between the host and the GPU (measured on one H100: 6.4e-8 of max|ref|, bf16):
    the two oracles agree far inside the recipes' tolerances (1-2e-2), not bit for bit; an
    ulp that flips the activation's bf16 / fp8 rounding moves the output by at most ~1e-3."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for quant, bound in ((QuantConfig("bf16"), 1e-3), (QuantConfig("fp8_block"), 5e-3)):
        run = RunConfig(model="deepseek-v3-tiny", quant=quant, experts="torch", tokens=32,
                        layers=2, steps=1, seed=seed)
        for check in layer_checks(run, _reports(run)):
            gpu, host = solve(run, check, "cuda"), solve(run, check)
            assert gpu.device == "cuda" and host.device == "cpu"
            diff = float((gpu.ref - host.ref).abs().max() / host.ref.abs().max())
            print(f"{quant.recipe} layer {check.layer}: host vs GPU oracle {diff:.1e}")
            assert diff < bound, (quant.recipe, check.layer, diff)
            assert gpu.router["agreement"] == host.router["agreement"]


def test_the_lazy_oracle_builds_the_router_once(monkeypatch, seed):
    """Synthetic weights: each touched expert is generated alone (the same values as the whole
    layer's), the router once at construction, not again per expert."""
    import epmoe.weights as wt
    from epmoe.launch.oracle import LazyOracleLayer

    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("fp8_block"), tokens=4,
                    layers=2, seed=seed)
    whole = wt.dequantized_full_layer(run.cfg, run.quant, 1, seed)
    routers, real = [], wt.synthetic_router
    monkeypatch.setattr(wt, "synthetic_router", lambda *a, **kw: routers.append(a[1]) or
                        real(*a, **kw))
    lazy = LazyOracleLayer(run, 1)
    for e in (0, 5, 5, 11):
        assert torch.equal(lazy.w13[e], whole.w13[e]) and torch.equal(lazy.w2[e], whole.w2[e])
    assert torch.equal(lazy.gate, whole.gate) and routers == [1]
