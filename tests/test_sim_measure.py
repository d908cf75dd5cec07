"""`python -m epmoe.sim SWEEP --run GPU`: the sweep's rows of one GPU launched for real
(python -m epmoe.launch per row), the measurement beside both predictions; failures and bad
flags reported, never hidden."""

import json

import pytest

from epmoe.sim.__main__ import main
from epmoe.sim.measure import MeasureOptions, exit_code, launch_argv, measure, table
from epmoe.sim.sweep import Sweep

SWEEP = """
name = "cpu-tiny"
model = "deepseek-v3-tiny"
quant = "bf16"
gpus = ["cpu", "h200"]
ep = [1]
tokens = [16]
layers = 1
"""


def _row(**kw):
    return {"gpu": "cpu", "ep": 2, "nodes": 1, "tokens": 64, "routing": "zipf:1.2",
            "redundant": 0, "redundant_per_rank": 0, "kind": "pick",
            "choice": "ep_dp/all2all/torch", "step_ms": 2.0, **kw}


def test_a_row_becomes_the_launchers_flags():
    sweep = Sweep.from_dict({"model": "deepseek-v3-tiny", "quant": "fp8_block",
                             "scale_fmt": "ue8m0_fp32", "gpus": ["cpu"], "layers": 3})
    argv = launch_argv(_row(), sweep, MeasureOptions("cpu", "127.0.0.1:6379", steps=5))
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--ep"] == "2" and flags["--tokens"] == "64" and flags["--layers"] == "3"
    assert (flags["--plan"], flags["--backend"], flags["--experts"]) == ("ep_dp", "all2all",
                                                                         "torch")
    assert flags["--routing"] == "zipf:1.2" and flags["--profile"] == "cpu"
    assert flags["--quant"] == "fp8_block" and flags["--scale-fmt"] == "ue8m0_fp32"
    assert flags["--address"] == "127.0.0.1:6379" and flags["--steps"] == "5"
    assert "--json" in argv


def test_rows_of_other_gpus_and_eplb_rows_are_skipped_with_a_reason():
    sweep = Sweep.from_dict({"gpus": ["cpu", "h800"]})
    rows = [_row(gpu="h800"), _row(redundant=2, redundant_per_rank=1), _row(routing="rec:run"),
            _row(routing="recorded")]
    out = measure(rows, sweep, MeasureOptions("cpu"), say=lambda m: None)
    assert [r["measured"]["status"] for r in out] == ["skipped"] * 4
    assert "gpu h800" in out[0]["measured"]["error"]
    assert "EPLB" in out[1]["measured"]["error"]
    assert all("recorded load" in r["measured"]["error"] for r in out[2:])
    assert exit_code(out) == 0  # nothing launched, nothing failed


def test_exit_code_and_table():
    ok = _row(measured=dict(status="ok", step_ms=4.0, launch_predicted_ms=2.1, ratio=0.5,
                            passed=True))
    bad = _row(measured=dict(status="ok", step_ms=4.0, launch_predicted_ms=None, ratio=0.5,
                             passed=False))
    failed = _row(measured=dict(status="failed", error="error: x" * 30))
    assert exit_code([ok]) == 0 and exit_code([ok, bad]) == 1 and exit_code([failed]) == 3
    text = table([ok, bad, failed])
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "4.000" in text and "0.50" in text and "failed: error: x" in text


@pytest.mark.parametrize("args,msg", [
    (["--run", "b200"], "not one of the sweep's gpus"),
    (["--address", "127.0.0.1:6379"], "--address needs --run"),
    (["--run-steps", "3", "--device", "cpu"], "--run-steps, --device need --run GPU"),
    (["--run", "cpu", "--run-steps", "1"], "--run-steps: 1 must be >= 2"),
    (["--run", "cpu", "--run-timeout", "0"], "--run-timeout: 0 must be a finite number"),
    # options of the other mode were ignored: a sweep "predicted with --profile h100" used
    # its file's gpus
    (["--profile", "h100"], "--profile applies to `python -m epmoe.sim validate`"),
    (["--table", "t.toml"], "--table applies to"),
])
def test_bad_run_flags_exit_2_before_anything_runs(tmp_path, capsys, args, msg):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP)
    try:
        code = main([str(f), *args])
    except SystemExit as e:  # argparse's refusal of a value
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "error: " in err and msg in err, err


def test_validate_refuses_the_run_options(capsys):
    assert main(["validate", "--run", "h200"]) == 2
    assert "--run: validate predicts the published tables" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_cpu_rows_launch_and_report_beside_the_prediction(tmp_path, capsys):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP)
    out = tmp_path / "out"
    assert main([str(f), "--run", "cpu", "--run-steps", "2", "--out", str(out)]) == 0
    text = capsys.readouterr()
    assert "measured (python -m epmoe.launch per row)" in text.out
    rows = json.loads((out / "sim.json").read_text())["rows"]
    (cpu,) = [r for r in rows if r["gpu"] == "cpu"]
    (gpu,) = [r for r in rows if r["gpu"] == "h200"]
    m = cpu["measured"]
    assert m["status"] == "ok" and m["passed"] is True and m["step_ms"] > 0
    assert m["ratio"] == pytest.approx(cpu["step_ms"] / m["step_ms"])
    # the same model, profile and one-rank topology: the launch predicts what the sweep did
    assert m["launch_predicted_ms"] == pytest.approx(cpu["step_ms"], rel=0.1)
    assert gpu["measured"]["status"] == "skipped"
    assert (out / "step_time.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(240)
def test_a_launch_that_cannot_connect_is_reported_and_exits_3(tmp_path, capsys):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP)
    code = main([str(f), "--run", "cpu", "--run-steps", "2", "--address", "127.0.0.1:9",
                 "--run-timeout", "5", "--json"])
    doc = json.loads(capsys.readouterr().out)
    (cpu,) = [r for r in doc["rows"] if r["gpu"] == "cpu"]
    assert code == 3 and cpu["measured"]["status"] == "failed"
    assert "nothing answers at 127.0.0.1:9" in cpu["measured"]["error"]
