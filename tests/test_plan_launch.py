"""`python -m epmoe.launch --plan ...`: the planner in a launch, predicted vs measured in the
report, plan files (validated before any worker), the sweep. In-process runs at one rank;
Ray runs (ep 2 and 4) share one local cluster."""

from __future__ import annotations

import json
import re

import pytest

from epmoe.config import QuantConfig
from epmoe.launch.cli import main
from epmoe.launch.device_profile import profile_for_device
from epmoe.plan import Choice, LayerEntry, Plan, Topology
from epmoe.plan.cost import STAGES
from test_launch import cluster, joined  # noqa: F401  (one token-auth Ray cluster per module)

TINY = ["--model", "deepseek-v3-tiny"]


def run_cli(tmp_path, *flags: str, name="summary.json") -> tuple[int, dict]:
    out = tmp_path / name
    cpu = [] if "--device" in flags else ["--device", "cpu"]  # CPU tests, GPU machine or not
    rc = main([*flags, *cpu, "--quiet", "--out", str(out)])
    return rc, json.loads(out.read_text()) if out.exists() else {}


def assert_predictions(s: dict, plan_numbers: bool = True) -> None:
    """The report's predicted column: consistent with the measured one and the plan."""
    t = s["timing"]
    pred, meas, ratio = t["predicted_ms"], t["stages_ms"], t["ratio"]
    assert pred is not None, t["prediction"]
    assert set(pred) <= set(STAGES) and pred["experts"] > 0
    assert set(meas) <= set(ratio)
    for k, r in ratio.items():
        if k in meas and meas[k] > 0:
            assert r == pytest.approx(pred.get(k, 0.0) / meas[k]), k
    assert t["noise_floor_ms"] == 0.05
    assert sorted(t["below_noise_floor"]) == sorted(
        k for k in ratio if meas.get(k, 0.0) < 0.05)
    assert t["step_ratio"] == pytest.approx(t["predicted_step_ms"] / t["step_ms_median"])
    # the prediction of what ran: as many layers as the run, named like the report's forms
    labels = t["prediction"]["layers"]
    assert [x.split("/")[0] for x in labels] == [w["form"] for w in s["world"]["layers"]]
    assert [x.split("/")[1] for x in labels] == [w["backend"] for w in s["world"]["layers"]]
    if "plan" in s:
        p = s["plan"]
        assert [x["choice"] for x in p["layers"]] == labels
    if "plan" in s and plan_numbers:  # the plan's own numbers: same model, same candidates;
        # the router's routing is planned at the gates' loads on a sample of rows and
        # predicted afterwards by the run's recorded load: they agree as far as the samples do
        same = "measured load" not in t["prediction"].get("routing", "")
        assert t["predicted_step_ms"] == pytest.approx(
            sum(x["predicted_ms"] for x in p["layers"]), rel=1e-6 if same else 0.1)


# ---------------------------------------------------------------------------------- one rank


@pytest.mark.timeout(120)
def test_every_launch_reports_predicted_vs_measured(tmp_path, capsys):
    rc, s = run_cli(tmp_path, *TINY, "--tokens", "8", "--steps", "2", "--layers", "1")
    assert rc == 0 and s["correctness"]["passed"] is True
    assert "plan" not in s  # no --plan: the flags decided, the model still predicts
    assert_predictions(s)
    t = s["timing"]
    for name, per_layer in t["predicted_ms_per_layer"].items():  # one layer: the same
        assert per_layer == pytest.approx([t["predicted_ms"][name]])
    for name, per_layer in t["stages_ms_per_layer"].items():  # one step timed: its calls
        assert per_layer == pytest.approx([t["stages_ms"][name]])
    assert t["prediction"]["profile"] == "cpu"
    assert s["timing"]["prediction"]["topology"].startswith("1x1 cpu")
    out = capsys.readouterr().out
    assert "pred/meas" in out and "predicted" in out
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.timeout(120)
def test_plan_auto_one_rank_explains(tmp_path, capsys):
    rc, s = run_cli(tmp_path, *TINY, "--plan", "auto", "--tokens", "8", "--steps", "2",
                    "--layers", "2")
    assert rc == 0 and s["correctness"]["passed"] is True
    # the router's routing: planned at the synthetic gates' loads (a sample of rows; the
    # note says so), predicted afterwards by the run's recorded load
    assert s["timing"]["prediction"]["routing"] == "router by its measured load"
    assert any(n.startswith("routing: planned at the synthetic gates' expert loads")
               for n in s["timing"]["prediction"]["notes"])
    p = s["plan"]
    assert (p["mode"], p["tokens_per_rank"], p["bucket"]) == ("auto", 8, 8)
    assert [x["choice"] for x in p["layers"]] == ["ep_dp/local/torch"] * 2
    assert all(x["why"].startswith("the only feasible candidate") for x in p["layers"])
    assert Plan.from_dict(p["plan"]).stack(8)[0].form == "ep_dp"  # usable as --plan FILE
    assert_predictions(s)
    assert "the only feasible candidate" in capsys.readouterr().out


