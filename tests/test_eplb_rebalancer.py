"""The rebalancer's parts that need no ranks: the cost-aware decision, the topology, the default
mode per topology, options, token bytes, the stall arithmetic and the report table."""

from __future__ import annotations

import math
import socket

import pytest
import torch

from epmoe.config import QuantConfig, get_preset
from epmoe.eplb.decision import (NVLINK_GBPS, RDMA_GBPS, MigrationLinks, decide, follows_load,
                                 measured_follows_ms)
from epmoe.eplb.rebalancer import RebalanceOptions, Rebalancer, token_bytes
from epmoe.eplb.topology import Topology, discover, local_node_id
from epmoe.launch.eplb_run import _stalls

# ---------------------------------------------------------------------------------- decision


def test_decision_sync_gain_against_move_time():
    # 2 layers at balancedness 0.5 -> 1.0: step time halves (sum of 1/b: 4 -> 2)
    intra, inter = [0, 3e9, 1e9], [0, 0, 2e9]  # rank 2 receives 1 GB inside, 2 GB across
    move = max(a / NVLINK_GBPS + b / RDMA_GBPS for a, b in zip(intra, inter)) / 1e6
    assert move == pytest.approx(1e9 / 150e6 + 2e9 / 40e6)  # 56.7 ms: rank 2 is the slowest
    d = decide(100.0, 4.0, 2.0, 1, intra, inter, "sync")  # one step of 50 ms gain: not worth it
    assert d.move_ms == pytest.approx(move) and d.gain_ms == pytest.approx(50.0)
    assert d.bytes_moved == 3e9 and not d.rebalance
    assert "<= move" in d.reason and "150/40 GB/s" in d.reason
    d = decide(100.0, 4.0, 2.0, 10, intra, inter, "sync")  # a longer horizon pays for it
    assert d.rebalance and d.gain_ms == pytest.approx(500.0) and "> move" in d.reason


def test_decision_credits_the_time_that_follows_the_load():
    """Of a 100 ms step, 30 ms follow the hottest rank's load and halve with it: 15 ms a
    step, not the 50 the whole step would credit; a figure past the step is the step."""
    intra, inter = [1e9], [0]  # 6.7 ms at NVLink's 150 GB/s
    d = decide(100.0, 4.0, 2.0, 1, intra, inter, "sync", follows_ms=30.0)
    assert d.gain_ms == pytest.approx(15.0) and d.rebalance  # 15 > 6.7
    assert "gain 15.000 ms/step (of 30.000 ms a step that follow the load) x 1 steps" in d.reason
    d = decide(100.0, 4.0, 2.0, 1, [2e9], [0], "sync", follows_ms=10.0)
    assert d.gain_ms == pytest.approx(5.0) and not d.rebalance  # 5 < 13.3: the whole step
    assert decide(100.0, 4.0, 2.0, 1, [2e9], [0], "sync").rebalance  # would have moved
    assert decide(100.0, 4.0, 2.0, 1, intra, inter, "sync", follows_ms=500.0).gain_ms == \
        pytest.approx(50.0)
    assert decide(100.0, 4.0, 2.0, 1, intra, inter, "sync", follows_ms=0.0).gain_ms == \
        pytest.approx(50.0)  # nothing measured: the whole step, as before


def test_what_follows_the_load_by_backend():
    """Backends that bring a token's rows to its experts' ranks move the hottest rank's rows:
    dispatch and combine follow its load; allgather and local move the same bytes anyway."""
    for b in ("all2all", "deepep-ht", "deepep-ll", "symm-ht", "symm-ll"):
        assert follows_load(b) == ("dispatch", "experts", "combine")
    for b in ("allgather", "local"):
        assert follows_load(b) == ("experts",)


def test_measured_follows_sums_a_steps_stages_per_layer_backend(seed):
    """Per step, the stages that follow the load of each layer's own backend are summed; the
    median over steps is credited. Layer 0 all2all (dispatch, experts, combine), layer 1
    allgather (its experts only)."""
    rng = torch.Generator().manual_seed(seed)
    steps, stages = [1, 2, 3], ("dispatch", "experts", "combine", "relayout")
    ms = {s: [] for s in stages}
    where = {s: [] for s in stages}
    want = {}
    for step in steps:
        for layer in (0, 1):
            for s in stages:
                v = float(torch.rand((), generator=rng)) * 10
                ms[s].append(v)
                where[s].append((step, layer))
                if (layer == 0 and s != "relayout") or (layer == 1 and s == "experts"):
                    want[step] = want.get(step, 0.0) + v
    got = measured_follows_ms(ms, where, ["all2all", "allgather"])
    assert got == pytest.approx(sorted(want.values())[1])
    assert measured_follows_ms({}, {}, ["all2all"]) is None


def test_decision_async_waits_for_the_bytes_to_land():
    intra, inter = [2e8], [0]
    move = 2e8 / NVLINK_GBPS / 1e6  # 1.33 ms
    d = decide(0.5, 4.0, 2.0, 5, intra, inter, "async")
    land = math.ceil(move / 0.5)
    assert land == 3 and d.gain_ms == pytest.approx(0.25 * (5 - land))
    assert "5 steps - 3 to land" in d.reason and not d.rebalance  # 0.5 ms < 1.33 ms
    assert decide(0.5, 4.0, 2.0, 3, intra, inter, "async").gain_ms == 0


