"""Steps replayed from a CUDA graph (`RunConfig.cuda_graph`, epmoe/graph.py) on one GPU: the
same outputs as eager steps bit for bit, the float64 oracle on the graph's own outputs (poisoned
before the replay that must write them), and a stage time for every replayed stage."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.launch.oracle import check_correctness
from epmoe.plan.run import RunConfig
from epmoe.runtime import Runtime, pre_norm

pytestmark = pytest.mark.gpu


def _runtime(graph: bool, routing: str, recipe: str, steps: int = 4, **kw) -> Runtime:
    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig(recipe), tokens=96, layers=2,
                    steps=steps, routing=routing, backend="local", experts="triton",
                    cuda_graph=graph, **kw)
    rt = Runtime(run)
    for s in range(steps):
        rt.step(s)
    return rt


@pytest.mark.parametrize("routing,recipe,micro", [("uniform", "fp8_block", 1),
                                                  ("router", "bf16", 1),
                                                  ("zipf:1.2", "fp8_block", 2)])
def test_replayed_steps_match_eager_steps_and_the_oracle(routing, recipe, micro):
    eager = _runtime(False, routing, recipe, micro_batches=micro)
    graph = _runtime(True, routing, recipe, micro_batches=micro)
    assert graph.graph is not None and eager.graph is None
    for l, (a, b) in enumerate(zip(eager.last, graph.last)):
        for key in ("x", "out", "ids", "w"):
            assert torch.equal(a[key], b[key]), (l, key)
    # every replayed step is timed per stage, as the eager ones are
    te, tg = eager.timer.collect(), graph.timer.collect()
    for stage in ("router", "dispatch", "experts", "experts.gemm1", "combine"):
        assert len(tg[stage]) == len(te[stage]) > 0, stage
        assert all(ms > 0 for ms in tg[stage]), stage
    # the graph's outputs poisoned, then one more replay must rewrite them from new inputs
    for rec in graph.graph.keep:
        rec["out"].fill_(float("nan"))
    graph.step(graph.run.steps)
    last = graph.report()["last"]
    assert not any(rec["out"].isnan().any() for rec in last)
    x0 = pre_norm(graph.tokens_for(graph.run.steps)).cpu()  # layer 0's input: the step's tokens
    assert torch.equal(last[0]["x"], x0)  # the replay ran on this step's tokens
    res = check_correctness(graph.run, [graph.report()])
    assert res["passed"], res


def test_a_captured_step_refuses_other_shapes():
    rt = _runtime(True, "uniform", "bf16", steps=2)
    x = rt.tokens_for(5)
    routes = [rt.routing_for(5, l) for l in range(len(rt.layers))]
    with pytest.raises(ValueError, match="a captured step takes tokens"):
        rt.graph.replay(x[:-1], routes)


def _switch(rt: Runtime, new_LR: list[list[int]]) -> None:
    """Apply a placement the way a synchronous rebalance does (move the weights, then switch
    each layer's experts and replica map). One rank has nothing to balance, so a rebalance
    there never moves replicas; this applies one to see what a switch does to a graph."""
    from epmoe.eplb.migrate import migrate_layer

    for l, layer in enumerate(rt.layers):
        migrate_layer(layer.weights.experts, rt.rebalancer.phy2log[l], new_LR[l], 0, 1, None)
        rt.rebalancer._switch_layer(layer, l, new_LR[l])


def test_an_eplb_switch_is_captured_again():
    """A placement switch between replayed steps: the next step captures again (the new
    experts and replica maps), and the run stays equal to the eager one, switch included."""
    rts = []
    for graph in (False, True):
        run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("fp8_block"), tokens=96,
                        layers=2, steps=6, routing="zipf:1.5", backend="local",
                        experts="triton", cuda_graph=graph, eplb=True, redundant_experts=4)
        rt = Runtime(run)
        e = rt.cfg.num_experts
        for s in range(run.steps):
            rt.step(s)
            if s == 2:  # replicas of experts 5..8 instead of 0..3
                _switch(rt, [[*range(e), 5, 6, 7, 8] for _ in rt.layers])
        rts.append(rt)
    eager, graph = rts
    assert graph.rebalancer.phy2log == eager.rebalancer.phy2log
    assert graph.rebalancer.phy2log[0][-4:] == [5, 6, 7, 8]
    assert graph.captures == 2 and eager.captures == 0
    assert torch.equal(graph.load_LS, eager.load_LS)  # every replayed step's load recorded
    assert torch.equal(graph.rebalancer.recorder.window_load(),
                       eager.rebalancer.recorder.window_load())
    for a, b in zip(eager.last, graph.last):
        assert torch.equal(a["out"], b["out"]) and torch.equal(a["phys"], b["phys"])
    assert bool((graph.last[0]["phys"] >= e).any())  # the new replicas took tokens
    assert check_correctness(graph.run, [graph.report()])["passed"]


def test_hash_layers_replay_with_each_steps_token_ids():
    """DeepSeek-V4's hash layers (experts by token id) in a captured step: the token ids are
    a static input copied in per replay, so replayed steps equal eager ones bit for bit, the
    replay routes by this step's ids, and the oracle (its router check included) passes."""
    from epmoe.config import MoEConfig

    cfg = MoEConfig("v4-hash", hidden=256, moe_intermediate=128, num_experts=16, top_k=4,
                    num_shared_experts=1, router="sqrtsoftplus", routed_scaling_factor=1.5,
                    swiglu_limit=10.0, num_moe_layers=3, hash_layers=(0, 1), vocab_size=4096)
    rts = []
    for graph in (False, True):
        run = RunConfig(model="v4-hash", model_config=cfg, quant=QuantConfig("bf16"), tokens=96,
                        layers=3, steps=4, backend="local", experts="triton", cuda_graph=graph)
        rt = Runtime(run)
        for s in range(4):
            rt.step(s)
        rts.append(rt)
    eager, graph = rts
    assert graph.graph is not None
    for l, (a, b) in enumerate(zip(eager.last, graph.last)):
        for key in ("x", "out", "ids", "w", "tok"):
            assert (a[key] is None) == (b[key] is None) and (a[key] is None or
                                                              torch.equal(a[key], b[key])), (l, key)
    tok = graph._token_ids(3)[:96]
    assert torch.equal(graph.last[0]["tok"], tok)  # this step's ids, not the capture's
    for l in (0, 1):  # the hash layers: exactly their tables' experts for the step's ids
        table = graph.layers[l].weights.tid2eid_VK.cpu()
        assert torch.equal(graph.last[l]["ids"].long().sort(1).values,
                           table[graph.last[l]["tok"]].long().sort(1).values), l
    # the oracle, its router check included (layer 2's fused bf16 router may pick the other
    # expert of a near tie: ROUTER_MIN_AGREEMENT)
    res = check_correctness(graph.run, [graph.report()])
    assert res["passed"] and res["router"]["passed"], res
