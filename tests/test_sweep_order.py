"""`--plan sweep`'s launch order: the candidates feasible at every layer, least predicted over
the whole stack first (each layer at its own planned load), as the sweep's budget cuts."""

from __future__ import annotations

import pytest

from epmoe.launch.planned_routing import PlannedRouting
from epmoe.launch.planning import Planning
from epmoe.launch.sweep import sweep_candidates
from epmoe.plan import Topology, Workload, load_profile
from epmoe.plan.planner import candidates, rank_layer
from epmoe.plan.routing import RoutingSpec
from epmoe.plan.run import RunConfig

SCOPE = dict(forms=None, backends=None, experts=None, available=None)


@pytest.mark.parametrize("tokens", [128, 4096])
def test_a_stack_of_skewed_layers_is_ordered_by_its_summed_prediction(tokens, seed):
    """One even layer and three whose load sits on 8 experts of one rank (a random rank, random
    experts of it, hot by a random factor): the order is the candidates' summed predictions
    over the four layers, and it differs from ranking the first layer alone (what the sweep
    did before)."""
    import random

    rng = random.Random(seed)
    run = RunConfig(model="deepseek-v3", layers=4, world=8)
    E = run.cfg.num_experts
    per_rank = E // 8
    r0 = rng.randrange(8) * per_rank
    hot_ids = set(rng.sample(range(r0, r0 + per_rank), 8))
    factor = rng.uniform(50, 200)
    flat = (1.0,) * E
    hot = tuple(factor if e in hot_ids else 1.0 for e in range(E))
    prof, topo = load_profile("h200"), Topology.parse("1x8", "h200")
    ctx = Planning("sweep", prof, topo, tokens,
                   routing=PlannedRouting("t", loads_LE=(flat, hot, hot, hot)))
    got, rejected = sweep_candidates(run, ctx, tokens, SCOPE)

    def rank(load):
        r = rank_layer(Workload(run.cfg, run.quant, tokens, RoutingSpec.from_load(load)),
                       topo, prof, candidates(8), 4)
        return {p.candidate.label: p.total_us for p in r.preds}

    at_flat, at_hot = rank(flat), rank(hot)
    summed = {c: at_flat[c] + 3 * at_hot[c] for c in at_flat if c in at_hot}
    assert [c.label for c in got] == sorted(summed, key=summed.get)
    assert got[0].label != min(at_flat, key=at_flat.get)  # the skew moves the pick
    # what no layer can run is rejected with its own reason, not a layer's
    assert {c for c, _ in rejected} == set(c.label for c in candidates(8)) - set(summed)
    assert all("(at layer" not in why for _, why in rejected)


def test_a_uniform_stack_ranks_its_one_routing_once():
    run = RunConfig(model="deepseek-v3", layers=3, world=8)
    prof, topo = load_profile("h200"), Topology.parse("1x8", "h200")
    got, _ = sweep_candidates(run, Planning("sweep", prof, topo, 128), 128, SCOPE)
    r = rank_layer(Workload(run.cfg, run.quant, 128, RoutingSpec()), topo, prof,
                   candidates(8), 3)
    assert [c.label for c in got] == [p.candidate.label for p in r.preds]


def test_a_candidate_rejected_at_some_layers_only_is_out_and_says_at_which(monkeypatch, seed):
    """A rejection that depends on a layer's load (e.g. memory on the hot rank): the candidate
    is not launched, and its reason names the first layer of the routing that rejected it;
    what every layer rejects keeps its bare reason."""
    import random

    import epmoe.launch.sweep as sw
    from epmoe.plan.planner import Ranked

    rng = random.Random(seed)
    run = RunConfig(model="deepseek-v3", layers=5, world=8)
    E = run.cfg.num_experts
    hot = tuple(rng.uniform(20, 80) if e in set(rng.sample(range(E), 8)) else 1.0
                for e in range(E))
    flat = (1.0,) * E
    first_hot = rng.randrange(1, 5)  # layer 0 even, so the first ranking is not the hot one
    loads = tuple(hot if l == first_hot or (l > first_hot and rng.random() < 0.7) else flat
                  for l in range(5))
    prof, topo = load_profile("h200"), Topology.parse("1x8", "h200")
    ctx = Planning("sweep", prof, topo, 128, routing=PlannedRouting("t", loads_LE=loads))
    real = sw.rank_layer
    feasible = [p.candidate.label for p in real(
        Workload(run.cfg, run.quant, 128, RoutingSpec.from_load(flat)), topo, prof,
        candidates(8), 5).preds]
    victim = rng.choice(feasible)

    def rank_hot_rejects(work, *args, **kwargs):
        r = real(work, *args, **kwargs)
        if work.routing != RoutingSpec.from_load(hot):
            return r
        return Ranked(tuple(p for p in r.preds if p.candidate.label != victim),
                      r.rejected + ((victim, "too hot"),))

    monkeypatch.setattr(sw, "rank_layer", rank_hot_rejects)
    got, rejected = sw.sweep_candidates(run, ctx, 128, SCOPE)
    why = dict(rejected)
    assert victim not in [c.label for c in got]
    assert why[victim] == f"too hot (at layer {first_hot})"
    assert sorted(c.label for c in got) == sorted(set(feasible) - {victim})
    assert all("(at layer" not in w for c, w in rejected if c != victim)
