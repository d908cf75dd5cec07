"""A sweep priced at a run's recorded load: each layer at its own load, the pick over the
whole stack, the step the sum of its layers (epmoe/sim/layers.py)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from epmoe.config import QuantConfig, default_scale_fmt, get_preset
from epmoe.plan.cost import Candidate, Workload, predict_layer
from epmoe.plan.profile import load_profile
from epmoe.plan.routing import RoutingSpec, routing_stats
from epmoe.plan.topology import Topology
from epmoe.sim.__main__ import main
from epmoe.sim.layers import stack_pick
from epmoe.sim.sweep import Sweep, run

FIXED = "ep_dp/deepep-ht/deepgemm"


def _loads(seed, layers, e=256):
    """A skewed layer and an even one, alternating (fresh numbers per seed)."""
    rng = np.random.default_rng(seed)
    hot = rng.zipf(1.6, e).astype(float)
    even = rng.integers(90, 110, e).astype(float)
    return [(hot if l % 2 == 0 else even).tolist() for l in range(layers)]


def _sweep(tmp_path, routing, layers=2, ep=16):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"gpus": ["b200"], "ep": [ep], "tokens": [4096], "layers": layers,
                             "routing": routing, "candidates": [FIXED]}))
    return Sweep.load(f)


def test_each_recorded_layer_is_priced_at_its_own_load(tmp_path, seed):
    loads = _loads(seed, 2)
    (tmp_path / "run.json").write_text(json.dumps(
        {"load": {"tokens_per_layer_expert": loads}}))
    rows = run(_sweep(tmp_path, ["run.json"]))  # beside the sweep file
    fixed = next(r for r in rows if r["kind"] == "fixed")
    assert fixed["routing"] == "rec:run"
    cfg, prof = get_preset("deepseek-v3").replace(num_moe_layers=2), load_profile("b200")
    topo = Topology.parse("2x8", gpu="b200")
    quant = QuantConfig("fp8_block", default_scale_fmt("fp8_block", prof.fig("sm_arch")))
    layer_us = []
    for load in loads:
        spec = RoutingSpec.from_load(load)
        work = Workload(cfg, quant, 4096, spec)
        stats = routing_stats(cfg, spec, 16, 8)
        layer_us.append(predict_layer(Candidate(*FIXED.split("/")), work, topo, prof,
                                      stats).total_us)
    assert layer_us[0] > 1.05 * layer_us[1], "the skewed layer must cost more: weak test"
    assert fixed["step_ms"] * 1e3 == pytest.approx(sum(layer_us), rel=1e-9)
    assert fixed["layer_us"] == pytest.approx(sum(layer_us) / 2, rel=1e-9)
    # one recorded layer stands for every layer: the same as its inline load vector
    (tmp_path / "one.json").write_text(json.dumps([loads[0]]))
    one = run(_sweep(tmp_path, ["one.json", loads[0]]))
    a, b = (r for r in one if r["kind"] == "fixed")
    assert a["step_ms"] == pytest.approx(b["step_ms"], rel=1e-12) and b["routing"] == "recorded"
    assert a["step_ms"] * 1e3 == pytest.approx(2 * layer_us[0], rel=1e-9)


def test_the_pick_is_the_least_summed_over_the_stack():
    """A is faster on the first layer, B by more on the second (three layers: two of the
    second kind): the stack runs B, and every layer's prediction is B's."""
    def pred(label, us):
        return SimpleNamespace(candidate=SimpleNamespace(label=label), total_us=us)

    first = SimpleNamespace(preds=(pred("A", 10.0), pred("B", 14.0), pred("C", 1.0)))
    second = SimpleNamespace(preds=(pred("B", 20.0), pred("A", 23.0)))  # C does not fit
    got = stack_pick([first, second], (0, 1, 1))
    assert [p.candidate.label for p in got] == ["B"] * 3
    assert [p.total_us for p in got] == [14.0, 20.0, 20.0]
    assert stack_pick([first, second], (0,))[0].candidate.label == "A"
    assert stack_pick([first, SimpleNamespace(preds=(pred("D", 1.0),))], (0, 1)) is None


@pytest.mark.parametrize("doc,msg", [
    ({"load": {"tokens_per_layer_expert": [[1.0] * 256] * 3}},
     "3 recorded layers for a stack of 2 MoE layers"),
    ([[1.0] * 64], "64 experts recorded, the model has 256"),
    ({"eplb": {}}, "no load.tokens_per_layer_expert"),
])
def test_a_recorded_file_that_does_not_fit_exits_2(tmp_path, capsys, doc, msg):
    (tmp_path / "run.json").write_text(json.dumps(doc))
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"gpus": ["b200"], "ep": [16], "layers": 2,
                             "routing": ["run.json"]}))
    assert main([str(f)]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err


def test_a_routing_trace_beside_the_sweep_is_its_selections(tmp_path, seed):
    """trace:FILE (a launch's replayed routing): the same rows as a summary of its loads."""
    import torch

    from epmoe.eplb.routing import make_routing, save_trace

    ids = torch.stack([make_routing("zipf:1.3", 2, 256, 8, 512, s, seed % 1000)
                       for s in range(2)])
    save_trace(tmp_path / "t.safetensors", ids)
    loads = [torch.bincount(ids[:, l].flatten(), minlength=256).tolist() for l in range(2)]
    (tmp_path / "loads.json").write_text(json.dumps(loads))
    rows = run(_sweep(tmp_path, ["trace:t.safetensors", "loads.json"]))
    traced, summed = ([r for r in rows if r["routing"] == label]
                      for label in ("rec:t", "rec:loads"))
    assert [r["kind"] for r in traced] == ["pick", "fixed"]
    for a, b in zip(traced, summed, strict=True):
        assert {**a, "routing": ""} == {**b, "routing": ""}
