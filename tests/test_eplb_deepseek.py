"""The DeepSeek EPLB baseline is faithful: DeepSeek's README example, and a plain per-layer
transcription of its rules (both policies) on random loads, slot for slot."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epmoe.eplb import deepseek_rebalance


def test_readme_example():
    """github.com/deepseek-ai/EPLB README: rebalance_experts(weight, 16, 4, 2, 8) prints this
    phy2log (2 layers, 12 experts in 4 groups, 2 nodes, 8 GPUs)."""
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    published = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                 [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert deepseek_rebalance(weight, 16, 4, 2, 8).phy2log.tolist() == published
    assert deepseek_rebalance(weight, 16, 4, 2, 8, "hierarchical").phy2log.tolist() == published


def _pack(w, num_packs):
    """Balanced packing of one row: heaviest first, to the lightest pack with room."""
    n = len(w)
    per = n // num_packs
    if per == 1:
        return list(range(n)), [0] * n
    loads, fill = [np.float32(0)] * num_packs, [0] * num_packs
    pack, rank = [0] * n, [0] * n
    for i in sorted(range(n), key=lambda i: -w[i]):
        p = min((p for p in range(num_packs) if fill[p] < per), key=lambda p: loads[p])
        pack[i], rank[i] = p, fill[p]
        fill[p] += 1
        loads[p] = np.float32(loads[p] + w[i])
    return pack, rank


def plain_deepseek(w_E, R, num_groups, num_nodes, G):
    """DeepSeek's rebalance_experts_hierarchical for one layer, as plain loops in fp32."""
    w = [np.float32(x) for x in w_E]
    E = len(w)
    gs, gpn, S = E // num_groups, num_groups // num_nodes, R // G
    gw = [np.float32(np.sum(np.array(w[g * gs:(g + 1) * gs], np.float32)))
          for g in range(num_groups)]
    gpack, grank = _pack(gw, num_nodes)
    mlog2log = [0] * E
    for g in range(num_groups):
        for j in range(gs):
            mlog2log[(gpack[g] * gpn + grank[g]) * gs + j] = g * gs + j
    En, Rn = E // num_nodes, R // num_nodes
    out = []
    for n in range(num_nodes):
        wn = [w[mlog2log[n * En + i]] for i in range(En)]
        cnt, phy = [1] * En, list(range(En))
        for _ in range(Rn - En):
            e = max(range(En), key=lambda i: (wn[i] / np.float32(cnt[i]), -i))
            phy.append(e)
            cnt[e] += 1
        tokens = [np.float32(wn[e] / np.float32(cnt[e])) for e in phy]
        pack, rank = _pack(tokens, G // num_nodes)
        slots = [None] * Rn
        for i, e in enumerate(phy):
            slots[pack[i] * S + rank[i]] = mlog2log[n * En + e]
        out += slots
    return out


SHAPES = [(12, 16, 4, 2, 8), (16, 24, 4, 2, 4), (32, 48, 8, 4, 8), (24, 36, 6, 3, 6),
          (24, 36, 1, 1, 6), (64, 80, 8, 2, 16), (16, 16, 4, 2, 8)]


@settings(max_examples=25, deadline=None)
@given(shape=st.sampled_from(SHAPES), mode=st.sampled_from(["hierarchical", "global", None]),
       skew=st.sampled_from([0.0, 1.0, 2.0]), seed=st.integers(0, 2**31 - 1))
def test_matches_plain_transcription(shape, mode, skew, seed):
    """Tie-free loads (continuous): the unstable sort of the original orders ties as torch
    does, which a plain loop cannot restate; DeepSeek's code itself was compared with ties."""
    E, R, ng, nn, G = shape
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(2, E, generator=g, dtype=torch.float64) ** (1 + skew) * 1000
    got = deepseek_rebalance(w, R, ng, nn, G, mode).phy2log
    if mode == "global" or (mode is None and ng % nn):
        ng = nn = 1
    for layer in range(2):
        want = plain_deepseek(w[layer].float().tolist(), R, ng, nn, G)
        assert got[layer].tolist() == want, f"{shape=} {mode=} {seed=} {layer=}"


def test_own_rule_falls_back_to_global():
    w = torch.rand(2, 18, dtype=torch.float64)  # 3 groups on 2 nodes: DeepSeek goes global
    assert torch.equal(deepseek_rebalance(w, 24, 3, 2, 4).phy2log,
                       deepseek_rebalance(w, 24, 3, 2, 4, "global").phy2log)
    with pytest.raises(ValueError, match=r"num_groups \(3\) must be divisible by num_nodes"):
        deepseek_rebalance(w, 24, 3, 2, 4, "hierarchical")
