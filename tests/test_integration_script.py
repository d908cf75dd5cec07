"""The 8-GPU integration script runs end to end on CPU (gloo, benchmarks skipped)."""

import json

import pytest

from epmoe.bench.integration import main


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_integration_launch_steps_on_cpu(tmp_path):
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
    assert main(["--only", "nope"]) == 2
    assert "unknown step(s) ['nope']" in capsys.readouterr().err


def test_comm_step_is_part_of_the_run_and_skips_without_cuda(tmp_path):
    assert main(["--only", "comm", "--out", str(tmp_path)]) == 0
    (step,) = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert step == dict(step="comm", ok=None, skipped="needs CUDA")