def test_profile_by_device():
    assert profile_for_device("cpu") == ("cpu", None)
    assert profile_for_device("cuda (NVIDIA H200, visible 0)") == ("h200", None)
    assert profile_for_device("NVIDIA GB200") == ("gb200", None)
    assert profile_for_device("NVIDIA B200") == ("b200", None)
    assert profile_for_device("NVIDIA H20") == ("h20", None)  # a word: H200 is not an H20
    assert profile_for_device("NVIDIA H20-3e")[0] == "h20"
    name, warn = profile_for_device("NVIDIA RTX 6000 Ada Generation", 89)
    assert name == "h100" and "nearest spec profile 'h100'" in warn and "--profile" in warn
    assert profile_for_device("NVIDIA Future GPU", 120)[0] == "b200"


# ---------------------------------------------------------------------------------- bad input


def _plan_file(path, stack, world: int, model="deepseek-v3-tiny", recipe="bf16",
               num_slots=16, tokens=8):
    layers = tuple(LayerEntry(l, ((tokens, Choice(f, b, e, 1.0, {}, "hand-written")),))
                   for l, (f, b, e) in enumerate(stack))
    plan = Plan(model, QuantConfig(recipe), Topology.parse(f"1x{world}", "cpu").to_dict(),
                "cpu", num_slots, (tokens,), layers)
    plan.save(path)
    return str(path)


MIXED = (("ep_dp", "all2all", "torch"), ("tp", "local", "torch"), ("ep", "local", "torch"),
         ("ep_dp", "allgather", "torch"))


