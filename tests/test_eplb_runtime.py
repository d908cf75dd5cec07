"""EPLB in the runtime: the load recorder, a rebalance on gloo ranks that keeps the layer equal
to the float64 oracle (before and after the weights migrate), and a CPU `--eplb` run."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.eplb.rebalancer import RebalanceOptions, Rebalancer
from epmoe.eplb.recorder import LoadRecorder, balancedness_per_layer
from epmoe.eplb.topology import Topology
from epmoe.launch.oracle import check_correctness
from epmoe.plan.run import RunConfig
from epmoe.reference import TOLERANCE, max_rel_err
from epmoe.runtime import Runtime
from epmoe.ranks import run_ranks

# ---------------------------------------------------------------------------------- recorder


def test_recorder_window_slides_and_counts_valid_pairs():
    rec = LoadRecorder(num_layers=2, num_slots=4, window=2)
    for step, ids in enumerate(([0, 0, 1, -1], [2, 2, 2, 3], [3, 3, -1, -1])):
        rec.begin_step()
        rec.record(0, torch.tensor(ids).view(2, 2))
        rec.record(1, torch.tensor([step % 4]))
    assert rec.num_steps == 2
    # the window holds steps 1 and 2 only; -1 (dropped pairs) are not counted
    assert rec.window_load().tolist() == [[0, 0, 3, 3], [0, 1, 1, 0]]
    rec.clear()
    assert rec.num_steps == 0 and rec.window_load().sum() == 0
    with pytest.raises(ValueError, match=r"load window \(0\) must be >= 1 step"):
        LoadRecorder(1, 4, 0)


def test_balancedness_per_layer():
    load = torch.tensor([[4, 4, 4, 4], [8, 0, 0, 0], [0, 0, 0, 0]])
    got = balancedness_per_layer(load, 2).tolist()  # ranks hold slots {0,1} and {2,3}
    assert got == [1.0, 0.5, 1.0]
    assert balancedness_per_layer(load, 4)[1].item() == pytest.approx(0.25)


# ---------------------------------------------------------------------------------- runtime

WORLD = 4
CASES = {  # backend -> recipe: both backends, both a plain and a quantized recipe
    "all2all": "fp8_block",
    "allgather": "bf16",
}
SPREAD = Topology((0, 1, 0, 1))  # two nodes, ranks not consecutive per node


def _run_cfg(backend: str, recipe: str, **kw) -> RunConfig:
    return RunConfig(model="deepseek-v3-tiny", quant=QuantConfig(recipe), world=WORLD,
                     backend=backend, tokens=32, layers=2, steps=6, seed=5, routing="zipf:1.2",
                     redundant_experts=4, eplb=True, eplb_window=4, **kw)


def _phy(rt) -> list[list[int]]:
    return [list(p) for p in rt.rebalancer.phy2log]


def _with_topology(rt, topology):
    """A fresh rebalancer (before any step) that believes in `topology` (gloo ranks on one
    machine have one hostname; the two-node Ray test covers real discovery)."""
    run = rt.run
    rt.rebalancer = Rebalancer(
        rt.cfg, run.quant, run.num_layers, rt.plan.slots(rt.cfg), rank=rt.rank, world=rt.world,
        group=rt.group, device=rt.device, forms=run.forms, own_tokens=run.own_tokens,
        token_offset=rt.token_offset,
        options=RebalanceOptions(enabled=True, window=run.eplb_window,
                                 migration=run.eplb_migration),
        make_experts=rt._make_experts, timer=rt.timer, topology=topology)
    return rt


def _sync_case(rank, group, run, topology=None):
    rt = Runtime(run, rank=rank, group=group, device="cpu")  # gloo ranks: CPU tensors
    if topology is not None:
        _with_topology(rt, topology)
    rb = rt.rebalancer  # learn from the first move too (the default skips it as warm-up)
    rb.options = dataclasses.replace(rb.options, warmup_moves=0)
    phy_before = _phy(rt)
    for s in range(2):
        rt.step(s)
    before_last = rt.report()["last"]
    window_before = rt.window_balancedness()
    res = rt.rebalance(3)
    rt.step(1)  # the same tokens and routing as before the rebalance
    same_step = rt.report()["last"]
    for s in range(2, 4):
        rt.step(s)
    out = dict(rank=rank, before=before_last, same_step=same_step, after=rt.report()["last"],
               res=res, window_before=window_before, window_after=rt.window_balancedness(),
               phy_before=phy_before, phy_after=_phy(rt), scale=rt.rebalancer._move_scale)
    out["res2"] = rt.rebalance(3)  # costs its move with the slowest rank's measured scale
    return out


def _async_case(rank, group, run, fail: bool):
    """Rank 2 holds its staging until released (fail: rank 3's staging raises after its
    transfers); steps go on meanwhile."""
    import threading

    from epmoe.eplb import background

    rt = Runtime(run, rank=rank, group=group, device="cpu")  # gloo ranks: CPU tensors
    for s in range(2):
        rt.step(s)
    before, phy_before = rt.report()["last"], _phy(rt)
    gate, real = threading.Event(), background.stage_layers

    def staged(*a, **kw):
        if rank == 2:
            gate.wait(120)
        out = real(*a, **kw)
        if fail and rank == 3:
            raise RuntimeError("injected staging failure")
        return out

    background.stage_layers = staged
    try:
        res = rt.rebalance(3)
        pending = rt.eplb_status()["pending"]
        rt.step(1)  # rank 2 is still staging: every rank keeps the old placement
        held, phy_held = rt.report()["last"], _phy(rt)
        gate.set()
        error, steps = None, 0
        for s in range(2, 40):
            try:
                rt.step(s)
            except RuntimeError as e:
                error = str(e)
                break
            steps += 1
            if not rt.eplb_status()["pending"]:
                break
    finally:
        background.stage_layers = real
        gate.set()
    out = dict(rank=rank, res=res, pending=pending, before=before, held=held,
               phy_before=phy_before, phy_held=phy_held, error=error, steps=steps,
               status=rt.eplb_status())
    if not fail:
        rt.step(1)
        out.update(same_step=rt.report()["last"], phy_after=_phy(rt))
    return out


def _rebalance_rank(rank, world, group, cases):
    """Every multi-rank scenario in one spawn of 4 ranks (spawning costs ~20 s on 2 cores)."""
    out = {b: _sync_case(rank, group, _run_cfg(b, r)) for b, r in cases.items()}
    out["hierarchical"] = _sync_case(rank, group, _run_cfg("all2all", "bf16"), SPREAD)
    async_run = _run_cfg("all2all", "bf16", eplb_migration="async")
    out["async"] = _async_case(rank, group, async_run, fail=False)
    out["async_fail"] = _async_case(rank, group, async_run, fail=True)
    return out


@pytest.fixture(scope="module")
def rebalanced():
    return run_ranks(_rebalance_rank, WORLD, CASES, timeout=600)


def _check_oracle(run, ranks, name):
    c = check_correctness(run, [dict(last=r[name]) for r in ranks])
    assert c["checked"] and c["passed"], f"{name}: {c}"
    assert 0 < c["max_rel_err"] <= TOLERANCE[run.quant.recipe]


def _check_migrated(run, ranks, names):
    """Every named step equals the oracle; the step repeated after the migration ("same_step")
    equals the one before it ("before") up to accumulation order."""
    for name in names:
        _check_oracle(run, ranks, name)
    _check_same_step(run, ranks, "before", "same_step")


def _check_same_step(run, ranks, before, after):
    """The same step after the migration: the same output up to accumulation order (fp32 sums
    in another order, cast once to bf16: within two bf16 roundings)."""
    tol = max(TOLERANCE[run.quant.recipe] / 2, 2 ** -7)
    for r in ranks:
        for l in range(run.num_layers):
            b, a = r[before][l], r[after][l]
            assert torch.equal(b["ids"], a["ids"])
            if l == 0:  # deeper layers see x + out of the previous one: equal up to rounding
                assert torch.equal(b["x"], a["x"])
                err = max_rel_err(a["out"], b["out"].double())
                assert err <= tol, f"rank {r['rank']}: layer 0 changed by {err:.2e}"
    # routed to different physical slots than before on at least one rank/layer
    assert any(not torch.equal(r[before][l]["phys"], r[after][l]["phys"])
               for r in ranks for l in range(run.num_layers))


@pytest.mark.slow
@pytest.mark.timeout(660)
@pytest.mark.parametrize("backend", list(CASES))
def test_rebalance_keeps_layer_equal_to_oracle(rebalanced, backend):
    run = _run_cfg(backend, CASES[backend])
    ranks = [r[backend] for r in rebalanced]
    res = [r["res"] for r in ranks]
    print(f"{backend=} recipe={CASES[backend]} {res[0]=}")
    # every rank applied the same placement, and it moved slots
    assert all(r["phy_after"] == ranks[0]["phy_after"] for r in ranks)
    assert ranks[0]["phy_after"] != ranks[0]["phy_before"]
    assert res[0]["decision"] == "rebalance" and res[0]["migration"] == "sync", res[0]
    # the gain is credited to the slowest rank's measured time in the stages that follow its
    # load (the experts; with all2all and DeepEP dispatch and combine too), a part of its step
    assert 0 < res[0]["follows_ms"] < res[0]["step_ms"], res[0]
    assert f"(of {res[0]['follows_ms']:.3f} ms a step that follow the load)" in \
        res[0]["reason"], res[0]
    assert res[0]["placement_mode"] == "global" and "one node" in res[0]["mode_reason"]
    assert res[0]["slots_moved"] > 0 and all(r["slots_moved"] == res[0]["slots_moved"]
                                             for r in res)
    for l, p in enumerate(ranks[0]["phy_after"]):  # every logical expert keeps a replica
        assert sorted(set(p)) == list(range(16)), f"layer {l}: {p}"
    _check_migrated(run, ranks, ("before", "same_step", "after"))


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_hierarchical_rebalance_keeps_groups_on_nodes(rebalanced):
    run = _run_cfg("all2all", "bf16")
    ranks = [r["hierarchical"] for r in rebalanced]
    res = ranks[0]["res"]
    print(res)
    assert res["placement_mode"] == "hierarchical" and res["decision"] == "rebalance", res
    assert "group-limited routing" in res["mode_reason"]
    assert res["topology"]["node_of_rank"] == [0, 1, 0, 1]
    phy = ranks[0]["phy_after"]
    assert all(r["phy_after"] == phy for r in ranks) and phy != ranks[0]["phy_before"]
    per_rank = len(phy[0]) // WORLD
    for l, p in enumerate(phy):  # expert group e // 4 lives on one node; 2 groups per node
        node_of_group = {}
        for s, e in enumerate(p):
            node = SPREAD.node_of_rank[s // per_rank]
            assert node_of_group.setdefault(e // 4, node) == node, f"layer {l}: {p}"
        assert sorted(node_of_group.values()) == [0, 0, 1, 1]
    _check_migrated(run, ranks, ("before", "same_step", "after"))
    tokens, token_bytes = run.tokens * WORLD, 256 * 2 + 256 * 2  # bf16 dispatch + combine
    for t in (res["traffic_before"], res["traffic_after"]):  # the last step's routing, all ranks
        assert 1 <= t["nodes_per_token"] <= 2 and t["ranks_per_token"] >= t["nodes_per_token"]
        assert t["internode_bytes_per_step"] == pytest.approx(
            t["remote_nodes_per_token"] * run.num_layers * tokens * token_bytes)


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_async_migration_keeps_serving_then_switches_together(rebalanced):
    run = _run_cfg("all2all", "bf16", eplb_migration="async")
    ranks = [r["async"] for r in rebalanced]
    res = ranks[0]["res"]
    print(res, [r["status"]["last_switch"] for r in ranks])
    assert res["migration"] == "async" and res["decision"] == "rebalance" and all(
        r["pending"] for r in ranks)
    # while rank 2 stages, every rank serves with the old placement: bit-identical step
    for r in ranks:
        assert r["phy_held"] == r["phy_before"]
        for l in range(run.num_layers):
            for k in ("x", "out", "phys"):
                assert torch.equal(r["before"][l][k], r["held"][l][k]), (r["rank"], l, k)
    # all ranks switched at the same step boundary, to the same placement
    sw = [r["status"]["last_switch"] for r in ranks]
    assert all(s is not None and s["step"] == sw[0]["step"] for s in sw), sw
    assert all(r["error"] is None and not r["status"]["pending"] for r in ranks)
    assert all(r["phy_after"] == ranks[0]["phy_after"] for r in ranks)
    assert ranks[0]["phy_after"] != ranks[0]["phy_before"]
    _check_migrated(run, ranks, ("before", "held", "same_step"))


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_async_migration_failure_raises_on_every_rank_and_keeps_placement(rebalanced):
    ranks = [r["async_fail"] for r in rebalanced]
    errors = [r["error"] for r in ranks]
    print(errors)
    assert all(e is not None and "background migration failed on 1 rank(s)" in e
               for e in errors), errors
    assert "injected staging failure" in errors[3] and "not this rank" in errors[0]
    assert len({r["steps"] for r in ranks}) == 1, "every rank failed at the same step"
    assert all(r["phy_held"] == r["phy_before"] for r in ranks)


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_rebalance_improves_measured_balancedness(rebalanced):
    for backend in [*CASES, "hierarchical"]:
        ranks = [r[backend] for r in rebalanced]
        res = ranks[0]["res"]
        assert all(r["window_before"] == ranks[0]["window_before"] for r in ranks)
        assert res["balancedness_before"] == pytest.approx(ranks[0]["window_before"])
        assert res["balancedness_before"] < 0.75, res
        assert res["balancedness_predicted"] > res["balancedness_before"] + 0.1, res
        assert ranks[0]["window_after"] > res["balancedness_before"] + 0.1, (backend, res,
                                                                           ranks[0]["window_after"])


def test_rebalance_without_eplb_is_refused():
    rt = Runtime(RunConfig(tokens=4, layers=1))
    with pytest.raises(RuntimeError, match=r"rebalance needs RunConfig\(eplb=True\)"):
        rt.rebalance()


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_the_next_move_is_costed_as_the_last_one_took(rebalanced):
    """After a sync move, each rank's scale = its measured migration / the move's link time;
    the next decision costs its move at the slowest rank's scale (all-reduced: every rank
    decides alike) and says so."""
    ranks = [r["all2all"] for r in rebalanced]
    for r in ranks:
        res = r["res"]
        assert res["decision"] == "rebalance" and res["link_ms"] > 0, res
        assert r["scale"] == pytest.approx(res["timing_ms"]["migration"] / res["link_ms"],
                                           rel=0.05), r["scale"]
    worst = max(r["scale"] for r in ranks)
    for r in ranks:
        nxt = r["res2"]
        assert nxt["move_scale"] == pytest.approx(worst), nxt
        assert nxt["move_ms"] == pytest.approx(nxt["link_ms"] * worst)
        # (the reason says so unless the placement did not change at all: test_eplb_rebalancer)
        assert "(the last move, measured)" in nxt["reason"] or nxt["slots_moved"] == 0, nxt
    assert len({r["res2"]["decision"] for r in ranks}) == 1


def test_the_first_move_is_warm_up_and_later_ones_set_the_scale():
    rt = Runtime(RunConfig(tokens=4, layers=1, eplb=True))
    rb = rt.rebalancer
    assert rb.options.warmup_moves == 1
    rb._pending_link_ms = 2.0
    rb._learn_move(50.0)  # the first: one-off costs, not learnt from
    assert rb._move_scale is None
    rb._learn_move(20.0)
    assert rb._move_scale == pytest.approx(10.0)
    rb._pending_link_ms = 0.0  # a move with no link time (all local) says nothing
    rb._learn_move(5.0)
    assert rb._move_scale == pytest.approx(10.0)


# ---------------------------------------------------------------------------------- CLI run


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_eplb_run_on_8_ranks_rebalances_async(tmp_path):
    from epmoe.launch.cli import main

    out = tmp_path / "eplb.json"
    rc = main(["--ep", "8", "--eplb", "--redundant-experts", "8", "--routing", "zipf:1.2",
               "--rebalance-every", "3", "--steps", "8", "--tokens", "128", "--quiet",
               "--eplb-migration", "async", "--timeout", "300", "--out", str(out),
               "--device", "cpu"])  # 8 gloo ranks, on any machine
    s = json.loads(out.read_text())
    assert rc == 0, s["correctness"]
    e = s["eplb"]
    print(json.dumps({k: v for k, v in e.items() if k not in ("events", "slot_load_LS")}),
          e["events"])
    assert s["correctness"]["passed"] is True
    assert s["world"]["ep"] == 8 and len(s["world"]["ranks"]) == 8
    assert e["migration"] == "async" and e["placement_mode"] == "global"
    assert [ev["step"] for ev in e["events"]] == [3, 6]
    assert e["rebalances"] == sum(ev["decision"] == "rebalance" for ev in e["events"]) >= 1
    first = e["events"][0]
    assert first["decision"] == "rebalance" and first["reason"].startswith("gain"), first
    # the move is costed at this run's links: the cpu profile's gloo all_to_all, not NVLink
    assert first["links_source"].startswith("profile cpu on 1x8 cpu"), first
    assert first["intra_gbps"] < 5 and f"{first['intra_gbps']:.3g}/" in first["reason"], first
    assert first["switch"]["step"] >= 3 and first["switch"]["steps_waited"] >= 0, first
    assert first["stall_ms"] > 0 and e["baseline_step_ms"] > 0
    assert len(e["step_wall_ms"]) == 7  # steps 1..7
    assert e["slots_moved"] > 0 and e["slots_moved"] == sum(ev["slots_moved"] for ev in e["events"])
    assert e["balancedness_before"] < 0.6, e
    assert first["balancedness_after"] >= 0.9, first
    assert all("balancedness_after" in ev for ev in e["events"])
    # the recorder's per layer x slot load: every routed (token, k) pair of every rank and step
    cfg_k, layers, slots = s["config"]["top_k"], s["config"]["layers"], 16 + 8
    assert len(e["slot_load_LS"]) == layers and all(len(r) == slots for r in e["slot_load_LS"])
    assert sum(map(sum, e["slot_load_LS"])) == 128 * 8 * cfg_k * layers * 8
    phy = e["final_phy2log_LR"]
    assert len(phy) == layers and all(sorted(set(r)) == list(range(16)) for r in phy)
