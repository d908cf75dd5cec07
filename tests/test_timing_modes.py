"""`--timing launched|device`: validated before anything starts, recorded in every report
(a CPU run is always launched-timed: device timing holds a GPU), the host's issue time per step
summarized as the median over steps 1.. (of the slowest rank per step), and shown in the run table only
for device-timed runs. On a GPU: the device hold keeps the stream busy for about as long as
asked, so events behind it time GPU work only."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch

from epmoe.launch.cli import main
from epmoe.plan.run import RunConfig


def test_timing_must_be_launched_or_device():
    RunConfig(timing="device").validate()
    with pytest.raises(ValueError, match=r"timing \('wall'\) must be 'launched' or 'device'"):
        RunConfig(timing="wall").validate()


def test_bad_timing_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--timing", "wall"])
    assert exc.value.code == 2
    assert "--timing" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("t") / "s.json"
    assert main(["--timing", "device", "--steps", "3", "--tokens", "4", "--layers", "1",
                 "--device", "cpu", "--quiet", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_cpu_run_reports_launched_timing_and_its_host_issue_time(cpu_run):
    t = cpu_run["timing"]
    assert t["mode"] == "launched"  # no GPU to hold: the step is the host's wall time
    assert t["host_issue_ms_median"] > 0
    assert t["host_issue_ms_median"] <= max(t["step_ms"][1:]) * 1.001
    assert t["host_op_us"] > 0  # the host's speed, probed after the steps


def test_a_run_whose_host_probe_fails_reports_no_host_speed(tmp_path, monkeypatch):
    """The host-speed probe runs after the steps; on a device that failed it must not hide
    what ran: the report goes on without a host speed (and the prediction unscaled)."""
    import epmoe.runtime

    def broken(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(epmoe.runtime, "host_op_us", broken)
    out = tmp_path / "s.json"
    assert main(["--steps", "2", "--tokens", "4", "--layers", "1", "--device", "cpu",
                 "--quiet", "--out", str(out)]) == 0
    t = json.loads(out.read_text())["timing"]
    assert t["host_op_us"] is None and t["prediction"]["host"] is None


def test_the_host_is_probed_after_step_0_mid_run_and_at_the_report(monkeypatch):
    """Hosts drift within a run: the runtime probes after step 0, after the middle step and
    at its report (once), and reports the median."""
    import epmoe.runtime
    from epmoe.runtime import Runtime

    speeds = iter([5.0, 9.0, 6.0, 100.0])
    monkeypatch.setattr(epmoe.runtime, "host_op_us", lambda device: next(speeds))
    rt = Runtime(RunConfig(model="deepseek-v3-tiny", tokens=4, layers=1, steps=5))
    for step in range(5):
        rt.step(step)
    assert rt.host_probes == [5.0, 9.0]  # steps 0 and 2
    assert rt.report()["host_op_us"] == 6.0 and rt.report()["host_op_us"] == 6.0


def _rendered(s: dict) -> str:
    from rich.console import Console

    from epmoe.launch.render import render

    c = Console(width=80, file=io.StringIO(), record=True)
    render(s, c)
    return c.export_text()


def test_the_run_table_names_host_issue_time_only_when_device_timed(cpu_run):
    assert "host issue" not in _rendered(cpu_run)
    s = copy.deepcopy(cpu_run)
    s["timing"].update(mode="device", host_issue_ms_median=2.345)
    text = _rendered(s)
    assert "2.35 ms to issue a step" in text and "GPU time" in text
    assert all(len(line) <= 80 for line in text.splitlines())


def test_summary_skips_the_warm_up_step():
    from epmoe.launch.report import summarize
    from epmoe.runtime import Runtime

    run = RunConfig(world=1, tokens=4, layers=1, steps=4, check=False)
    rt = Runtime(run, device="cpu")
    for s in range(run.steps):
        rt.step(s)
    rep = rt.report()
    assert rep["timing"] == "launched" and len(rep["host_ms"]) == 4 and rep["held_ms"] == []
    rep["host_ms"] = [100.0, 1.0, 5.0, 3.0]  # step 0 (compiles) is the slowest
    where = [dict(node_id="n0", rank=0, host="h", device="cpu")]
    s = summarize(run, [rep], where)
    assert s["timing"]["host_issue_ms_median"] == 3.0  # steps 1..: 1, 5, 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_hold_keeps_the_stream_busy_for_about_the_time_asked():
    from epmoe.timing import DeviceSleep

    hold = DeviceSleep("cuda")
    hold.hold(1.0)  # measures its rate
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    hold.hold(5.0)
    b.record()
    b.synchronize()
    assert 3.0 <= a.elapsed_time(b) <= 8.0, a.elapsed_time(b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_host_speed_probe_times_the_host_not_the_device(device):
    """host_op_us: the host's us per tiny eager op (on CUDA issued behind a device hold, the
    queue drained when it returns); the launch report's host factor divides two of them."""
    from epmoe.timing import host_op_us

    us = host_op_us(device, n_ops=50, reps=3)
    assert 0.0 < us < 1e4
    if device == "cuda":  # the probe synchronized at its end: nothing left queued
        assert torch.cuda.current_stream().query()


