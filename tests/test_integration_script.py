"""The 8-GPU integration script runs end to end on CPU (gloo, benchmarks skipped)."""

import json

import pytest

from epmoe.bench.integration import main


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_integration_launch_steps_on_cpu(tmp_path, monkeypatch):
    import epmoe.bench.integration as integration

    monkeypatch.setattr(integration, "_cuda_count", lambda: 0)  # the CPU run, on any machine
    rc = main(["--only", "kernels,launch", "--ep", "2", "--tokens", "16", "--out", str(tmp_path)])
    s = json.loads((tmp_path / "summary.json").read_text())
    steps = {r["step"]: r for r in s["steps"]}
    assert steps["kernels"] == dict(step="kernels", ok=None, skipped="needs CUDA")
    assert set(steps) == {"kernels", "launch_all2all", "launch_eplb-zipf"}, steps
    a2a = steps["launch_all2all"]["summary"]
    assert a2a["backend"] == "all2all" and a2a["passed"] is True
    eplb = steps["launch_eplb-zipf"]["summary"]["eplb"]
    assert eplb["rebalances"] >= 1 and eplb["balancedness_after"] > eplb["balancedness_before"]
    assert rc == 0 and s["passed"] is True
    md = (tmp_path / "summary.md").read_text()
    assert "| launch_all2all | ok |" in md and "EPLB" in md


def test_unknown_step_is_refused(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's refusal, before any step runs
        main(["--only", "tests,nope"])
    assert e.value.code == 2
    assert "--only: 'nope' is not one of tests, kernels" in capsys.readouterr().err


def test_comm_step_is_part_of_the_run_and_skips_without_cuda(tmp_path, monkeypatch):
    import epmoe.bench.integration as integration

    monkeypatch.setattr(integration, "_cuda_count", lambda: 0)
    assert main(["--only", "comm", "--out", str(tmp_path)]) == 0
    (step,) = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert step == dict(step="comm", ok=None, skipped="needs CUDA")


def test_fewer_gpus_than_ranks_share_them_for_our_backends():
    from epmoe.bench.integration import _launch_cases
    from epmoe.launch.checks import build_run
    from epmoe.launch.cli import parser

    for ep, gpus, share in ((2, 1, 2), (4, 3, 2), (8, 1, 8)):
        cases = dict(_launch_cases(ep, "deepseek-v3-tiny", 128, gpus))
        assert set(cases) == {"symm-ht-shared", "symm-ll-shared"}
        for flags in cases.values():  # flags the launcher accepts, as the run they name
            run = build_run(parser().parse_args(flags))
            assert (run.world, run.ranks_per_gpu, run.backend) == (ep, share, flags[-5])
    two = dict(_launch_cases(2, "deepseek-v3-tiny", 128, 2))
    assert {"deepep-ht", "symm-ht", "all2all", "symm-ll-graph"} <= set(two)
    graph = parser().parse_args(two["symm-ll-graph"])  # (a GPU run: parsed, not built here)
    assert graph.cuda_graph and graph.backend == "symm-ll"


def test_one_gpu_runs_the_shared_rank_steps_and_says_what_it_skipped(tmp_path, monkeypatch):
    import epmoe.bench.integration as integration

    calls = []

    def fake_run(name, cmd, timeout, log_dir):
        calls.append((name, cmd))
        return dict(step=name, cmd=" ".join(cmd), rc=0, ok=True, seconds=0.0, log="")

    monkeypatch.setattr(integration, "_cuda_count", lambda: 1)
    monkeypatch.setattr(integration, "_run", fake_run)
    assert main(["--only", "comm,launch", "--out", str(tmp_path)]) == 0
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [r["step"] for r in steps] == ["comm", "comm_shared", "launch_deepep_all2all",
                                          "launch_symm-ht-shared", "launch_symm-ll-shared"]
    assert steps[2]["ok"] is None and "DeepEP and NCCL need a GPU per rank" in steps[2]["skipped"]
    shared = dict(calls)["comm_shared"]
    assert shared[shared.index("--device") + 1] == "shared" and "--world" in shared


def test_plan_step_calibrates_the_comm_part_then_sweeps_with_that_profile(tmp_path,
                                                                          monkeypatch):
    import epmoe.bench.integration as integration

    calls = []

    def fake_run(name, cmd, timeout, log_dir):
        calls.append((name, cmd))
        if "--plan" in cmd:  # what a sweep writes
            sweep = dict(fastest="ep_dp/symm-ht/deepgemm", fastest_ms=7.0, profile="p",
                         auto=dict(label="ep_dp/symm-ht/deepgemm", vs_best=0.0))
            with open(cmd[cmd.index("--out") + 1], "w") as f:
                json.dump({"sweep": sweep}, f)
        return dict(step=name, cmd=" ".join(cmd), rc=0, ok=True, seconds=0.0, log="")

    monkeypatch.setattr(integration, "_cuda_count", lambda: 2)
    monkeypatch.setattr(integration, "_run", fake_run)
    assert main(["--only", "plan", "--out", str(tmp_path)]) == 0
    names = [n for n, _ in calls]
    assert names == ["plan_calibrate", "plan_sweep_128", "plan_sweep_4096"]
    cal = dict(calls)["plan_calibrate"]
    assert cal[cal.index("--parts") + 1] == "comm" and cal[cal.index("--ranks") + 1] == "2"
    prof = cal[cal.index("--out") + 1]
    for name in names[1:]:
        sweep = dict(calls)[name]
        assert sweep[sweep.index("--profile") + 1] == prof and "--device" not in sweep
    md = (tmp_path / "summary.md").read_text()
    assert "fastest ep_dp/symm-ht/deepgemm 7.00 ms; planner ep_dp/symm-ht/deepgemm +0.0%" in md
    # one GPU for two ranks: the sweep's DeepEP / NCCL candidates cannot run: said, not run
    calls.clear()
    monkeypatch.setattr(integration, "_cuda_count", lambda: 1)
    assert main(["--only", "plan", "--ep", "2", "--out", str(tmp_path)]) == 0
    (step,) = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert calls == [] and step["ok"] is None and "need a GPU per rank" in step["skipped"]
