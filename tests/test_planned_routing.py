"""The routing a launch's plan is made for (epmoe.launch.planned_routing)."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.launch.planned_routing import (PlannedRouting, gate_loads, planned_routing,
                                         replayed_loads)
from epmoe.plan import Topology, load_profile, plan_stack
from epmoe.plan.routing import RoutingSpec
from epmoe.plan.run import RunConfig
from epmoe.reference import reference_route
from epmoe.step_tokens import StepTokens
from epmoe.weights import synthetic_layer
from test_launch_weights import MOE_LAYERS, ckpt  # noqa: F401  (a tiny Qwen3-MoE folder)


def test_uniform_passes_through_and_unread_ones_are_uniform():
    assert planned_routing(RunConfig(routing="uniform")) == PlannedRouting()
    assert planned_routing(RunConfig(routing="uniform")).layer(3) == RoutingSpec()
    # a checkpoint or a trace the launching host cannot read (a path only the cluster's nodes
    # see): uniform, with a note saying why
    gone = planned_routing(RunConfig(routing="trace:/nowhere/trace.pt"))
    assert (gone.label, gone.loads_LE) == ("uniform", None)
    assert gone.note.startswith("routing: planned as uniform (trace not read here: trace file")
    far = planned_routing(RunConfig(weights="/nowhere/checkpoint"))
    assert (far.label, far.loads_LE) == ("uniform", None)
    assert far.note.startswith("routing: planned as uniform (the checkpoint's gates not read")


@pytest.mark.parametrize("model", ["deepseek-v3-tiny", "qwen3-moe-tiny"])
def test_sampled_loads_are_the_oracle_routers_picks_through_the_runs_own_gates(model, seed):
    """Each layer's loads: the float64 oracle router's selections of the sampled rows through
    that layer's gate as the runtime builds it (synthetic_layer, the run's seed)."""
    run = RunConfig(model=model, layers=2, seed=seed % 1000)
    cfg, rows = run.cfg, 64
    got = gate_loads(run, rows)
    x = StepTokens(rows, cfg.hidden, run.seed, 0, torch.device("cpu")).base().double()
    assert len(got) == 2
    for l in range(2):
        w = synthetic_layer(cfg, run.quant, l, run.seed, [])
        bias = None if w.bias_E is None else w.bias_E.double()
        ids, _ = reference_route(x @ w.gate_ED.double().T, cfg, bias)
        want = torch.bincount(ids.flatten(), minlength=cfg.num_experts)
        g = torch.tensor(got[l])
        assert float(g.sum()) == rows * cfg.top_k
        # fp32 routing of the planner vs float64: a near-tie may swap one pick in a few rows
        assert float((g - want).abs().sum()) <= 0.05 * rows * cfg.top_k


def test_a_skewed_gate_plans_fewer_experts_hit_than_uniform():
    """DeepSeek-V3's synthetic gates hit far fewer experts than uniform routing at decode
    sizes, so the plan at their loads predicts a cheaper experts stage (weights read per
    expert hit) than the plan at uniform routing."""
    run = RunConfig(model="deepseek-v3", layers=1)
    pr = planned_routing(run)
    assert pr.label == "sampled-gate" and len(pr.loads_LE) == 1
    load = pr.loads_LE[0]
    assert sum(v > 0 for v in load) < 0.9 * len(load)  # some experts never picked
    assert max(load) > 4 * sum(load) / len(load)  # the hottest several times the mean
    topo, prof = Topology.parse("1x1", "h200"), load_profile("h200")
    kw = dict(num_layers=1, forms=("ep_dp",), backends=("local",), experts=("triton",))
    skewed = plan_stack(run.cfg, run.quant, topo, prof, (128,), **pr.plan_kwargs(), **kw)
    flat = plan_stack(run.cfg, run.quant, topo, prof, (128,), routing="uniform", **kw)
    assert skewed.step_us(128) < 0.95 * flat.step_us(128)


def test_a_checkpoints_loads_are_its_own_gates_picks(ckpt):
    """--weights DIR: each layer's gate read from the checkpoint (its MoE layers 1 and 3)."""
    from epmoe.launch.checks import build_run
    from epmoe.launch.cli import parser

    folder, t = ckpt
    run = build_run(parser().parse_args(["--weights", str(folder), "--tokens", "4"]))
    pr = planned_routing(run, rows=64)
    assert pr.label == "sampled-gate" and len(pr.loads_LE) == 2
    assert pr.note == "routing: planned at the checkpoint's gates' expert loads (64 rows a layer)"
    cfg = run.cfg
    x = StepTokens(64, cfg.hidden, run.seed, 0, torch.device("cpu")).base().double()
    for l, cl in enumerate(MOE_LAYERS):
        gate = t[f"model.layers.{cl}.mlp.gate.weight"].double()
        ids, _ = reference_route(x @ gate.T, cfg)
        want = torch.bincount(ids.flatten(), minlength=cfg.num_experts)
        assert float((torch.tensor(pr.loads_LE[l]) - want).abs().sum()) <= 0.05 * 64 * cfg.top_k


