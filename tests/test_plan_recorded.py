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
    (json.dumps([[1.0] * 16] * 2), ["--layers", "3"], "2 recorded layers for a stack of 3"),
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


@pytest.mark.parametrize("suffix, prefix", [(".pt", ""), (".safetensors", "trace:")])
def test_a_routing_trace_is_planned_at_its_selections(tmp_path, capsys, suffix, prefix):
    """A trace (what `launch --routing trace:FILE` replays): each layer at its selections over
    all its steps, the same plan as a summary recording those loads. Layer 0 spreads its
    tokens evenly over the 16 experts, layer 1 puts every token on experts 0..3 (the first
    two of 8 ranks): there the hottest rank runs 4x the rows."""
    import torch

    from epmoe.eplb.routing import save_trace

    t = torch.arange(64)[:, None]
    even = (4 * t + torch.arange(4)) % 16  # [64 tokens, 4]: every expert 16 times
    hot = torch.arange(4).expand(64, 4)
    ids = torch.stack([even, hot])[None].expand(3, 2, 64, 4)  # [steps, layers, T, K]
    f = tmp_path / f"t{suffix}"
    save_trace(f, ids)
    rc, traced, err = _plan(capsys, "--routing", f"{prefix}{f}")
    assert rc == 0, err
    assert f"planned at the recorded load of 2 layer(s) from t{suffix}" in " ".join(err.split())
    loads = [[3 * 16.0] * 16, [3 * 64.0] * 4 + [0.0] * 12]
    rc, summed, _ = _plan(capsys, "--routing", _summary(tmp_path, loads))
    assert traced.to_dict()["layers"] == summed.to_dict()["layers"]
    experts = [traced.layers[l].choice(4096).stages_us["experts"] for l in range(2)]
    assert experts[1] > 2 * experts[0]


def test_a_bad_trace_exits_2(tmp_path, capsys):
    import torch

    from epmoe.eplb.routing import save_trace

    save_trace(tmp_path / "big.pt", torch.full((1, 2, 8, 4), 16))  # ids past 16 experts
    assert plan_main([*PLAN, "--routing", str(tmp_path / "big.pt")]) == 2
    assert "outside [0, 16) for 16 experts" in capsys.readouterr().err
    assert plan_main([*PLAN, "--routing", f"trace:{tmp_path / 'gone.pt'}"]) == 2
    assert "gone.pt' does not exist" in capsys.readouterr().err