def test_stages_skip_the_warm_up_step_too():
    """Step 0 compiles and makes the first arena calls: its stage times would pull the medians
    of a short run (two steps: the median of two calls is their mean) far up."""
    from epmoe.launch.report import summarize
    from epmoe.runtime import Runtime

    run = RunConfig(world=1, tokens=4, layers=2, steps=3, check=False)
    rt = Runtime(run, device="cpu")
    rt.step(0)
    assert rt.timer.collect() == {}  # the warm-up step's stages are gone once it ends
    for s in range(1, run.steps):
        rt.step(s)
    rep = rt.report()
    assert len(rep["stages_ms"]["router"]) == 2 * (run.steps - 1)  # 2 layers, steps 1..
    rep["stages_ms"]["router"] = [1.0, 3.0, 1.0, 3.0]  # ms per call
    s = summarize(run, [rep], [dict(node_id="n0", rank=0, host="h", device="cpu")])
    assert s["timing"]["stages_ms"]["router"] == 2.0 * 2  # median 2 x 2 calls per step
    one = Runtime(run.replace(steps=1), device="cpu")
    one.step(0)  # a one-step run keeps its only step
    assert len(one.report()["stages_ms"]["router"]) == 2


def test_a_negative_overlap_reads_as_time_outside_the_stages(cpu_run):
    s = copy.deepcopy(cpu_run)
    s["timing"]["overlap"] = -0.25  # step = 1.25 x the stages' sum: 20% of it in gaps
    text = " ".join(_rendered(s).split())
    assert "20% of the step outside the timed stages" in text and "overlap -" not in text
    s["timing"]["overlap"] = 0.31
    assert "overlap 0.31" in " ".join(_rendered(s).split())


def test_a_stage_per_step_counts_each_layers_own_time():
    """A step's first layer starts on an idle GPU (its router stage times the host's launch),
    the later ones queue behind it: per step the stage is its calls summed, the median over
    steps and ranks (the median call x calls per step once read 4 x 0.05 for 0.55 ms)."""
    from epmoe.launch.report import _stage_ms_per_step

    step = [0.40, 0.05, 0.05, 0.05]  # ms per call, 4 layers
    noisy = [0.40, 0.05, 0.05, 9.0]  # one stall: the median over steps ignores it
    at = [(s, l) for s in (1, 2, 3) for l in range(4)]
    ranks = [dict(stages_ms={"router": step * 2 + noisy}, stages_at={"router": at}),
             dict(stages_ms={"router": [v + 0.01 for v in step] * 3},
                  stages_at={"router": at})]
    # per-step sums: rank 0 0.55, 0.55, 9.5; rank 1 0.59 x 3 -> median of the six 0.59
    assert _stage_ms_per_step(["router"], ranks)["router"] == pytest.approx(0.59)
    assert _stage_ms_per_step(["router"], ranks[:1])["router"] == pytest.approx(0.55)


