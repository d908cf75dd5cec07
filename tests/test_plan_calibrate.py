"""`python -m epmoe.bench.calibrate`: the fits, and a --quick CPU run that writes a profile
the planner loads (measured figures marked with machine, date and command)."""

import pytest
import torch

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
    # the host's speed beside the issue times it scales: one probe after each size's forwards
    assert prof.host_op_us > 0 and "after each size's forwards: the median of 3" in \
        prof.device["host_op_us"].prov.note
    assert "python -m epmoe.bench.calibrate" in prof.device["hbm_GBps"].prov.note
    slice_ = prof.device["sched_slice_us"]  # what time-slicing CPU ranks run unpreempted
    assert slice_.prov.source == "measured" and 100.0 < slice_.value < 1e6
    curve = prof.curve("torch", "bf16", "contiguous", 256, 256)
    assert curve.prov.source == "measured" and len(curve.points) >= 2
    for name in ("permute", "gather", "act_quant"):  # pooled, and per recipe
        assert prof.kernel("torch", name).prov.source == "measured"
        assert prof.kernel("torch", f"{name}.bf16").prov.source == "measured"
    # torch's act+quant runs its ops once per busy expert: all 16 of deepseek-v3-tiny's here
    assert prof.kernel("torch", "act_quant").calls == 16.0
    assert prof.kernel("torch", "permute").calls == 0.0  # one call for all the rows
    # the layer's own stages (calibrate_layer.py): the local backend, the router, shared MLP
    for table, name in (("local", "dispatch"), ("local", "combine"),
                        ("router", "sigmoid_grouped"), ("layer", "tail"), ("layer", "issue"),
                        ("layer", "norm"), ("layer", "residual")):
        fit = prof.kernel(table, name)
        assert fit.prov.source == "measured" and "MoELayer.forward" in fit.prov.note
    # the CPU's host issues nothing ahead: no queued figures (those are CUDA's)
    assert not any(k.endswith(".queued") for t in prof.kernels.values() for k in t)
    assert not any(c.queued for c in prof.mlp) and prof.as_queued() == prof
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


def test_parts_measure_only_what_they_name(tmp_path, capsys):
    """--parts comm: the collectives and backends measured, the layer's figures inherited
    from the base as they were; --parts layer: the other way round; a bad part exits 2."""
    from epmoe.plan.profile import load_profile

    out = tmp_path / "comm.json"
    assert main(["--quick", "--parts", "comm", "--ranks", "2", "--out", str(out),
                 "--device", "cpu"]) == 0
    said = capsys.readouterr().out
    assert "not measured: the layer (--parts comm)" in said
    assert "cpu records no host speed" in said  # so its layer stays as timed on its host
    prof, base = load_profile(str(out)), load_profile("cpu")
    assert prof.collective("all_reduce", "tcp").prov.source == "measured"
    assert prof.gemm and all(c.prov.source == "inherited" for c in prof.gemm)
    assert [c.key for c in prof.gemm] == [c.key for c in base.gemm]
    out = tmp_path / "layer.json"
    assert main(["--quick", "--parts", "layer", "--ranks", "2", "--out", str(out),
                 "--device", "cpu"]) == 0
    assert "not measured: comm (--parts layer)" in capsys.readouterr().out
    assert load_profile(str(out)).collective("all_reduce", "tcp").prov.source == "inherited"
    assert main(["--parts", "gemm", "--out", str(tmp_path / "x.json"), "--device", "cpu"]) == 2
    assert "--parts ('gemm') takes a comma-separated subset" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("recipes,msg", [("fp9", "each must be one of"),
                                         ("fp8_block", "hidden (2880) must be a multiple")])