def test_decision_no_gain_and_link_override():
    d = decide(100.0, 2.0, 2.5, 10, [1], [0], "sync")
    assert not d.rebalance and d.reason.startswith("no predicted gain")
    d = decide(100.0, 4.0, 2.0, 1, [0], [1e9], "sync", link_gbps=1000.0)
    assert d.intra_gbps == d.inter_gbps == 1000.0 and d.move_ms == pytest.approx(1.0)


def test_the_run_links_cost_the_move_and_one_given_figure_overrides_them():
    links = MigrationLinks(0.5, 0.25, "profile cpu on 1x2 cpu")
    d = decide(6.0, 4.0, 2.0, 1, [1e6, 0], [0, 1e6], "sync", links=links)
    assert d.move_ms == pytest.approx(4.0)  # 1 MB at 0.25 GB/s across nodes
    assert (d.intra_gbps, d.inter_gbps) == (0.5, 0.25) and not d.rebalance  # gain 3 < 4 ms
    assert d.summary()["links_source"] == "profile cpu on 1x2 cpu" and "0.5/0.25 GB/s" in d.reason
    d = decide(6.0, 4.0, 2.0, 1, [1e6, 0], [0, 1e6], "sync", link_gbps=100.0, links=links)
    assert d.move_ms == pytest.approx(0.01) and "given" in d.links_source and d.rebalance
    with pytest.raises(ValueError, match=r"intra_gbps \(0\) must be a finite GB/s > 0"):
        MigrationLinks(0, 1.0)


def test_a_measured_move_scale_costs_the_move():
    d = decide(10.0, 4.0, 2.0, 1, [1e6], [0], "sync", links=MigrationLinks(1.0, 1.0, "x"),
               move_scale=8.0)
    assert d.link_ms == pytest.approx(1.0) and d.move_ms == pytest.approx(8.0)
    assert not d.rebalance and "= 1.000 ms x 8 (the last move, measured) = 8.000 ms" in d.reason
    plain = decide(10.0, 4.0, 2.0, 1, [1e6], [0], "sync", links=MigrationLinks(1.0, 1.0, "x"))
    assert plain.move_ms == plain.link_ms == pytest.approx(1.0) and plain.rebalance


def test_migration_links_come_from_the_profile_on_the_topology():
    """The all_to_all fit of each link class, scaled to the topology's link: an H800's NVLink
    (200 GB/s) moves less than an H200's (450) under the same fit; a class the profile has no
    fit for (RDMA between CPU nodes) takes the topology's spec figure."""
    from epmoe.plan.comm_cost import migration_links
    from epmoe.plan.profile import load_profile
    from epmoe.plan.topology import Topology

    h200 = migration_links(load_profile("h200"), Topology.parse("2x8", "h200"))
    h800 = migration_links(load_profile("h800"), Topology.parse("2x8", "h800"))
    fit = load_profile("h200").collective("all_to_all", "nvlink")
    assert h200.intra_gbps == pytest.approx(fit.bandwidth_GBps(450.0))
    assert h800.intra_gbps == pytest.approx(h200.intra_gbps * 200 / 450)
    assert 0 < h200.inter_gbps < h200.intra_gbps and "all_to_all fit" in h200.source
    cpu = migration_links(load_profile("cpu"), Topology.parse("2x2", "cpu"))
    assert cpu.intra_gbps < 5 and cpu.inter_gbps == 1.25 and "rdma 1.25 GB/s (spec)" in cpu.source


# ---------------------------------------------------------------------------------- topology


