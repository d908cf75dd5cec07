"""The cost model's arithmetic on synthetic profiles, the routing statistics against direct
computation, and the stage names against the runtime's StageTimer names."""

import itertools
import math
import re
from pathlib import Path

import pytest

from epmoe.config import MoEConfig, QuantConfig
from epmoe.plan.comm_cost import CommCase, dispatch_cost
from epmoe.plan.cost import (STAGES, TOP_STAGES, Candidate, Workload, _aligned_rows,
                             predict_layer)
from epmoe.plan.routing import (RoutingSpec, SlotMap, finite_max, hit_probability_uniform,
                                routing_stats)
from epmoe.plan.synthetic import SYN as SYN_PROV, synthetic_profile
from epmoe.plan.topology import Link, Topology

CFG = MoEConfig("t", hidden=256, moe_intermediate=128, num_experts=16, top_k=4,
                num_moe_layers=2)
BF16 = QuantConfig("bf16")


def topo(nodes=1, g=4, nvl=100.0, rdma=10.0):
    return Topology(nodes, g, "h200", links={"nvlink": Link("nvlink", nvl, 0.0),
                                              "rdma": Link("rdma", rdma, 0.0)})


def test_stage_names_are_the_runtimes():
    """Every predicted stage is a StageTimer name used in epmoe/ (and vice versa)."""
    root = Path(__file__).parents[1] / "epmoe"
    used = set()
    for f in root.rglob("*.py"):
        if f.relative_to(root).parts[0] in ("plan", "sim"):
            continue
        used |= set(re.findall(r'(?<!_)stage\("([a-z_.0-9]+)"\)', f.read_text()))
        used |= {"experts." + s for s in re.findall(r'_stage\("([a-z_0-9]+)"\)', f.read_text())}
    assert set(STAGES) == used