@pytest.mark.parametrize("kind", ["zipf", "drift", "trace"])
def test_a_replayed_routing_is_planned_at_the_loads_the_runtime_records(kind, tmp_path, seed):
    """zipf, drift and trace: at rows = the run's tokens, the planned loads are the very
    selections the runtime makes (and records, `load_LE`) over the run's steps; a trace of 3
    steps is replayed at step 3 from its step 0."""
    from epmoe.eplb.routing import make_routing, save_trace
    from epmoe.runtime import Runtime

    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("bf16"), experts="torch", tokens=24,
                    layers=2, steps=4, seed=seed % 1000,
                    routing="zipf:1.2" if kind == "zipf" else "drift:1.2:1")
    cfg = run.cfg
    if kind == "trace":  # three recorded steps of another routing
        ids = torch.stack([make_routing("zipf:2.0", 2, cfg.num_experts, cfg.top_k, 24, s,
                                        seed % 997) for s in range(3)])
        save_trace(tmp_path / "t.pt", ids)
        run = run.replace(routing=f"trace:{tmp_path / 't.pt'}")
    rt = Runtime(run, device="cpu")
    for step in range(run.steps):
        rt.step(step)
    got = replayed_loads(run, rows=run.global_tokens)
    assert torch.equal(torch.tensor(got).long(), rt.load_LE)
    # and the launch report predicts the run at that same recorded load, layer by layer
    from epmoe.launch.plan_report import _routing

    rep = rt.report()
    for l in range(2):
        spec, label = _routing(run, [rep], l)
        assert spec == RoutingSpec.from_load(got[l]) and label.endswith("by its measured load")
    pr = planned_routing(run)
    assert pr.label == f"replayed-{kind}" and len(pr.loads_LE) == 2
    assert sum(pr.loads_LE[0]) == run.steps * (run.global_tokens if kind == "trace"
                                               else 1024) * cfg.top_k
    assert pr.note.startswith(f"routing: planned at the loads {kind} gives over the run's 4")


def test_a_zipf_run_is_planned_at_its_own_seeds_hot_experts():
    """zipf:S puts its hottest experts where the run's seed permutes them, a different set per
    layer and per seed; the plan's loads follow the run's seed (the bare spec's permutation is
    the planner's own, seed 0), so the rank holding the hot experts is the run's."""
    loads = {s: torch.tensor(planned_routing(RunConfig(model="deepseek-v3-tiny", layers=2,
                                                       seed=s, routing="zipf:2.0")).loads_LE)
             for s in (1, 2)}
    for s, lo in loads.items():
        pop = make_popularity(s)
        for l in range(2):
            assert int(lo[l].argmax()) == int(pop[l].argmax())  # the hottest expert, S = 2
    assert int(loads[1][0].argmax()) != int(loads[2][0].argmax()) or \
        int(loads[1][1].argmax()) != int(loads[2][1].argmax())


def make_popularity(seed):
    from epmoe.eplb.routing import _zipf
    cfg = RunConfig(model="deepseek-v3-tiny").cfg
    return _zipf(2, cfg.num_experts, 2.0, 0, seed)


def test_a_drifting_routing_plans_flatter_loads_than_one_step_of_it():
    """drift:S:1 moves its hottest expert every step: summed over the run the loads are
    flatter than one step's (zipf:S), as the launch report will read them."""
    run = RunConfig(model="deepseek-v3-tiny", layers=1, steps=8, routing="drift:1.5:1")
    drift = torch.tensor(planned_routing(run).loads_LE[0])
    one = torch.tensor(replayed_loads(run.replace(steps=1), rows=8 * 1024)[0])
    assert drift.sum() == one.sum()
    assert drift.max() < 0.8 * one.max()
