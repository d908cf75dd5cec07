"""`python -m epmoe.plan --routing FILE`: planning at a run's recorded load (and EPLB
placement) (epmoe.plan.recorded)."""

from __future__ import annotations

import json

import pytest

from epmoe.plan.__main__ import main as plan_main
from epmoe.plan.planfile import Plan
from tests.launch_util import launch_in_process

TINY = ["--model", "deepseek-v3-tiny"]  # 16 experts, top-4
PLAN = [*TINY, "--topology", "1x8", "--profile", "h200", "--tokens", "4096", "--forms", "ep_dp"]


def _plan(capsys, *flags) -> tuple[int, Plan | None, str]:
    rc = plan_main([*PLAN, "--json", *flags])
    cap = capsys.readouterr()
    return rc, (Plan.from_dict(json.loads(cap.out)) if rc == 0 else None), cap.err


def _summary(tmp_path, load_LE, phy2log_LR=None) -> str:
    doc = {"load": {"tokens_per_layer_expert": load_LE}}
    if phy2log_LR is not None:
        doc["eplb"] = {"final_phy2log_LR": phy2log_LR}
    f = tmp_path / "run.json"
    f.write_text(json.dumps(doc))
    return str(f)


@pytest.mark.timeout(120)
def test_a_launch_summarys_load_is_planned_layer_by_layer(tmp_path, capsys):
    rc, s = launch_in_process(tmp_path, TINY, "--layers", "3", "--routing", "zipf:1.5")
    assert rc == 0
    capsys.readouterr()
    rc, skewed, err = _plan(capsys, "--routing", str(tmp_path / "summary.json"))
    assert rc == 0, err
    assert len(skewed.layers) == 3  # the file's layer count when --layers is not given
    assert "planned at the recorded load of 3 layer(s) from summary.json" in err
    rc, flat, _ = _plan(capsys, "--routing", "uniform", "--layers", "3")
    # a skewed load puts more rows on the hottest rank than uniform routing does
    assert skewed.step_us(4096) > 1.05 * flat.step_us(4096)


def test_an_eplb_placement_prices_the_replicas(tmp_path, capsys):
    """Half of the pairs go to expert 0: replicated on 8 more slots (one per rank) the
    hottest rank carries far fewer rows than with expert 0 on one rank."""
    load = [800.0] + [800.0 / 15] * 15
    phy2log = list(range(16)) + [0] * 8  # 24 slots, 3 a rank
    rc, hot, err = _plan(capsys, "--routing", _summary(tmp_path, [load] * 2))
    assert rc == 0, err
    rc, spread, err = _plan(capsys, "--routing", _summary(tmp_path, [load] * 2, [phy2log] * 2))
    assert rc == 0, err
    assert spread.num_slots == 24
    assert "its EPLB placement (8 redundant slots)" in " ".join(err.split())  # wrapped at 80
    experts = [p.layers[0].choice(4096).stages_us["experts"] for p in (hot, spread)]
    assert experts[1] < 0.5 * experts[0]  # hottest rank ~53% of the pairs -> ~17%


def test_one_recorded_layer_stands_for_every_layer(tmp_path, capsys):
    rc, p, err = _plan(capsys, "--routing", _summary(tmp_path, [[1.0] * 16]), "--layers", "4")
    assert rc == 0, err
    assert len(p.layers) == 4


@pytest.mark.parametrize("doc, flags, says", [
    ("{not json", [], "not JSON"),
    (json.dumps({"timing": {}}), [], "no load.tokens_per_layer_expert"),
    (json.dumps([[1.0] * 8]), [], "8 experts recorded, deepseek-v3-tiny has 16"),
    (json.dumps([[1.0] * 16] * 2), ["--layers", "3"], "records 2 layers"),
    (json.dumps([[1.0] * 15 + [-1.0]]), [], "finite and >= 0"),
    (json.dumps([[1.0] * 16, [1.0] * 15]), [], "different expert counts"),
    (json.dumps({"load": {"tokens_per_layer_expert": [[1.0] * 16]},
                 "eplb": {"final_phy2log_LR": [list(range(15)) + [0]]}}), [],
     "must hold every one of the 16 experts"),
    (json.dumps({"load": {"tokens_per_layer_expert": [[1.0] * 16]},
                 "eplb": {"final_phy2log_LR": [list(range(16)) + [0] * 8]}}),
     ["--redundant-experts", "16"], "placement has 8"),
])
def test_a_bad_file_exits_2_naming_what_is_wrong(tmp_path, capsys, doc, flags, says):
    f = tmp_path / "bad.json"
    f.write_text(doc)
    rc = plan_main([*PLAN, "--routing", str(f), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and says in err, err
    assert plan_main([*PLAN, "--routing", str(tmp_path / "missing.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err
