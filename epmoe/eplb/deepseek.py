"""DeepSeek EPLB (github.com/deepseek-ai/EPLB, eplb.py), reimplemented as the baseline.

DeepSeek has one algorithm, `rebalance_experts_hierarchical(w, R, num_groups, num_nodes, G)`:
  1. pack expert groups onto nodes (balanced packing of group loads: heaviest first, each to
     the lightest node that still has room),
  2. inside each node, give each extra slot to the expert of largest load / replicas,
  3. pack each node's replicas onto its GPUs (the same balanced packing, originals first,
     then the extra replicas in the order step 2 made them).
Its *global* policy is that same function with num_groups = num_nodes = 1; `rebalance_experts`
uses the hierarchical one when num_groups % num_nodes == 0, else the global one.

This file follows those steps in torch, fp32 like the original (which calls `weight.float()`),
with the same `sort(-1, descending=True)` (not a stable sort: ties land as torch orders them),
the same `max(-1).indices` and first-minimum pack choice, vectorized over rows instead of a
Python loop per layer. Checked equal, slot for slot, to the original on random loads with and
without ties (tests/test_eplb_deepseek.py holds our plain-loop transcription of the rules).
"""

from __future__ import annotations

import numpy as np
import torch


def deepseek_phy2log(w_LE: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                     num_gpus: int, mode: str) -> np.ndarray:
    """int64 [L, R]: DeepSeek's placement in `mode` ('hierarchical' or 'global')."""
    if mode == "global":
        num_groups = num_nodes = 1
    w = torch.from_numpy(np.ascontiguousarray(w_LE)).float()
    return _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus).numpy()


def balanced_packing(weight_BN: torch.Tensor, num_packs: int):
    """Each row's N items into num_packs packs of N / num_packs: heaviest first, each to the
    lightest pack with room (the first such pack on ties). -> (pack, rank in pack), [B, N]."""
    B, N = weight_BN.shape
    per_pack = N // num_packs
    if per_pack == 1:
        return (torch.arange(N).expand(B, N).clone(), torch.zeros(B, N, dtype=torch.int64))
    order = weight_BN.float().sort(-1, descending=True).indices
    rows = torch.arange(B)
    pack_w = torch.zeros(B, num_packs, dtype=torch.float32)
    pack_n = torch.zeros(B, num_packs, dtype=torch.int64)
    pack = torch.full((B, N), -1, dtype=torch.int64)
    rank = torch.full((B, N), -1, dtype=torch.int64)
    for i in range(N):
        item = order[:, i]
        p = torch.where(pack_n < per_pack, pack_w, torch.inf).argmin(1)
        pack[rows, item] = p
        rank[rows, item] = pack_n[rows, p]
        pack_w[rows, p] += weight_BN[rows, item]
        pack_n[rows, p] += 1
    return pack, rank


def replicate_experts(weight_BN: torch.Tensor, num_phy: int):
    """Each extra slot to the expert of largest load / replicas (first on ties).
    -> (phy2log [B, num_phy]: originals, then extras in order; replicas per expert [B, N])."""
    B, N = weight_BN.shape
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(B, 1)
    logcnt = torch.ones(B, N, dtype=torch.int64)
    rows = torch.arange(B)
    for i in range(N, num_phy):
        e = (weight_BN / logcnt).max(dim=-1).indices
        phy2log[:, i] = e
        logcnt[rows, e] += 1
    return phy2log, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand(perm.shape))
    return inv


def _hierarchical(w: torch.Tensor, num_phy: int, num_groups: int, num_nodes: int,
                  num_gpus: int) -> torch.Tensor:
    L, E = w.shape
    group_size, groups_per_node = E // num_groups, num_groups // num_nodes
    per_gpu = num_phy // num_gpus
    # 1. groups -> nodes
    pack, rank = balanced_packing(w.unflatten(-1, (num_groups, group_size)).sum(-1), num_nodes)
    log2mlog = (((pack * groups_per_node + rank) * group_size).unsqueeze(-1)
                + torch.arange(group_size)).flatten(-2)
    mlog2log = _inverse(log2mlog)
    # 2. replicas inside each node: [L * num_nodes, E / num_nodes]
    w_mlog = w.gather(-1, mlog2log).view(-1, E // num_nodes)
    phy2mlog, mlogcnt = replicate_experts(w_mlog, num_phy // num_nodes)
    # 3. replicas -> GPUs of the node
    tokens = (w_mlog / mlogcnt).gather(-1, phy2mlog)
    pack, rank = balanced_packing(tokens, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * per_gpu + rank)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    pphy2mlog = (pphy2mlog.view(L, num_nodes, -1)
                 + torch.arange(0, E, E // num_nodes).view(1, -1, 1)).flatten(-2)
    return mlog2log.gather(-1, pphy2mlog)
