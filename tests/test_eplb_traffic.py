"""Traffic of a placement: the replica rule matches the runtime's ReplicaMap, fan-out against a
plain per-token count and against the closed form for uniform routing, group-limited routing
samples, and the balance-vs-traffic note."""

import math

import pytest
import torch

from epmoe.eplb import Placement, rebalance
from epmoe.eplb.traffic import (physical_ids, routing_from_loads, tradeoff, traffic_from_loads,
                                traffic_from_routing)
from epmoe.router import ReplicaMap


def random_placement(L, E, R, G, gen):
    rows = []
    for _ in range(L):
        p = torch.cat([torch.arange(E), torch.randint(0, E, (R - E,), generator=gen)])
        rows.append(p[torch.randperm(R, generator=gen)])
    return Placement.from_phy2log(torch.stack(rows), E, G)


def test_physical_ids_follow_the_runtime_replica_map(seed):
    gen = torch.Generator().manual_seed(seed)
    p = random_placement(3, 16, 24, 4, gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(3 * 10)]).view(3, 10, 4)
    got = physical_ids(p, ids, token_offset=7)
    for l in range(3):
        rm = ReplicaMap(p.log2phy[l], p.logcnt[l])
        assert torch.equal(got[l], rm.to_physical(ids[l], token_offset=7).long()), f"{seed=}"


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_fanout_against_plain_count(nodes, seed):
    gen = torch.Generator().manual_seed(seed)
    L, E, R, G, T, K = 2, 16, 24, 8, 40, 4
    p = random_placement(L, E, R, G, gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(L * T)]).view(L, T, K)
    src = torch.randint(0, G, (T,), generator=gen)
    tr = traffic_from_routing(p, ids, nodes, token_bytes=100, src_rank_T=src, tokens_per_step=T)
    tr_even = traffic_from_routing(p, ids, nodes, token_bytes=100)
    S, gpn = R // G, G // nodes
    for l in range(L):
        ranks, nds, remote = [], [], []
        for t in range(T):
            slots = []
            for k in range(K):  # the ReplicaMap rule, spelled out
                e = int(ids[l, t, k])
                copies = [s for s in range(R) if int(p.phy2log[l, s]) == e]
                slots.append(copies[(t + k) % len(copies)])
            rk = {s // S for s in slots}
            nd = {r // gpn for r in rk}
            ranks.append(len(rk))
            nds.append(len(nd))
            remote.append(len(nd - {int(src[t]) // gpn}))
        assert tr.ranks_per_token_L[l].item() == pytest.approx(sum(ranks) / T)
        assert tr.nodes_per_token_L[l].item() == pytest.approx(sum(nds) / T)
        assert tr.remote_nodes_per_token_L[l].item() == pytest.approx(sum(remote) / T)
        assert tr_even.remote_nodes_per_token_L[l].item() == pytest.approx(
            sum(nds) / T * (1 - 1 / nodes))
    assert tr.internode_bytes_per_step == pytest.approx(
        float(tr.remote_nodes_per_token_L.sum()) * T * 100)
    if nodes == 1:
        assert tr.internode_bytes_per_step == 0


def test_uniform_routing_matches_closed_form():
    """Uniform top-k over E experts on G ranks (one replica each, E/G per rank): expected
    distinct ranks = G (1 - C(E - E/G, k) / C(E, k))."""
    L, E, G, K, nodes = 2, 64, 8, 8, 2
    ident = Placement.from_phy2log(torch.arange(E).repeat(L, 1), E, G)
    tr = traffic_from_loads(ident, torch.ones(L, E), nodes, top_k=K, token_bytes=1,
                            tokens_per_step=1, num_tokens=20000, seed=1)
    want_ranks = G * (1 - math.comb(E - E // G, K) / math.comb(E, K))
    want_nodes = nodes * (1 - math.comb(E - E // nodes, K) / math.comb(E, K))
    print(f"ranks {tr.ranks_per_token_L.tolist()} vs {want_ranks:.4f}; nodes "
          f"{tr.nodes_per_token_L.tolist()} vs {want_nodes:.4f}")
    assert torch.allclose(tr.ranks_per_token_L, torch.full((L,), want_ranks, dtype=torch.float64),
                          rtol=0.01)
    assert torch.allclose(tr.nodes_per_token_L, torch.full((L,), want_nodes, dtype=torch.float64),
                          rtol=0.01)


def test_routing_from_loads_keeps_the_group_limit(seed):
    E, ng, tg, K = 32, 8, 2, 4
    w = torch.rand(3, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) ** 4
    ids = routing_from_loads(w, K, ng, tg, num_tokens=300, seed=seed)
    assert ids.shape == (3, 300, K)
    s = ids.sort(-1).values
    assert (s[..., 1:] != s[..., :-1]).all(), "experts distinct per token"
    assert (torch.stack([(ids // (E // ng) == g).any(-1) for g in range(ng)]).sum(0) <= tg).all()
    # without a group limit the picks follow the load: the heavier half of the experts gets
    # more picks than the lighter half, and an expert without load is (all but) never picked
    w[:, 5] = 0
    free = routing_from_loads(w, K, num_tokens=2000, seed=seed)
    hits = torch.zeros(3, E, dtype=torch.float64).scatter_add_(
        1, free.flatten(1), torch.ones(3, 2000 * K, dtype=torch.float64))
    order = w.argsort(1)
    light, heavy = hits.gather(1, order[:, :E // 2]), hits.gather(1, order[:, E // 2:])
    assert (heavy.sum(1) > 2 * light.sum(1)).all(), f"{seed=}"
    assert (hits[:, 5] <= 2).all(), f"{seed=}"
    with pytest.raises(ValueError, match=r"top_k <= topk_group \* E / n_group"):
        routing_from_loads(w, 9, ng, tg)


def test_hierarchical_bounds_nodes_and_global_says_it_costs_traffic():
    """Group-limited routing (2 of 8 groups) on 4 nodes: the hierarchical placement keeps every
    token on <= 2 nodes; the global one balances better and reaches more nodes, and says so."""
    L, E, R, ng, tg, nodes, G, K = 4, 64, 96, 8, 2, 4, 16, 6
    g = torch.Generator().manual_seed(0)
    pop = torch.arange(1, E + 1, dtype=torch.float64) ** -1.0
    w = torch.stack([pop[torch.randperm(E, generator=g)] for _ in range(L)]) * 1e4
    ids = routing_from_loads(w, K, ng, tg, num_tokens=2000, seed=3)
    hier, glob = rebalance(w, R, ng, nodes, G, "hierarchical"), rebalance(w, R, ng, nodes, G,
                                                                          "global")
    kw = dict(token_bytes=7168 * 3, tokens_per_step=4096)
    t_hier, t_glob = (traffic_from_routing(p, ids, nodes, **kw) for p in (hier, glob))
    node = physical_ids(hier, ids) // hier.slots_per_gpu // (G // nodes)
    per_token = torch.stack([(node == n).any(-1) for n in range(nodes)]).sum(0)
    assert (per_token <= tg).all()
    b_hier, b_glob = (float(p.balancedness(w).mean()) for p in (hier, glob))
    print(f"hierarchical: bal {b_hier:.3f} {t_hier.summary()}\nglobal: bal {b_glob:.3f} "
          f"{t_glob.summary()}")
    assert b_glob > b_hier
    assert t_glob.internode_bytes_per_step > t_hier.internode_bytes_per_step
    note = tradeoff(b_hier, b_glob, t_hier, t_glob)
    assert note is not None and "at the cost of inter-node traffic" in note
    assert tradeoff(b_glob, b_hier, t_glob, t_hier) is None  # less balance, less traffic


def test_traffic_errors():
    p = Placement.from_phy2log(torch.arange(8).repeat(2, 1), 8, 4)
    with pytest.raises(ValueError, match=r"topk_ids_LTK has 3 layers but the placement 2"):
        traffic_from_routing(p, torch.zeros(3, 4, 2, dtype=torch.long), 2, token_bytes=1)
    with pytest.raises(ValueError, match=r"num_gpus \(4\) must be divisible by num_nodes \(3\)"):
        traffic_from_routing(p, torch.zeros(2, 4, 2, dtype=torch.long), 3, token_bytes=1)