def test_a_stage_per_layer_keeps_each_layers_own_time():
    """Per layer: the median over steps and ranks of that layer's calls in a step, grouped by
    the runtime's (step, layer) tags: calls per layer may vary by step (the torch experts
    call their GEMMs once per expert that got rows), a step without a call counts 0."""
    from epmoe.launch.report import _stage_ms_per_layer, _stage_ms_per_step

    def rank(calls):  # [(step, layer, ms)]
        return dict(stages_ms={"gemm1": [c[2] for c in calls]},
                    stages_at={"gemm1": [(c[0], c[1]) for c in calls]})

    a = rank([(1, 0, 0.1), (1, 0, 0.1), (1, 1, 0.3),  # step 1: layer 0 two experts
              (2, 0, 0.1), (2, 1, 0.1), (2, 1, 0.1), (2, 1, 0.1),  # step 2: layer 1 three
              (3, 1, 0.5)])  # step 3: layer 0 got no rows here
    assert _stage_ms_per_layer(["gemm1"], [a], 2)["gemm1"] == pytest.approx([0.1, 0.3])
    assert _stage_ms_per_step(["gemm1"], [a])["gemm1"] == pytest.approx(0.5)
    b = rank([(1, 0, 0.2), (1, 1, 0.2), (2, 0, 0.2), (2, 1, 0.2), (3, 0, 0.2), (3, 1, 0.2)])
    # six values a layer over both ranks: layer 0 (0.2, 0.1, 0, 0.2 x 3), layer 1 (0.3, 0.3,
    # 0.5, 0.2 x 3)
    assert _stage_ms_per_layer(["gemm1"], [a, b], 2)["gemm1"] == pytest.approx([0.2, 0.25])
    between = dict(stages_ms={"rebalance": [2.0, 2.0]},  # between the layers: per step only
                   stages_at={"rebalance": [(1, None), (2, None)]})
    assert _stage_ms_per_layer(["rebalance"], [between], 2) == {}
    assert _stage_ms_per_step(["rebalance"], [between])["rebalance"] == 2.0


def test_a_run_tags_each_stage_call_with_its_step_and_layer():
    """The runtime sets the timer's step and layer as it issues: a CPU run's report."""
    from epmoe.plan.run import RunConfig
    from epmoe.runtime import Runtime

    run = RunConfig(model="deepseek-v3-tiny", tokens=8, layers=3, steps=3, check=False)
    rt = Runtime(run, device="cpu")
    for s in range(run.steps):
        rt.step(s)
    rep = rt.report()
    at = rep["stages_at"]
    assert set(at) == set(rep["stages_ms"])
    assert at["router"] == [(s, l) for s in (1, 2) for l in range(3)]  # step 0 reset
    assert all(len(at[k]) == len(rep["stages_ms"][k]) for k in at)


def test_the_cuda_timers_tags_through_events_and_graph_replays(monkeypatch):
    """The CUDA paths' bookkeeping, with stand-in events (CPU CI): a stage's call keeps the
    (step, layer) it was issued at until collect(); a captured stage keeps its layer and
    takes the step of each replay."""
    import torch

    from epmoe.timing import StageTimer

    class Ev:
        def __init__(self, **_):
            self.t = 0.0

        def record(self):
            Ev.clock += 1.0
            self.t = Ev.clock

        def elapsed_time(self, other):
            return other.t - self.t

    Ev.clock = 0.0
    monkeypatch.setattr(torch.cuda, "Event", Ev)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    t = StageTimer(device="cpu")
    t.cuda = True
    t.step, t.layer = 4, 1
    with t.stage("router"):
        pass
    t.layer = 2
    with t.stage("router"):
        pass
    assert t.collect() == {"router": [1.0, 1.0]}
    assert t.collect_where() == {"router": [(4, 1), (4, 2)]}
    t.reset()
    with t.capturing():
        t.layer = 0
        with t.stage("experts"):
            pass
    for step in (5, 6):
        t.step = step
        t.replayed()
    assert t.collect() == {"experts": [1.0, 1.0]}
    assert t.collect_where() == {"experts": [(5, 0), (6, 0)]}
