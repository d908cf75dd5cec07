"""A sweep's `placed_for`: EPLB's replicas placed for one load, the rows priced at another (a
stale placement: last window's record priced at this window's; a blind one: placed for
uniform, priced at a skew)."""

import json

import numpy as np
import pytest

from epmoe.config import QuantConfig, default_scale_fmt, get_preset
from epmoe.plan.cost import Candidate, Workload, predict_layer
from epmoe.plan.profile import load_profile
from epmoe.plan.routing import RoutingSpec, routing_stats
from epmoe.plan.topology import Topology
from epmoe.sim.__main__ import main
from epmoe.sim.sweep import Sweep, _eplb_slots, run, table

FIXED = "ep_dp/deepep-ht/deepgemm"


def _fixed(rows, rpr):
    return next(r for r in rows if r["kind"] == "fixed" and r["redundant_per_rank"] == rpr)


def test_a_stale_placement_prices_each_layer_on_the_slots_placed_for_the_other_load(tmp_path,
                                                                                 seed):
    """Two recorded windows of a 2-layer stack, hot on different random experts: with
    placed_for = the first, each layer of the second is priced on the replicas EPLB placed
    for the first window's same layer; the fresh placement (no placed_for) serves it better."""
    rng = np.random.default_rng(seed)
    E, L = 256, 2

    def window():
        loads = []
        for _ in range(L):
            load = rng.integers(90, 110, E).astype(float)
            load[rng.choice(E, 6, replace=False)] *= rng.uniform(15, 40)
            loads.append(load.tolist())
        return loads

    before, now = window(), window()
    (tmp_path / "before.json").write_text(json.dumps(before))
    (tmp_path / "now.json").write_text(json.dumps(now))
    doc = {"gpus": ["b200"], "ep": [16], "tokens": [4096], "layers": L,
           "routing": ["now.json"], "redundant_per_rank": [1], "candidates": [FIXED]}
    f = tmp_path / "s.json"
    f.write_text(json.dumps({**doc, "placed_for": "before.json"}))
    stale = _fixed(run(Sweep.load(f)), 1)
    f.write_text(json.dumps(doc))
    fresh = _fixed(run(Sweep.load(f)), 1)
    assert stale["placed_for"] == "rec:before" and fresh["placed_for"] == "rec:now"

    cfg, prof = get_preset("deepseek-v3").replace(num_moe_layers=L), load_profile("b200")
    topo = Topology.parse("2x8", gpu="b200")
    quant = QuantConfig("fp8_block", default_scale_fmt("fp8_block", prof.fig("sm_arch")))
    layer_us = []
    for placed_load, load in zip(before, now, strict=True):
        slots = _eplb_slots(cfg, RoutingSpec.from_load(placed_load), 16, 2, 16)
        spec = RoutingSpec.from_load(load)
        layer_us.append(predict_layer(Candidate(*FIXED.split("/")),
                                      Workload(cfg, quant, 4096, spec, slots), topo, prof,
                                      routing_stats(cfg, spec, 16, 8, slots)).total_us)
    assert stale["step_ms"] * 1e3 == pytest.approx(sum(layer_us), rel=1e-9)
    assert stale["imbalance"] > fresh["imbalance"] and stale["step_ms"] > fresh["step_ms"]


def test_a_blind_placement_helps_a_skew_less_than_one_placed_for_it(seed):
    """Replicas placed for uniform load priced at a Zipf skew: more imbalance and a longer
    step than replicas placed for the skew itself; rows without redundancy place nothing and
    are the same either way."""
    import random

    s = round(random.Random(seed).uniform(0.9, 1.4), 2)
    doc = {"gpus": ["h200"], "ep": [16], "tokens": [4096], "layers": 1,
           "routing": [f"zipf:{s}"], "redundant_per_rank": [0, 1], "candidates": [FIXED]}
    blind_rows = run(Sweep.from_dict({**doc, "placed_for": "uniform"}))
    own_rows = run(Sweep.from_dict(doc))
    same_rows = run(Sweep.from_dict({**doc, "placed_for": f"zipf:{s}"}))
    blind, own, same = (_fixed(r, 1) for r in (blind_rows, own_rows, same_rows))
    assert blind["imbalance"] > own["imbalance"] and blind["step_ms"] > own["step_ms"]
    assert blind["placed_for"] == "uniform" and own["placed_for"] == f"zipf:{s:g}"
    assert same["step_ms"] == own["step_ms"] and same["imbalance"] == own["imbalance"]
    plain_blind, plain_own = _fixed(blind_rows, 0), _fixed(own_rows, 0)
    assert plain_blind["step_ms"] == plain_own["step_ms"] and plain_blind["placed_for"] is None
    lines = table(blind_rows).splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert f"zipf:{s:g} rows with redundancy: EPLB's replicas placed for uniform" in lines
    assert "placed for" not in table(own_rows)


@pytest.mark.parametrize("extra, msg", [
    ({"placed_for": "uniform", "redundant_per_rank": [0]},
     "sweep placed_for ('uniform') places EPLB's replicas, and redundant_per_rank ([0]) adds "
     "none"),
    ({"placed_for": "zipf:-1"}, "sweep placed_for: routing 'zipf:-1' is not understood"),
    ({"placed_for": [1.0, 2.0]}, "sweep placed_for (1.0, 2.0): a recorded load has one entry "
     "per expert (256), it has 2\n"),
    ({"placed_for": "gone.json"}, "sweep placed_for gone.json: cannot read it"),
])
def test_a_bad_placed_for_exits_2(tmp_path, capsys, extra, msg):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"gpus": ["h200"], "ep": [8], "tokens": [128], "layers": 1,
                             "redundant_per_rank": [1], **extra}))
    assert main([str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and err.count("\n") == 1


def test_layer_pairs_keep_one_pair_for_a_uniform_stack_and_one_per_layer_otherwise():
    from epmoe.sim.layers import StackRouting, layer_pairs

    u, z = RoutingSpec(), RoutingSpec.parse("zipf:1.1")
    a, b = (RoutingSpec.from_load([float(i % k + 1) for i in range(16)]) for k in (3, 5))
    one, two = StackRouting("uniform", (u,)), StackRouting("rec:x", (a, b, a))
    assert layer_pairs(one, None, 3) == (((u, u),), (0,))
    assert layer_pairs(two, None, 3) == (((a, a), (b, b)), (0, 1, 0))
    assert layer_pairs(one, StackRouting("zipf:1.1", (z,)), 3) == (((u, z),), (0,))
    assert layer_pairs(one, two, 3) == (((u, a), (u, b)), (0, 1, 0))
    assert layer_pairs(two, one, 3) == (((a, u), (b, u)), (0, 1, 0))