@pytest.mark.parametrize("e,g,k", [(8, 4, 2), (8, 2, 3), (12, 3, 4), (6, 6, 2)])
def test_fan_out_closed_form_vs_enumeration(e, g, k):
    subsets = list(itertools.combinations(range(e), k))
    ranks = sum(len({x // (e // g) for x in s}) for s in subsets) / len(subsets)
    cfg = MoEConfig("f", hidden=128, moe_intermediate=128, num_experts=e, top_k=k)
    st = routing_stats(cfg, RoutingSpec(), g, g)
    assert st.method == "closed form"
    assert st.ranks_per_token == pytest.approx(ranks, rel=1e-12)
    assert g * hit_probability_uniform(e, e // g, k) == pytest.approx(ranks, rel=1e-12)
    # the Monte Carlo path (a flat recorded load) agrees within sampling error
    mc = routing_stats(cfg, RoutingSpec.from_load([1.0] * e), g, g)
    assert mc.method.startswith("monte carlo")
    assert mc.ranks_per_token == pytest.approx(ranks, rel=0.03)


def test_group_limit_bounds_the_fan_out():
    """One group per rank, one group kept: every token's experts sit on one rank."""
    cfg = CFG.replace(n_group=4, topk_group=1, router="sigmoid_grouped")
    st = routing_stats(cfg, RoutingSpec(), 4, 2)
    assert st.ranks_per_token == pytest.approx(1.0)
    assert st.nodes_per_token == pytest.approx(1.0)


def test_hottest_rank_load_is_the_direct_computation():
    load = [float(i + 1) for i in range(16)]
    slots = SlotMap(tuple(range(16)) + (15, 14, 13, 12))  # 20 slots, 4 ranks of 5
    st = routing_stats(CFG, RoutingSpec.from_load(load), 4, 4, slots)
    cnt = [1] * 16
    for s in slots.phy2log[16:]:
        cnt[s] += 1
    q = [4 * w / sum(load) for w in load]
    per_slot = [q[e] / cnt[e] for e in slots.phy2log]
    direct = [sum(per_slot[r * 5:(r + 1) * 5]) for r in range(4)]
    assert st.pairs_rank == pytest.approx(direct, rel=1e-12)
    assert sum(st.pairs_rank) == pytest.approx(4.0)
    assert st.hot_rank == max(range(4), key=direct.__getitem__)


def test_eplb_replicas_lower_the_hottest_rank():
    prof = synthetic_profile()
    spec = RoutingSpec("zipf", 1.2)
    plain = routing_stats(CFG, spec, 4, 4)
    hot = max(range(16), key=lambda e: plain.pairs_slot[e])
    # replicate the hottest expert on every other rank (4 extra slots, 5 per rank)
    order = [e for e in range(16)]
    rows = [order[r * 4:(r + 1) * 4] for r in range(4)]
    phy = tuple(x for r in range(4) for x in rows[r] + [hot])
    rep = routing_stats(CFG, spec, 4, 4, SlotMap(phy))
    assert max(rep.pairs_rank) < max(plain.pairs_rank)
    w = Workload(CFG, BF16, 256, spec)
    c = Candidate("ep_dp", "deepep-ht", "triton")
    t0 = predict_layer(c, w, topo(), prof, plain).stages_us["experts.gemm1"]
    t1 = predict_layer(c, Workload(CFG, BF16, 256, spec, SlotMap(phy)), topo(), prof,
                       rep).stages_us["experts.gemm1"]
    assert t1 < t0


def test_shared_draws_give_the_same_stats_on_every_placement():
    """A sweep prices one routing on many placements and rank counts with one store of draws:
    the experts are drawn once per routing and every call's stats equal a fresh call's."""
    draws: dict = {}
    hot = [0, 5, 9, 12]
    cases = [(4, 4, None), (4, 2, None), (2, 2, None),
             (4, 4, SlotMap(tuple(range(16)) + tuple(hot)))]
    for spec in (RoutingSpec("zipf", 1.2), RoutingSpec("zipf", 0.6, seed=3)):
        for world, g, slots in cases:
            shared = routing_stats(CFG, spec, world, g, slots, draws=draws)
            assert shared == routing_stats(CFG, spec, world, g, slots), (spec, world, slots)
    assert len(draws) == 2  # one per routing


def test_doubling_link_bandwidth_halves_the_link_term():
    prof = synthetic_profile()  # alpha 0, no SM limit, free quantize and launches
    st = routing_stats(CFG, RoutingSpec(), 8, 4)
    for backend, t in (("deepep-ht", topo(2, 4)), ("deepep-ll", topo(2, 4)),
                       ("deepep-ht", topo(1, 4))):
        s = st if t.world == 8 else routing_stats(CFG, RoutingSpec(), 4, 4)
        a = dispatch_cost(backend, CommCase(CFG, BF16, t, prof, s, 64, 64, reuse_layout=True))
        fast = t.with_link("nvlink", GBps=200.0).with_link("rdma", GBps=20.0)
        b = dispatch_cost(backend, CommCase(CFG, BF16, fast, prof, s, 64, 64,
                                            reuse_layout=True))
        assert a.kernel_us > 0 and b.kernel_us == pytest.approx(a.kernel_us / 2, rel=1e-12)


def test_ht_dedups_per_rank_and_ll_sends_per_pair():
    """Intranode bytes: HT sends T x (ranks per token - own) rows, LL T x k x (G-1)/G."""
    prof = synthetic_profile()
    t = topo(1, 4)
    st = routing_stats(CFG, RoutingSpec(), 4, 4)
    tokens = 128
    ht = dispatch_cost("deepep-ht", CommCase(CFG, BF16, t, prof, st, tokens, tokens))
    row = 2 * CFG.hidden + CFG.top_k * 8
    h = hit_probability_uniform(16, 4, 4)
    assert ht.link_bytes["nvlink"] == pytest.approx(tokens * 3 * h * row, rel=1e-12)
    ll = dispatch_cost("deepep-ll", CommCase(CFG, BF16, t, prof, st, tokens, tokens))
    assert ll.link_bytes["nvlink"] == pytest.approx(tokens * 4 * 3 / 4 * (2 * 256 + 16),
                                                    rel=1e-12)


def test_ll_without_nvlink_sends_every_peers_pairs_over_rdma():
    """DeepEP LL with NVLink off (allow_nvlink_for_low_latency_mode=False): the same pairs as
    with it, all on the NIC, the same node's peers too; symm-ll and the HT kernels keep
    NVLink (the flag is DeepEP LL's)."""
    prof = synthetic_profile()
    t, tokens = topo(1, 4), 128
    st = routing_stats(CFG, RoutingSpec(), 4, 4)
    case = CommCase(CFG, BF16, t, prof, st, tokens, tokens, ll_nvlink=False)
    ll = dispatch_cost("deepep-ll", case)
    assert set(ll.link_bytes) == {"rdma"}
    assert ll.link_bytes["rdma"] == pytest.approx(tokens * 4 * 3 / 4 * (2 * 256 + 16),
                                                  rel=1e-12)
    with_nvl = dispatch_cost("deepep-ll", CommCase(CFG, BF16, t, prof, st, tokens, tokens))
    assert ll.kernel_us == pytest.approx(with_nvl.kernel_us * 100.0 / 10.0, rel=1e-12)
    for backend in ("symm-ll", "deepep-ht"):
        assert set(dispatch_cost(backend, case).link_bytes) == {"nvlink"}


def test_sms_limit_the_bandwidth_until_the_link_saturates():
    t = topo(1, 4)
    st = routing_stats(CFG, RoutingSpec(), 4, 4)
    us = []
    for sms in (1, 2, 4, 1000, 2000):
        prof = synthetic_profile(per_sm_GBps=10.0, sms=sms)
        us.append(dispatch_cost("deepep-ht", CommCase(CFG, BF16, t, prof, st, 256, 256,
                                                      reuse_layout=True)).kernel_us)
    assert us[1] == pytest.approx(us[0] / 2) and us[2] == pytest.approx(us[0] / 4)
    assert us[3] == pytest.approx(us[4])  # 100 GB/s of link reached: more SMs do not help


@pytest.mark.parametrize("ranks", [2, 4])
def test_sms_also_copy_the_ranks_own_rows(ranks):
    """SM-bound: the time is every row this rank's SMs move (own rows too) over SMs x rate,
    while the link carries only the rows that leave the rank."""
    t = topo(1, ranks, nvl=1e6)  # a link that never binds
    st = routing_stats(CFG, RoutingSpec(), ranks, ranks)
    prof = synthetic_profile(per_sm_GBps=10.0, sms=4)
    tokens = 256
    cost = dispatch_cost("deepep-ht", CommCase(CFG, BF16, t, prof, st, tokens, tokens,
                                               reuse_layout=True))
    row = 2 * CFG.hidden + CFG.top_k * 8  # bf16 row + (id, weight) per slot
    all_rows = tokens * sum(st.hit_rank)  # sent by a mean rank, its own included
    assert cost.notes["dispatch.sm_bytes"] >= all_rows * row  # the hottest receiver >= mean
    assert cost.kernel_us == pytest.approx(cost.notes["dispatch.sm_bytes"] / (40.0 * 1e3))
    assert cost.link_bytes["nvlink"] == pytest.approx(all_rows * row * (ranks - 1) / ranks)


@pytest.mark.parametrize("nodes,g", [(2, 4), (16, 1)])
@pytest.mark.parametrize("direction", ["dispatch", "combine"])
def test_across_nodes_the_slowest_warp_role_bounds_the_sms(nodes, g, direction):
    """Across nodes DeepEP's channels split their warps by role (internode.cu): dispatch 7
    RDMA senders on one row per (token, node), 8 forwarders and 8 NVLink receivers on one per
    (token, rank); combine 8 NVLink senders, 24 // nodes forwarders per node (at least one)
    and the forwarders less 8 RDMA receivers. Each copying warp moves 2 / 24 of the per-SM
    rate (the intranode kernels' 24 warps on each SM of a pair); one node: the plain rows."""
    from epmoe.plan.comm_cost import combine_cost

    tokens, per_sm, sms = 256, 10.0, 4
    prof = synthetic_profile(per_sm_GBps=per_sm, sms=sms)
    t = topo(nodes, g, nvl=1e6, rdma=1e6)  # links that never bind
    st = routing_stats(CFG, RoutingSpec(), t.world, g)
    cost = (dispatch_cost if direction == "dispatch" else combine_cost)(
        "deepep-ht", CommCase(CFG, BF16, t, prof, st, tokens, tokens, reuse_layout=True))
    row = (2 * CFG.hidden + CFG.top_k * 8) if direction == "dispatch" else 2 * CFG.hidden
    n = t.world * tokens * max(st.hit_rank)
    rank_rows = max(tokens * sum(st.hit_rank), finite_max(n, n, t.world))
    node_rows = tokens * sum(st.hit_node)
    assert 0.9 * tokens * min(nodes, CFG.top_k) * 0.5 < node_rows <= tokens * nodes
    warp_GBps = per_sm * 2 / 24
    if direction == "dispatch":
        role_warps = [(node_rows, 7), (rank_rows, 8), (rank_rows, 8)]
    else:
        fwd = nodes * max(24 // nodes, 1)
        assert fwd == {2: 24, 16: 16}[nodes]
        role_warps = [(rank_rows, 8), (rank_rows, fwd), (node_rows, fwd - 8)]
    channels = sms / 2
    slowest = max(r * row / (w * warp_GBps * channels * 1e3) for r, w in role_warps)
    assert cost.kernel_us == pytest.approx(slowest)
    one = topo(1, 4, nvl=1e6, rdma=1e6)
    st1 = routing_stats(CFG, RoutingSpec(), one.world, 4)
    c1 = (dispatch_cost if direction == "dispatch" else combine_cost)(
        "deepep-ht", CommCase(CFG, BF16, one, prof, st1, tokens, tokens, reuse_layout=True))
    n1 = one.world * tokens * max(st1.hit_rank)
    rows1 = max(tokens * sum(st1.hit_rank), finite_max(n1, n1, one.world))
    assert c1.kernel_us == pytest.approx(rows1 * row / (per_sm * sms * 1e3))


def test_gemm_time_is_flops_over_the_curve():
    prof = synthetic_profile(tflops={"torch": 100.0})  # the reference: no row alignment
    w = Workload(CFG, BF16, 512)
    p = predict_layer(Candidate("tp", "local", "torch"), w, topo(1, 1), prof)
    rows = 512 * 4
    assert p.stages_us["experts.gemm1"] == pytest.approx(2 * rows * 256 * 256 / 100e6)
    assert p.stages_us["experts.gemm2"] == pytest.approx(2 * rows * 256 * 128 / 100e6)
    assert p.stages_us["experts"] >= p.stages_us["experts.gemm1"] + p.stages_us["experts.gemm2"]
    assert p.total_us == pytest.approx(sum(p.stages_us[s] for s in TOP_STAGES))


def test_tp_is_immune_to_skew_and_ep_is_not():
    prof = synthetic_profile()
    t = topo(1, 4)
    res = {}
    for form, backend in (("tp", "local"), ("ep", "local")):
        for spec in ("uniform", "zipf:1.5"):
            w = Workload(CFG, BF16, 256, spec)
            res[form, spec] = predict_layer(Candidate(form, backend, "triton"), w, t,
                                            prof).stages_us["experts"]
    assert res["tp", "zipf:1.5"] == pytest.approx(res["tp", "uniform"])
    assert res["ep", "zipf:1.5"] > 1.5 * res["ep", "uniform"]


def test_aligned_rows_are_a_poisson_expectation():
    assert _aligned_rows([37.0, 2.5, 0.0, -1.0], 1) == 37.0 + 2.5
    assert _aligned_rows([0.5], 128) == pytest.approx(128 * (1 - math.exp(-0.5)), rel=1e-12)

    def direct(lam, a):
        return sum(math.exp(x * math.log(lam) - lam - math.lgamma(x + 1)) * math.ceil(x / a)
                   * a for x in range(int(lam * 3) + 60))

    assert _aligned_rows([20.0], 16) == pytest.approx(direct(20.0, 16), rel=1e-12)
    # groups of mixed sizes sum (a large one beside tiny ones: the grid is the largest's);
    # above 400 rows, the mean plus half an alignment; empty and negative means add nothing
    means, a = [0.003, 1.5, 20.0, 140.0], 64
    assert _aligned_rows(means + [0.0, -2.0], a) == \
        pytest.approx(sum(direct(m, a) for m in means), rel=1e-12)
    assert _aligned_rows([1000.0, 20.0], 16) == \
        pytest.approx(1000.0 + 7.5 + direct(20.0, 16), rel=1e-12)


def test_shared_mlp_overlaps_on_cuda_only():
    cfg = CFG.replace(num_shared_experts=2)
    c = Candidate("ep_dp", "deepep-ht", "triton")
    for arch, overlap in ((90, True), (0, False)):
        prof = synthetic_profile(sm_arch=arch, tflops={"triton": 1.0})
        p = predict_layer(c, Workload(cfg, BF16, 256), topo(), prof)
        s = p.stages_us
        assert p.overlap_shared is overlap and s["shared"] > 0
        routed = s["dispatch"] + s["experts"] + s["combine"]
        body = max(routed, s["shared"]) if overlap else routed + s["shared"]
        assert p.total_us == pytest.approx(s["norm"] + s["router"] + body + s["all_reduce"]
                                           + s["residual"])
        # two dense GEMMs at 1 TFLOPS (the bandwidth kernels are ~free here)
        assert s["shared"] == pytest.approx(2 * 256 * (2 * 256 * 256 + 256 * 256) / 1e6, rel=1e-5)


def test_finite_max_and_memory():
    assert finite_max(100.0, 100.0, 1) == 100.0
    assert finite_max(100.0, 100.0, 8) > finite_max(100.0, 100.0, 2) > 100.0
    prof = synthetic_profile()
    w = Workload(CFG, BF16, 64)
    m4 = predict_layer(Candidate("ep_dp", "deepep-ll", "triton"), w, topo(1, 4), prof).memory
    m2 = predict_layer(Candidate("ep_dp", "deepep-ll", "triton"), w, topo(1, 2), prof).memory
    assert m2.weights > m4.weights and m4.buffers > 0


def test_cpu_ranks_outnumbering_cores_time_slice_them():
    """Eight ranks time-slicing two cores: the layer takes 4x its one-rank-per-core time; with
    a slice longer than any stretch of compute the compute stages keep their own times and
    the collectives (dispatch, combine) take the rest; with a tiny slice every compute stage
    nears 4x."""
    from dataclasses import replace

    from epmoe.plan.figures import Figure
    from epmoe.plan.profile import SCHED_SLICE

    cpu = lambda cores: Topology(1, 8, "cpu", "tcp", cores_per_node=cores)  # noqa: E731
    base = synthetic_profile(gpu="cpu", launch_us=3.0)
    slice_of = lambda us: replace(base, device={**base.device,  # noqa: E731
                                                SCHED_SLICE: Figure(us, base.device["sms"].prov)})
    w = Workload(CFG, BF16, 64)
    cand = Candidate("ep_dp", "all2all", "torch")
    free = predict_layer(cand, w, cpu(8), base)
    long, tiny = (predict_layer(cand, w, cpu(2), slice_of(us)) for us in (1e9, 1e-9))
    assert long.notes["oversubscription"] == 4.0 and "oversubscription" not in free.notes
    for p in (long, tiny):
        assert p.total_us == pytest.approx(4 * free.total_us)
    compute = [s for s in STAGES if s not in ("dispatch", "dispatch.quantize", "combine")
               and free.stages_us[s] > 0]
    assert "experts.gemm1" in compute and "router" in compute
    for s in compute:
        assert long.stages_us[s] == pytest.approx(free.stages_us[s]), s
        assert tiny.stages_us[s] == pytest.approx(4 * free.stages_us[s], rel=1e-3), s
    for s in ("dispatch", "combine"):
        assert long.stages_us[s] > 4 * free.stages_us[s]
        assert tiny.stages_us[s] == pytest.approx(4 * free.stages_us[s], rel=1e-3)


def test_a_fit_measured_per_busy_expert_scales_with_the_local_experts():
    """The torch experts run act+quant's ops once per busy expert: a fit measured with its 16
    experts busy (calls 16) costs a quarter of its fixed cost (and floor) on a rank holding 4,
    and the whole of it where the profile measured it per call (calls 0)."""
    from dataclasses import replace

    from epmoe.plan.figures import AlphaBeta

    ab = AlphaBeta(1000.0, 1e9, SYN_PROV, floor_us=800.0, calls=16.0)
    assert ab.time_us(0.0, 4.0) == pytest.approx(250.0)
    low = replace(ab, alpha_us=500.0)  # the floor scales too: max(800, 500) / 16
    assert low.time_us(0.0, 1.0) == pytest.approx(50.0)
    assert ab.time_us(0.0) == replace(ab, calls=0.0).time_us(0.0, 4.0) == pytest.approx(1000.0)
    base = synthetic_profile()
    prof = lambda calls: replace(base, kernels={  # noqa: E731
        **base.kernels, "torch": {**base.kernels["torch"],
                                  "act_quant": AlphaBeta(1000.0, 1e9, SYN_PROV, calls=calls)}})
    w = Workload(CFG, BF16, 4096)  # 16 experts: 4 on each of 4 ranks, every one busy
    cand = Candidate("ep_dp", "all2all", "torch")
    per_expert, per_call = (predict_layer(cand, w, topo(1, 4), prof(c)).stages_us
                            for c in (16.0, 0.0))
    assert per_expert["experts.act_quant"] == pytest.approx(250.0, rel=1e-3)
    assert per_call["experts.act_quant"] == pytest.approx(1000.0, rel=1e-3)


def test_experts_no_token_picks_are_never_sampled_and_raise_no_warning():
    """A measured load with idle experts (a short launch, hash layers): the sampler keys them
    at infinity instead of 0 x inf, so no NaN warning reaches the user and none is picked."""
    import warnings

    import numpy as np

    from epmoe.plan.routing import _sample_topk

    class ZeroDraws:  # Exp(1) draws of exactly 0 (rare in float32, certain here) everywhere
        def standard_exponential(self, size, dtype):
            out = np.random.default_rng(2).standard_exponential(size=size, dtype=dtype)
            out[:, 100:110] = 0.0  # idle experts' columns
            return out

    pop = np.zeros(256)
    pop[:40] = np.random.default_rng(1).random(40) + 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids = _sample_topk(pop / pop.sum(), 6, 1, 1, 2000, ZeroDraws())
    assert ids.shape == (2000, 6) and int(ids.max()) < 40
    assert all(len(set(row)) == 6 for row in ids.tolist())


def test_the_work_between_layers_runs_over_the_rows_each_rank_holds():
    """The pre-norm and the residual add (runtime.run_layer) are stages of every layer: over
    one rank's rows under ep_dp, over every rank's under the replicated forms; from the
    profile's fit where it has one, else their bytes at HBM bandwidth, at least a launch."""
    import dataclasses

    from epmoe.plan.figures import AlphaBeta
    from epmoe.plan.synthetic import SYN

    prof = synthetic_profile(hbm_GBps=1000.0, launch_us=0.5)  # 1e6 bytes per us
    w, d = Workload(CFG, BF16, 256), CFG.hidden
    dp = predict_layer(Candidate("ep_dp", "deepep-ht", "triton"), w, topo(), prof).stages_us
    tp = predict_layer(Candidate("tp", "local", "triton"), w, topo(), prof).stages_us
    assert dp["norm"] == pytest.approx(0.5)  # 256 rows x 256 x 4 bytes: 0.26 us, a launch
    assert dp["residual"] == pytest.approx(0.5)  # 0.39 us: a launch too
    assert tp["norm"] == pytest.approx(4 * 256 * d * 4 / 1e6)  # the 4 ranks' rows: 1.05 us
    assert tp["residual"] == pytest.approx(4 * 256 * d * 6 / 1e6)
    big = predict_layer(Candidate("ep_dp", "deepep-ht", "triton"),
                        Workload(CFG, BF16, 8192), topo(), prof)
    assert big.stages_us["residual"] == pytest.approx(8192 * d * 6 / 1e6)
    assert big.total_us == pytest.approx(sum(big.stages_us[s] for s in TOP_STAGES))
    # a calibrated fit (bench.calibrate times them as the runtime runs them) stands in
    kern = {**prof.kernels, "layer": {"norm": AlphaBeta(5.0, 100.0, SYN),
                                      "residual": AlphaBeta(7.0, 1e6, SYN)}}
    cal = dataclasses.replace(prof, kernels=kern)
    st = predict_layer(Candidate("ep_dp", "deepep-ht", "triton"), w, topo(), cal).stages_us
    assert st["norm"] == pytest.approx(5.0 + 256 * d * 4 / 100e3)
    assert st["residual"] == pytest.approx(7.0 + 256 * d * 6 / 1e9)
