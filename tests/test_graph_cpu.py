"""--cuda-graph without a GPU: which paths may be captured, the stage timer's bookkeeping for
replayed graphs (with stand-in events), and the benchmark's input errors. The capture itself
is tested on the GPU (test_graph_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from epmoe.bench.graph_step import main as bench_main
from epmoe.graph import capture_violation
from epmoe.plan.run import RunConfig
from epmoe.timing import StageTimer


@pytest.mark.parametrize("form,backend,experts,ok", [
    ("ep_dp", "local", "triton", True), ("ep_dp", "symm-ll", "deepgemm", True),
    ("ep_dp", "symm-ht", "auto", True), ("ep_dp", "auto", "auto", True),
    ("ep_dp", "deepep-ht", "triton", False), ("ep_dp", "all2all", "triton", False),
    ("ep_dp", "local", "torch", False), ("tp", "local", "triton", False),
    ("ep", "auto", "auto", False)])
def test_which_layers_can_be_captured(form, backend, experts, ok):
    assert (capture_violation(form, backend, experts) is None) == ok


def test_run_config_refuses_what_cannot_be_captured():
    RunConfig(world=2, eplb=True, cuda_graph=True).validate()  # captured again per switch
    with pytest.raises(ValueError, match="layer 0: form tp runs collectives"):
        RunConfig(form="tp", world=2, cuda_graph=True).validate()
    RunConfig(world=2, backend="symm-ll", experts="triton", cuda_graph=True).validate()
    with pytest.raises(ValueError, match="with --steps 1 no step would be replayed"):
        RunConfig(world=2, steps=1, cuda_graph=True).validate()


class _Event:
    """Stands in for torch.cuda.Event: each record stamps the next tick of a shared clock."""

    clock = [0.0]
    made = []

    def __init__(self, enable_timing=False, external=False):
        assert enable_timing and external, "stages in a capture need external timing events"
        self.t = None
        _Event.made.append(self)

    def record(self):
        _Event.clock[0] += 1.0
        self.t = _Event.clock[0]

    def elapsed_time(self, other):
        return other.t - self.t


def test_stages_captured_once_are_timed_at_every_replay(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    timer = StageTimer(device="cpu")
    with timer.capturing():
        with timer.stage("dispatch"):
            pass
        with timer.stage("experts"):
            with timer.stage("experts.gemm1"):
                pass
    assert timer.collect() == {} and len(_Event.made) == 6  # nothing ran while capturing
    for replay in range(3):  # a replay re-records the same events: read after each one
        for ev in _Event.made:
            ev.t = 10.0 * replay + {0: 0, 1: 1, 2: 2, 3: 5, 4: 3, 5: 4}[_Event.made.index(ev)]
        timer.replayed()
    got = timer.collect()
    assert got == {"dispatch": [1.0] * 3, "experts": [3.0] * 3, "experts.gemm1": [1.0] * 3}


@pytest.mark.parametrize("argv,msg", [(["--recipes", "fp9"], "--recipes: 'fp9' is not one of"),
                                      (["--tokens", "1,x"], "--tokens: 'x' is not a whole"),
                                      (["--steps", "2"], "--steps: 2 must be >= 3")])
def test_bench_input_errors_exit_2(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:  # argparse's refusal, before anything runs
        bench_main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_bench_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert bench_main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_plan_accuracy_with_graphs_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from epmoe.bench.plan_accuracy import main as accuracy_main

    assert accuracy_main(["--cuda-graph"]) == 2
    assert "--cuda-graph needs a CUDA GPU" in capsys.readouterr().err


def test_the_planner_keeps_to_what_a_graph_captures():
    from epmoe.launch.planning import _capturable

    assert _capturable("auto", None, None, None) == (
        ("ep_dp",), ("local", "symm-ht", "symm-ll"), ("triton", "deepgemm"))
    # the flags' and the machine's restrictions stay: only their capturable part is kept
    assert _capturable("auto", ("ep", "ep_dp"), ("symm-ll", "local"), ("torch", "triton")) == (
        ("ep_dp",), ("symm-ll", "local"), ("triton",))
    assert _capturable("ep_dp", ("ep_dp",), ("deepep-ll", "local"), None)[1] == ("local",)
    for mode in ("tp", "ep"):
        with pytest.raises(ValueError, match=f"--plan {mode} with --cuda-graph: a captured "
                                             f"step runs ep_dp layers only"):
            _capturable(mode, (mode,), None, None)


def test_the_load_recorder_counts_into_one_live_buffer():
    """A captured step writes where the capture saw the counts: the recorder's buffer for the
    step under way must be the same tensor every step, the window keeping copies."""
    from epmoe.eplb.recorder import LoadRecorder

    rec = LoadRecorder(num_layers=1, num_slots=4, window=2)
    live = rec._cur
    for step, ids in enumerate(([0, 1], [1, 1], [3, 2])):
        rec.begin_step()
        assert rec._cur is live
        rec.record(0, torch.tensor(ids))
        assert rec.num_steps == min(step + 1, 2)
    # the window: the last two steps (the finished one as a copy, the live one)
    assert rec.window_load(reduce=False).tolist() == [[0, 2, 1, 1]]


def test_plan_accuracy_judges_the_host_issue_time_apart_from_the_stages():
    """A launch that measured and predicted its host's issue time gets a "host issue" row;
    one that did not (device-less, or a profile without an issue fit) gets none."""
    from epmoe.bench.plan_accuracy import HOST_ISSUE, stage_rows

    row = dict(candidate="ep/local/triton", status="ok", stages_ms={"router": 0.2},
               predicted_stages_ms={"router": 0.3}, ratio=1.1, measured_ms=2.0,
               predicted_ms=2.2, host_issue_ms=4.0, predicted_issue_ms=4.6)
    rows = stage_rows(dict(rows=[row, dict(row, candidate="b", predicted_issue_ms=None)]))
    issue = [r for r in rows if r["stage"] == HOST_ISSUE]
    assert [(r["candidate"], r["within_20"]) for r in issue] == [("ep/local/triton", True)]
    assert issue[0]["error"] == pytest.approx(0.15)
    assert [r["within_20"] for r in rows if r["stage"] == "router"] == [False, False]


def test_plan_accuracy_names_the_host_speed_its_predictions_were_scaled_to():
    from epmoe.bench.plan_accuracy import render_group, stage_rows

    row = dict(candidate="ep_dp/local/triton", status="ok", error=None, stages_ms={"router": 0.2},
               predicted_stages_ms={"router": 0.21}, ratio=1.0, measured_ms=2.0,
               predicted_ms=2.0, passed=None, host_factor=0.6561)
    s = dict(model="m", recipe="fp8_block", ranks=1, topology="1x1", tokens_per_rank=128,
             layers=1, steps=12, profile="p", seconds=1.0, rows=[row], fastest=row["candidate"],
             fastest_ms=2.0, auto=dict(label=row["candidate"], stack=[row["candidate"]],
                                       predicted_ms=2.1, measured_ms=2.0, vs_best=0.0,
                                       within_5pct=True, planned_routing="uniform"))
    text = render_group(s, stage_rows(s))
    assert "host time at this host's speed: x0.66 the profile's" in text.splitlines()
    assert max(len(line) for line in text.splitlines()) <= 80
    text = render_group(dict(s, rows=[dict(row, host_factor=None)]), stage_rows(s))
    assert "host time at" not in text  # a profile without a host speed: nothing scaled


def test_plan_accuracy_at_ep2_needs_two_gpus_and_sweeps_at_ep2(capsys):
    from epmoe.bench.plan_accuracy import groups, main as accuracy_main

    if torch.cuda.device_count() < 2:
        assert accuracy_main(["--ep", "2", "--calibrate"]) == 2  # before any calibration
        assert "--ep 2 needs 2 CUDA GPUs" in capsys.readouterr().err
    g = groups(True, True, 1, 4, ep=2)
    assert [f[f.index("--ep") + 1] for f in (x["flags"] for x in g)] == ["2", "2"]
    assert groups(True, True, 1, 4)[0]["flags"][-1] == "1"