def test_recipes_are_checked_before_anything_is_measured(tmp_path, capsys, recipes, msg):
    out = tmp_path / "p.json"
    assert main(["--out", str(out), "--device", "cpu", "--model", "gpt-oss-120b",
                 "--recipes", recipes]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and not out.exists()


def test_a_calibration_at_other_shapes_adds_curves_and_replaces_only_its_own():
    """merge_onto: calibrating gpt-oss's shapes over a DeepSeek-shaped profile keeps the
    DeepSeek curves (inherited) and adds the new ones; a curve at a shape the base has
    replaces it; an MLP curve likewise by (width, hidden) and side; kernel fits by name."""
    import dataclasses

    from epmoe.bench.calibrate import merge_onto
    from epmoe.plan.profile import AlphaBeta, GemmCurve, MlpCurve, Provenance

    old, new = Provenance("measured", "base run"), Provenance("measured", "this run")

    def curve(n, k, tf, prov, overlapped=False):
        return GemmCurve("triton", "bf16", "contiguous", n, k, ((8, tf), (512, 2 * tf)),
                         prov, overlapped)

    def mlp(width, hidden, us, prov, overlapped=False):
        return MlpCurve("triton", "bf16", width, hidden, overlapped, ((128, us),), prov)

    base = load_profile("h200")
    base = base.replace(
        gemm=(curve(4096, 7168, 100.0, old), curve(4096, 7168, 90.0, old, True),
              curve(7168, 2048, 80.0, old)),
        mlp=(mlp(2048, 7168, 50.0, old), mlp(2048, 7168, 60.0, old, True)),
        kernels={"triton": {"permute": AlphaBeta(1.0, 100.0, old),
                            "permute.overlapped": AlphaBeta(2.0, 90.0, old),
                            "gather": AlphaBeta(3.0, 80.0, old)},
                 "router": {"softmax": AlphaBeta(1.0, 1.0, old),
                            "softmax.queued": AlphaBeta(1.0, 1.0, old),
                            "sqrtsoftplus": AlphaBeta(1.0, 1.0, old),
                            "sqrtsoftplus.queued": AlphaBeta(1.0, 1.0, old)}})
    oss = (curve(5760, 2880, 300.0, new), curve(2880, 2880, 250.0, new),
           curve(7168, 2048, 111.0, new))  # the last at a shape the base has
    gemm, kern, comm, coll, mlps = merge_onto(
        base, oss, {"triton": {"permute": AlphaBeta(5.0, 200.0, new)},
                    "router": {"softmax": AlphaBeta(5.0, 200.0, new),
                               "sqrtsoftplus": AlphaBeta(5.0, 200.0, new),
                               "sqrtsoftplus.queued": AlphaBeta(2.0, 200.0, new)}},
        (mlp(2880, 2880, 40.0, new),))

    by_shape = {(c.n, c.k, c.overlapped): c for c in gemm}
    assert len(gemm) == 5 == len(by_shape)
    for key in ((5760, 2880, False), (2880, 2880, False), (7168, 2048, False)):
        assert by_shape[key].prov == new  # measured here, kept as measured
    assert by_shape[(7168, 2048, False)].points[0][1] == 111.0  # replaced, not duplicated
    for key, tf in (((4096, 7168, False), 100.0), ((4096, 7168, True), 90.0)):
        kept = by_shape[key]
        assert kept.points[0][1] == tf and kept.prov.source == "inherited"
        assert "h200" in kept.prov.note
    # the profile's lookups take the nearest shape: each model finds its own curves
    prof = dataclasses.replace(base, gemm=gemm, kernels=kern, mlp=mlps)
    assert prof.curve("triton", "bf16", "contiguous", 5760, 2880).prov == new
    assert prof.curve("triton", "bf16", "contiguous", 4096, 7168).points[0][1] == 100.0
    assert prof.mlp_curve("triton", "bf16", 2880, 2880, False).prov == new
    assert prof.mlp_curve("triton", "bf16", 2048, 7168, False).points[0][1] == 50.0
    assert prof.mlp_curve("triton", "bf16", 2048, 7168, True).points[0][1] == 60.0
    # kernel fits by name: permute measured alone replaces both of the base's permute fits
    assert kern["triton"]["permute"].prov == new and "permute.overlapped" not in kern["triton"]
    assert kern["triton"]["gather"].prov.source == "inherited"
    # a plain fit measured without its queued twin (device timing) drops the base's twin
    assert "softmax.queued" not in kern["router"] and kern["router"]["softmax"].prov == new
    assert kern["router"]["sqrtsoftplus.queued"].alpha_us == 2.0
    assert comm.keys() == base.comm.keys() and coll.keys() == base.collectives.keys()
    assert all(f.prov.source == "inherited" for t in coll.values() for f in t.values())


def test_a_model_with_hash_layers_is_timed_as_its_scoring_layers(tmp_path, capsys):
    """DeepSeek-V4's layer 0 routes by token id: the calibration's one-layer runs (which
    also time the layer's own router) run it as a top-k layer, so every stage is measured."""
    from tests.launch_util import config_folder
    from tests.test_deepseek_v4 import V4

    folder = config_folder(tmp_path, "tiny-v4", dict(
        V4, hidden_size=256, moe_intermediate_size=128, n_routed_experts=16,
        num_experts_per_tok=4, num_hidden_layers=2))
    out = tmp_path / "v4.json"
    assert main(["--quick", "--ranks", "1", "--out", str(out), "--name", "t", "--device",
                 "cpu", "--model", str(folder)]) == 0
    said = capsys.readouterr().out
    assert "routes by token id" not in said and "torch/bf16" not in said, said
    prof = load_profile(str(out))
    assert prof.kernels["router"]["sqrtsoftplus"].prov.source == "measured"


def test_a_fit_timed_beside_the_shared_mlp_takes_no_floor():
    """finish(): a fit's floor is its fastest time, except for ".overlapped" fits, whose points
    are only the sizes that ran entirely beside the shared MLP (often the largest alone): a
    1.65 ms floor from 21846 tokens once priced act_quant at 4096 tokens 2.2x over."""
    from epmoe.bench.calibrate import Clock
    from epmoe.bench.layer_points import LayerFits, finish

    fits = LayerFits()
    for nbytes, us in ((1e6, 40.0), (1e7, 35.0), (1e8, 90.0)):  # one wave at small sizes
        fits.add_point("triton", "act_quant", nbytes, us)
    fits.add_point("triton", "act_quant.overlapped", 2e8, 1650.0)
    fits.add_point("triton", "act_quant.overlapped", 4e8, 3300.0)
    out = finish(fits, Clock([], 1.0, "test"), fit_ab)["triton"]
    assert out["act_quant"].floor_us == 35.0
    assert out["act_quant"].time_us(1e5) == pytest.approx(35.0)
    beside = out["act_quant.overlapped"]
    assert beside.floor_us == 0.0 and beside.time_us(2e7) == pytest.approx(165.0, rel=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quick_gpu_calibration_times_a_later_layers_stages_queued(tmp_path):
    """Launched timing on CUDA: the host-bound stages, the routed kernels and the layer's
    tail again behind a device hold (".queued", what a stack's later layers see), the
    host's speed recorded beside the issue times;
    as_queued takes each queued fit for its plain and overlapped twin."""
    out = tmp_path / "g.json"
    assert main(["--quick", "--ranks", "1", "--out", str(out), "--model", "deepseek-v3-tiny",
                 "--recipes", "fp8_block", "--budget-s", "120"]) == 0
    prof = load_profile(str(out))
    assert prof.host_op_us > 0 and "the median of" in prof.device["host_op_us"].prov.note
    assert "layer" in prof.kernels and "issue.queued" not in prof.kernels["layer"]
    for table, name in (("router", "sigmoid_grouped"), ("local", "dispatch"),
                        ("triton", "permute"), ("triton", "gather"),
                        ("triton", "permute.fp8_block"), ("triton", "gather.fp8_block"),
                        ("comm", "quantize.triton"), ("comm", "quantize.triton.fp8_block"),
                        ("triton", "act_quant.fp8_block"), ("layer", "tail.triton")):
        fit = prof.kernel(table, name + ".queued")
        assert fit.prov.source == "measured" and fit.time_us(1e6) > 0, (table, name)
        assert prof.as_queued().kernel(table, name) == fit
    assert "permute.overlapped" not in prof.as_queued().kernels["triton"]


def test_parts_comm_puts_the_inherited_layer_at_this_hosts_speed(tmp_path):
    """The new profile records this host's speed, so what it inherits from a base that
    recorded its own host's is scaled to this one (a layer issue fit: host time)."""
    from dataclasses import replace

    from epmoe.plan.figures import AlphaBeta, Provenance
    from epmoe.plan.profile import HOST_OP, Figure, load_profile

    cpu = load_profile("cpu")
    p = Provenance("measured", "a test")
    issue = AlphaBeta(400.0, 1e9, p)
    base = replace(cpu, name="slow-host", device={**cpu.device, HOST_OP: Figure(50.0, p)},
                   kernels={**cpu.kernels, "layer": {"issue.torch": issue}})
    src, out = tmp_path / "base.json", tmp_path / "comm.json"
    base.save(str(src))
    assert main(["--quick", "--parts", "comm", "--ranks", "2", "--base", str(src), "--out",
                 str(out), "--device", "cpu"]) == 0
    prof = load_profile(str(out))
    here = prof.host_op_us
    assert here is not None and here != 50.0
    fit = prof.kernels["layer"]["issue.torch"]
    assert fit.alpha_us == pytest.approx(400.0 * here / 50.0)
    assert fit.prov.source == "inherited"


class _Layer:
    """A layer whose memory grows with the size it was built for: its forward runs out of
    device memory when that size is above `room`."""

    def __init__(self, built_tokens: int, room: int):
        self.built_tokens, self.room, self.calls = built_tokens, room, []

    def forward(self, x, routing):
        if self.built_tokens > self.room:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        self.calls.append(x.shape[0])


def _fake_build(build_room: int, forward_room: int, built: list):
    def build(model, quant, experts, tokens, dev):
        built.append(tokens)
        if tokens > build_room:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return object(), _Layer(tokens, forward_room), experts
    return build


def test_the_layer_is_built_for_the_largest_size_that_fits(monkeypatch):
    from epmoe.bench import calibrate_layer as cl
    from epmoe.bench.calibrate import Clock
    from epmoe.config import QuantConfig, get_preset

    cfg, built = get_preset("deepseek-v3-tiny"), []
    monkeypatch.setattr(cl, "_build", _fake_build(300, 200, built))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    clock = Clock([], 100.0, "test")
    rt, layer, name, ns = cl._build_fitting("deepseek-v3-tiny", cfg, QuantConfig("bf16"),
                                            "triton", [10, 100, 250, 400, 1000],
                                            torch.device("cpu"), clock)
    # 1000 and 400 do not build; 250 builds but its warm-up does not fit; 100 fits both
    assert built == [1000, 400, 250, 100]
    assert ns == [10, 100] and layer.built_tokens == 100 and layer.calls == [100]
    assert name == "triton"
    assert clock.skipped == [f"triton/bf16 tokens>={n}: out of device memory"
                             for n in (1000, 400, 250)]


def test_a_layer_whose_smallest_size_does_not_fit_is_not_measured(monkeypatch):
    from epmoe.bench import calibrate_layer as cl
    from epmoe.bench.calibrate import Clock
    from epmoe.config import QuantConfig, get_preset

    built = []
    monkeypatch.setattr(cl, "_build", _fake_build(5, 5, built))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        cl._build_fitting("deepseek-v3-tiny", get_preset("deepseek-v3-tiny"),
                          QuantConfig("bf16"), "torch", [10, 100], torch.device("cpu"),
                          Clock([], 100.0, "test"))
    assert built == [100, 10]


def test_the_local_dispatch_is_fitted_per_recipe_and_bf16_keeps_its_empty_quantize_stage():
    """bf16 runs no quantize kernel and the model predicts none, so its dispatch's whole
    time (the empty quantize stage's host time included) is the local backend's; a quantized
    recipe's local part is the dispatch less its quantize. The model reads the recipe's fit
    first, else the pooled one."""
    from epmoe.bench.layer_points import LayerFits, host_bound_points
    from epmoe.config import MoEConfig, QuantConfig
    from epmoe.plan import traffic as tr
    from epmoe.plan.cost import Candidate, Workload, predict_layer
    from epmoe.plan.figures import AlphaBeta, Provenance
    from epmoe.plan.synthetic import synthetic_profile
    from epmoe.plan.topology import Topology

    cfg = MoEConfig("t", hidden=256, moe_intermediate=128, num_experts=16, top_k=4)
    fits = LayerFits()
    st = {"dispatch": 80.0, "dispatch.quantize": 25.0, "forward": 1e3}
    host_bound_points(fits, st, 64, cfg, QuantConfig("bf16"), "triton", False)
    host_bound_points(fits, dict(st, dispatch=150.0, **{"dispatch.quantize": 100.0}), 64,
                      cfg, QuantConfig("fp8_block"), "triton", False)
    nb = tr.local_dispatch_bytes(64, cfg.top_k)
    assert fits.points[("local", "dispatch.bf16")] == [(nb, 80.0)]
    assert fits.points[("local", "dispatch.fp8_block")] == [(nb, 50.0)]
    assert fits.points[("local", "dispatch")] == [(nb, 80.0), (nb, 50.0)]
    # no quantize point at 0 bytes from bf16: only the fp8 forward's
    assert fits.points[("comm", "quantize")] == \
        [(tr.quantize_bytes(64, cfg.hidden, QuantConfig("fp8_block")), 100.0)]

    m = Provenance("measured", "test")
    prof = synthetic_profile()
    prof = prof.replace(kernels={**prof.kernels, "local": {
        "dispatch": AlphaBeta(30.0, 1e9, m), "dispatch.bf16": AlphaBeta(70.0, 1e9, m)}})
    topo = Topology.parse("1x1", gpu="h200")
    disp = {}
    for rec in ("bf16", "fp8_block"):
        q = QuantConfig(rec)
        p = predict_layer(Candidate("ep_dp", "local", "triton"), Workload(cfg, q, 64), topo,
                          prof).stages_us
        disp[rec] = p["dispatch"] - p["dispatch.quantize"]
    assert disp == pytest.approx({"bf16": 70.0, "fp8_block": 30.0})


def test_the_local_combine_is_fitted_per_experts_backend():
    """The local combine is the cast of the experts' output: one whose output is already
    bf16 has none, so the pooled fit (every backend's points) would charge it another's
    cast. The calibration fits it per experts backend too; the model reads that fit first,
    else the pooled one."""
    from epmoe.bench.layer_points import LayerFits, host_bound_points
    from epmoe.config import MoEConfig, QuantConfig
    from epmoe.plan import traffic as tr
    from epmoe.plan.cost import Candidate, Workload, predict_layer
    from epmoe.plan.figures import AlphaBeta, Provenance
    from epmoe.plan.synthetic import synthetic_profile
    from epmoe.plan.topology import Topology

    cfg = MoEConfig("t", hidden=256, moe_intermediate=128, num_experts=16, top_k=4)
    fits = LayerFits()
    for experts, us in (("triton", 1.0), ("torch", 20.0)):
        host_bound_points(fits, {"combine": us, "forward": 1e3}, 64, cfg, QuantConfig("bf16"),
                          experts, False)
    nb = tr.local_combine_bytes(64, cfg.hidden)
    assert fits.points[("local", "combine.triton")] == [(nb, 1.0)]
    assert fits.points[("local", "combine.torch")] == [(nb, 20.0)]
    assert fits.points[("local", "combine")] == [(nb, 1.0), (nb, 20.0)]

    m = Provenance("measured", "test")
    prof = synthetic_profile()
    prof = prof.replace(kernels={**prof.kernels, "local": {
        "combine": AlphaBeta(20.0, 1e9, m), "combine.triton": AlphaBeta(1.0, 1e9, m)}})
    topo = Topology.parse("1x1", gpu="h200")
    got = {ex: predict_layer(Candidate("ep_dp", "local", ex), Workload(cfg, QuantConfig("bf16"),
                                                                     64), topo, prof
                             ).stages_us["combine"] for ex in ("triton", "deepgemm")}
    assert got == pytest.approx({"triton": 1.0, "deepgemm": 20.0})