@pytest.mark.parametrize("case,flags,match", [
    ("not json", [], r"is not JSON"),
    ("schema", [], r"plan schema 7 is not 1; write the plan again"),
    ("form", [], r"layer 1, bucket 8: form \('dp'\) must be one of"),
    ("ranks", [], r"layer 0, bucket 8: ep_dp/all2all/torch cannot run here: experts \(16\) "
                  r"must be divisible by ep \(3\)"),
    ("cuda", ["--device", "cpu"], r"ep_dp/deepep-ll/torch cannot run here: deepep-ll needs "
                                  r"CUDA GPUs"),
    ("model", ["--model", "mixtral-tiny"], r"--model mixtral-tiny disagrees with the plan "
                                            r"file .* \(deepseek-v3-tiny\): drop --model"),
    ("world", ["--ep", "4"], r"--ep 4 disagrees with the plan file .* \(2\)"),
    ("layers", ["--layers", "2"], r"--layers 2 disagrees with the plan file .* \(4\)"),
    ("slots", ["--eplb", "--redundant-experts", "2"],
     r"has 16 expert slots but the run has 18"),
    ("no-dp", ["--no-dp"], r"--plan .* decides the forms: drop --no-dp"),
    ("missing", [], r"does not exist; write one with python -m epmoe.plan"),
    ("bucket", [], r"plan file .*: layer 0's buckets \[-1\] must be tokens >= 1, ascending"),
    ("tokens", [], r"plan file .*: malformed: missing or bad invalid literal for int\(\)"),
    ("few slots", [], r"has 7 expert slots but the run has 16 .*: fewer than the model's 16 "
                      r"experts: plan again"),
    ("gather", ["--comm-option", "ht_gather=1", "--experts", "triton"],
     r"layer 0, bucket 8: ep_dp/symm-ht/deepgemm: --comm-option ht_gather leaves the rows for "
     r"an expert GEMM .* only the triton experts do"),
])
def test_bad_plan_file_exits_2_before_any_worker(tmp_path, capsys, case, flags, match):
    path = tmp_path / "plan.json"
    world, stack = 2, MIXED
    if case == "ranks":
        world, stack = 3, (("ep_dp", "all2all", "torch"),) * 4
    if case == "cuda":
        stack = (("ep_dp", "deepep-ll", "torch"),) * 4
    if case == "gather":  # before the machine's rules (symm-* need CUDA)
        stack = (("ep_dp", "symm-ht", "deepgemm"), ("ep_dp", "symm-ll", "deepgemm")) * 2
    _plan_file(path, stack, world)
    d = json.loads(path.read_text())
    if case == "form":
        d["layers"][1]["choices"][0]["form"] = "dp"
    if case == "schema":
        d["schema"] = 7
    if case in ("bucket", "tokens"):
        d["layers"][0]["choices"][0]["tokens"] = -1 if case == "bucket" else "x"
    if case == "few slots":
        d["num_slots"] = 7
    path.write_text(json.dumps(d) if case != "not json" else "{oops")
    if case == "missing":
        path = tmp_path / "absent.json"
    rc = main([*flags, "--plan", str(path), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert re.search(match, err), err


@pytest.mark.parametrize("flags,match", [
    (["--plan", "auto", "--tp", "2"], r"--tp 2 asks every layer to run tp, but --plan auto "
                                      r"decides the forms: give the rank count with --ep 2"),
    (["--plan", "ep_dp", "--ep", "2", "--no-dp"], r"drop --no-dp \(or use --plan ep\)"),
    (["--plan", "auto", "--ep", "2", "--topology", "1x4"],
     r"--topology 1x4 holds 4 ranks but the run has 2"),
    (["--plan", "tp", "--ep", "3"], r"no candidate is feasible .*divisible by tp"),
    (["--plan", "auto", "--profile", "nope"], r"profile 'nope' is neither a shipped profile"),
    (["--plan", "sweep", "--tp", "2"], r"--plan sweep tries every form itself"),
])
def test_plan_flag_conflicts_exit_2(capsys, flags, match):
    rc = main([*TINY, "--layers", "1", *flags, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.search(match, err), err


# ---------------------------------------------------------------------------------- Ray


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_plan_auto_ep2_explains_each_layer(joined, tmp_path, capsys):
    rc, s = run_cli(tmp_path, *TINY, "--plan", "auto", "--ep", "2", "--tokens", "8",
                    "--steps", "2", "--layers", "2", "--address", joined[0].address)
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]
    p = s["plan"]
    assert p["topology"].startswith("1x2 cpu") and len(p["layers"]) == 2
    for x in p["layers"]:  # "beats <runner-up> <ms> by N%: ..." or "a tie"
        assert x["runner_up"] and x["runner_up"] != x["choice"], x
        assert x["why"].startswith(f"beats {x['runner_up']} {x['runner_up_ms']:.3f} ms"), x
    assert_predictions(s)
    out = capsys.readouterr().out
    assert "plan: --plan auto, 8 tokens/rank -> bucket 8" in out
    assert p["layers"][0]["why"][:60] in out
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_ray_mixed_plan_file_passes_the_oracle(joined, tmp_path, world):
    path = _plan_file(tmp_path / "mixed.json", MIXED, world)
    rc, s = run_cli(tmp_path, "--plan", path, "--tokens", "8", "--steps", "1",
                    "--address", joined[0].address)
    c = s["correctness"]
    assert rc == 0 and c["passed"] is True, c
    assert len(c["per_layer"]) == 4 and max(c["per_layer"]) <= c["tolerance"]
    assert c["tokens_checked"] == 8 * world  # every rank's rows at every layer
    w = s["world"]
    assert w["form"] == "mixed" and len(w["ranks"]) == world
    assert [(x["form"], x["backend"]) for x in w["layers"]] == [(f, b) for f, b, _ in MIXED]
    assert s["plan"]["mode"] == "file" and s["plan"]["layers"][1]["why"] == "hand-written"
    assert "relayout" in s["timing"]["stages_ms"] and s["timing"]["predicted_ms"]["relayout"] > 0
    assert_predictions(s, plan_numbers=False)  # a hand-written file has no predictions


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_sweep_ep2(joined, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rc = main([*TINY, "--plan", "sweep", "--ep", "2", "--tokens", "8", "--steps", "2",
               "--layers", "1", "--no-check", "--out", str(out), "--sweep-budget-s", "300",
               "--address", joined[0].address, "--device", "cpu"])
    text = capsys.readouterr().out
    assert rc == 0, text
    s = json.loads(out.read_text())["sweep"]
    labels = [r["candidate"] for r in s["rows"]]
    assert sorted(labels) == sorted(["tp/local/torch", "ep/local/torch",
                                     "ep_dp/all2all/torch", "ep_dp/allgather/torch"])
    ok = [r for r in s["rows"] if r["status"] == "ok"]
    assert len(ok) == 4
    for r in ok:
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0
        assert r["ratio"] == pytest.approx(r["predicted_ms"] / r["measured_ms"])
        assert r["host_factor"] is None  # the shipped cpu profile records no host speed
    best = min(ok, key=lambda r: r["measured_ms"])
    assert (s["fastest"], s["fastest_ms"]) == (best["candidate"], best["measured_ms"])
    au = s["auto"]
    assert au["vs_best"] == pytest.approx(au["measured_ms"] / best["measured_ms"] - 1)
    assert au["within_5pct"] == (au["vs_best"] <= 0.05)
    if not au["launched"]:
        assert au["label"] in labels
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert any(line.startswith("planner (auto): ") for line in lines)
    # the plan's prediction is at the routing the planner reads (the synthetic gates' loads
    # on a sample of rows), a row's at its run's: both named, so two predictions of one stack
    # are not a puzzle
    assert au["planned_routing"] == "sampled-gate"
    assert "  (planned at sampled-gate routing and the profile's host; a row: its run's)" \
        in lines


def test_compare_ratio_and_noise_floor():
    from epmoe.launch.plan_report import _chosen, compare

    measured = {"router": 0.2, "dispatch": 0.04, "experts": 2.0, "relayout": 0.0}
    predicted = {"router": 0.1, "dispatch": 0.05, "experts": 3.0, "combine": 0.5,
                 "all_reduce": 0.0}
    ratio, low = compare(measured, predicted)
    assert ratio == {"router": 0.5, "dispatch": pytest.approx(1.25), "experts": 1.5,
                     "relayout": None, "combine": None}  # predicted-only zeros are left out
    assert low == ["dispatch", "relayout", "combine"]
    assert compare(measured, None) == ({k: None for k in measured},
                                       ["dispatch", "relayout"])
    assert _chosen("deepgemm: not installed (ImportError: x); triton: chosen") == "triton"
    with pytest.raises(ValueError, match="cannot tell the experts backend"):
        _chosen("torch: requested")


def test_run_config_and_layer_plans_live_in_epmoe_plan():
    from pathlib import Path

    import epmoe
    import epmoe.plan as plan
    from epmoe.plan.forms import FORMS, LayerPlan, LayerSpec
    from epmoe.plan.run import RunConfig

    assert (plan.FORMS, plan.LayerPlan, plan.LayerSpec, plan.RunConfig) == \
        (FORMS, LayerPlan, LayerSpec, RunConfig)
    assert not (Path(epmoe.__file__).parent / "parallel.py").exists()  # moved, not aliased
    run = RunConfig(world=2, layers=2, stack=(LayerSpec("ep_dp", "all2all", "torch"),
                                              LayerSpec("tp", "local", "torch")))
    run.validate()
    assert run.layer_plan(1, 1, "local") == LayerPlan("tp", 1, 2, "local", "torch", 16)


def test_a_stacks_later_layers_are_predicted_as_queued_behind_the_ones_before():
    """Backlog: the step's first layer starts on an idle GPU; a later layer starts behind
    the layers before while their predicted time outruns the host's issue time (then its
    host-bound stages come from the queued figures); --timing device queues every layer."""
    from epmoe.plan.backlog import Backlog
    from epmoe.plan.comm_cost import COMBINE_OPS, DISPATCH_OPS
    from epmoe.plan.profile import AlphaBeta, Provenance, load_profile

    m = Provenance("measured", "test")
    base = load_profile("h200")
    prof = base.replace(kernels={**base.kernels,
                                 "router": {"softmax": AlphaBeta(200.0, 1e9, m),
                                            "softmax.queued": AlphaBeta(40.0, 1e9, m)},
                                 "layer": {"issue": AlphaBeta(1000.0, 1e9, m),
                                           "issue.torch": AlphaBeta(5000.0, 1e9, m)}})

    def layers(b, times, experts="triton"):
        out = []
        for l, us in enumerate(times):
            out.append(b.profile(l).kernel("router", "softmax").alpha_us)
            b.ran(us, experts)
        return out

    b = Backlog(prof, False, 1e6)
    assert layers(b, [3000.0, 3000.0, 3000.0]) == [200.0, 40.0, 40.0]
    assert b.note().startswith("layers 1-2 predicted as queued") and "1.000 ms" in b.note()
    b = Backlog(prof, False, 1e6)  # the host slower than the GPU: nothing queues
    assert layers(b, [500.0, 500.0, 500.0]) == [200.0] * 3 and b.note() is None
    b = Backlog(prof, False, 1e6)  # a backlog drains: 1500 - 1000, then 500 + 200 - 1000 < 0
    assert layers(b, [1500.0, 200.0, 200.0]) == [200.0, 40.0, 200.0]
    assert "layers 1 predicted" in b.note()
    b = Backlog(prof, False, 1e6)  # the torch backend's own (host-synced) issue time
    assert layers(b, [3000.0, 3000.0], "torch") == [200.0, 200.0] and b.note() is None
    assert layers(Backlog(prof, True, 1e6), [1.0, 1.0]) == [40.0, 40.0]
    assert Backlog(base, True, 1e6).note() is None  # no queued figures: nothing to say
    # the same stack on a host twice as slow (at_host_speed): it issues a layer in 2 ms,
    # after the GPU ran 1.5: nothing queues, and the idle-GPU router fit's 160 us beyond its
    # GPU time (the queued twin's 40) take 2x as long
    assert layers(Backlog(prof, False, 1e6), [1500.0] * 3) == [200.0, 40.0, 40.0]
    assert layers(Backlog(prof.at_host_speed(2.0), False, 1e6), [1500.0] * 3) == [360.0] * 3
    # a comm backend whose calls take the host longer than the local backend's (the layer's
    # issue fit is timed at one rank): a symm-ht layer issues in 1000 + 900 - local's ops
    fits = {**prof.kernels["comm"], "host.symm-ht.dispatch": AlphaBeta(700.0, 1e9, m),
            "host.symm-ht.combine": AlphaBeta(200.0, 1e9, m)}
    symm = prof.replace(kernels={**prof.kernels, "comm": fits})
    local_ops = symm.fig("launch_us") * (DISPATCH_OPS["local"] + COMBINE_OPS["local"])
    b = Backlog(symm, False, 1e6)
    b.ran(1500.0, "triton", "symm-ht")
    b.ran(1500.0, "triton", "local")
    assert b.issued == pytest.approx([1900.0 - local_ops, 1000.0])
    assert b.us == pytest.approx(max(0.0, 1500.0 - b.issued[0]) + 500.0)


@pytest.mark.timeout(120)
def test_a_launch_scales_the_profile_to_its_hosts_speed(tmp_path, capsys):
    """The run measures its host's time per tiny op; a profile that recorded its own host's
    is scaled by the ratio (its host time: here the router timed on an idle GPU beyond its
    queued twin's GPU time), the report says so and keeps what the profile's own host would
    have taken."""
    from epmoe.plan.profile import HOST_OP, AlphaBeta, Figure, Provenance, load_profile

    cpu, m = load_profile("cpu"), Provenance("measured", "test")
    kern = {**cpu.kernels, "router": {"sigmoid_grouped": AlphaBeta(5000.0, 1e9, m),
                                      "sigmoid_grouped.queued": AlphaBeta(1.0, 1e9, m)},
            "layer": {"issue": AlphaBeta(3000.0, 1e9, m)}}
    path = tmp_path / "p.json"
    cpu.replace(kernels=kern, device={**cpu.device, HOST_OP: Figure(1e4, m)}).save(path)
    rc, s = run_cli(tmp_path, *TINY, "--tokens", "8", "--steps", "2", "--layers", "1",
                    "--profile", str(path))
    assert rc == 0
    t = s["timing"]
    host = t["prediction"]["host"]
    assert 0 < t["host_op_us"] == host["run_op_us"] and host["profile_op_us"] == 1e4
    assert host["factor"] == pytest.approx(t["host_op_us"] / 1e4)
    router = 0.001 + 4.999 * host["factor"]  # the twin's 1 us, then the host's 4999 us
    assert t["predicted_ms"]["router"] == pytest.approx(router, rel=1e-6)
    assert host["at_profile_host_step_ms"] - t["predicted_step_ms"] == pytest.approx(
        5.0 - router, rel=1e-6)
    assert host["at_profile_host_ms"]["router"] == pytest.approx(5.0)
    assert host["at_profile_host_ms"]["experts"] == t["predicted_ms"]["experts"]
    assert f"x{host['factor']:.2f}" in capsys.readouterr().out
    # the host's issue time of a step, predicted at this host's speed, next to the measured
    assert t["predicted_issue_ms"] == pytest.approx(3.0 * host["factor"])
    assert t["issue_ratio"] == pytest.approx(t["predicted_issue_ms"] / t["host_issue_ms_median"])
    rc, s = run_cli(tmp_path, *TINY, "--tokens", "8", "--steps", "2", "--layers", "1")
    assert s["timing"]["prediction"]["host"] is None  # the shipped cpu profile: no host
