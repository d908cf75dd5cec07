"""`--micro-batches 2` through the CLI: the oracle still passes and the report carries the
overlap figure ((sum of stage times - step) / sum)."""

import json

import pytest

from epmoe.launch.cli import main


def test_micro_batches_flag_runs_and_reports_overlap(tmp_path):
    out = tmp_path / "s.json"
    rc = main(["--ep", "1", "--tokens", "9", "--steps", "2", "--layers", "1",
               "--micro-batches", "2", "--quiet", "--out", str(out)])
    s = json.loads(out.read_text())
    assert rc == 0 and s["correctness"]["passed"] is True
    t = s["timing"]
    top = {k: v for k, v in t["stages_ms"].items() if "." not in k}
    assert t["overlap"] == (sum(top.values()) - t["step_ms_median"]) / sum(top.values())


def test_micro_batches_must_be_1_or_2(capsys):
    with pytest.raises(SystemExit) as e:  # argparse: exit 2 with the choices
        main(["--micro-batches", "3", "--quiet"])
    assert e.value.code == 2
    assert "invalid choice: 3" in capsys.readouterr().err