def test_topology_numbering_and_orders():
    t = Topology.from_node_ids(["b", "a", "b", "a"])
    assert t.node_of_rank == (0, 1, 0, 1) and t.num_nodes == 2 and t.ranks_per_node == 2
    assert t.gpu_of_rank == (0, 2, 1, 3)  # node 0: ranks 0, 2; node 1: ranks 1, 3
    phy = torch.arange(2 * 8).view(2, 8)  # rank r holds slots 2r, 2r+1
    gpu = t.to_gpu_order(phy)
    assert gpu[0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert torch.equal(t.to_rank_order(gpu), phy)
    assert Topology.from_node_ids(["x", "x", "y"]).ranks_per_node is None
    assert Topology.single_node(3).summary() == dict(num_nodes=1, ranks_per_node=3,
                                                     node_of_rank=[0, 0, 0])


def test_node_id_without_ray_is_the_hostname():
    import ray

    assert not ray.is_initialized()
    assert local_node_id() == socket.gethostname()
    assert discover(None, 4, "cpu") == Topology.single_node(4)


CFG = get_preset("deepseek-v3-tiny")  # 16 experts, 4 groups, top 2 groups


def _rebalancer(topology, world, slots, **opts):
    return Rebalancer(CFG, QuantConfig("bf16"), 1, slots, rank=0, world=world, group=None,
                      device="cpu", forms=("ep_dp",), own_tokens=True, token_offset=0,
                      options=RebalanceOptions(enabled=True, **opts), make_experts=None,
                      topology=topology)


def test_default_mode_follows_the_topology():
    r = _rebalancer(Topology((0, 0, 1, 1)), 4, 20)
    assert r.mode.mode == "hierarchical" and "2 nodes" in r.mode.reason
    assert _rebalancer(Topology.single_node(4), 4, 20).mode.mode == "global"
    r = _rebalancer(Topology((0, 0, 1)), 3, 18)
    assert r.mode.mode == "global" and "unequal rank counts" in r.mode.reason
    r = _rebalancer(Topology((0, 1, 2, 3)), 4, 20)  # 4 groups on 4 nodes: one group each
    assert r.mode.mode == "hierarchical"
    r = _rebalancer(Topology((0, 0, 1, 1)), 4, 20, mode="global")
    assert r.mode.mode == "global" and r.mode.reason == "set by the run's options"
    assert r.status()["topology"]["node_of_rank"] == [0, 0, 1, 1]


def test_options_and_token_bytes():
    with pytest.raises(ValueError, match=r"eplb migration \('later'\) must be one of"):
        RebalanceOptions(migration="later")
    with pytest.raises(ValueError, match=r"load window \(0\) must be >= 1 step"):
        RebalanceOptions(window=0)
    with pytest.raises(ValueError, match=r"eplb mode \('auto'\) must be one of"):
        RebalanceOptions(mode="auto")
    with pytest.raises(ValueError, match=r"link_gbps \(0.0\) must be > 0"):
        RebalanceOptions(link_gbps=0.0)
    assert token_bytes(7168, QuantConfig("bf16")) == 7168 * 2 + 7168 * 2
    assert token_bytes(7168, QuantConfig("fp8_block")) == 7168 + 7168 // 128 * 4 + 7168 * 2
    with pytest.raises(RuntimeError, match=r"rebalance needs RunConfig\(eplb=True\)"):
        Rebalancer(CFG, QuantConfig("bf16"), 1, 16, rank=0, world=1, group=None, device="cpu",
                   forms=("ep_dp",), own_tokens=True, token_offset=0, options=RebalanceOptions(),
                   make_experts=None).rebalance([], [])


# ---------------------------------------------------------------------------------- stall


def test_stall_arithmetic():
    """wall[i] is step i + 1; baseline = median of unaffected steps from step 2 on."""
    wall = [50.0, 10.0, 10.0, 30.0, 10.0, 10.0, 25.0, 15.0, 10.0]
    events = [dict(step=3, decision="rebalance", migration="sync", call_ms=100.0),  # step 3
              dict(step=6, decision="rebalance", migration="async", call_ms=5.0,
                   switch=dict(step=8)),  # steps 6, 7, 8
              dict(step=8, decision="skip", migration="async", call_ms=1.0)]
    base = _stalls(events, wall)
    assert base == 10.0  # the unaffected steps 2, 4, 5, 9: 10, 30, 10, 10
    assert events[0]["stall_ms"] == pytest.approx(100 + (wall[3 - 1] - 10))
    assert events[0]["worst_step_ms"] == pytest.approx(100 + wall[3 - 1])
    assert events[1]["stall_ms"] == pytest.approx(5 + sum(wall[t - 1] - 10 for t in (6, 7, 8)))
    assert events[1]["worst_step_ms"] == pytest.approx(max(5 + wall[5], wall[6], wall[7]))
    assert "stall_ms" not in events[2]


def test_report_fits_80_columns():
    from rich.console import Console

    from epmoe.launch.eplb_report import render_eplb

    ev = dict(step=3, balancedness_before=0.4, balancedness_predicted=0.98,
              balancedness_after=0.97, kind="incremental", decision="rebalance",
              reason="gain 1.000 ms/step x 3 steps = 3.000 ms > move 1.00 MB at 150/40 GB/s "
                     "intra/inter node = 0.007 ms", slots_moved=12, stall_ms=12.5,
              traffic_before=dict(nodes_per_token=1.5, ranks_per_token=3.0,
                                  internode_bytes_per_step=1e6),
              traffic_after=dict(nodes_per_token=1.9, ranks_per_token=3.2,
                                 internode_bytes_per_step=2e6),
              tradeoff="balancedness 0.400 -> 0.980 at the cost of inter-node traffic",
              switch=dict(step=4, steps_waited=1, stage_ms=30.0, switch_ms=1.0))
    eplb = dict(topology=dict(num_nodes=2), placement_mode="hierarchical",
                mode_reason="group-limited routing", migration="async", rebalances=1,
                redundant_experts=8, routing="zipf:1.2", events=[ev], baseline_step_ms=10.0,
                stall_ms_median=12.5)
    con = Console(width=80, record=True)
    render_eplb(eplb, con)
    text = con.export_text()
    print(text)
    assert all(len(line) <= 80 for line in text.splitlines())
    for want in ("hierarchical", "incremental", "gain 1.000 ms/step", "trade-off",
                 "switched at step 4", "nodes/token 1.50 -> 1.90", "12.5"):
        assert want in text, want
