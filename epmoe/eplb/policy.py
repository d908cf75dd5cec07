"""Placement modes: `rebalance(weight_LE, num_replicas, num_groups, num_nodes, num_gpus, mode)`.

| mode           | replica counts and packing                       | never worse than            |
|----------------|--------------------------------------------------|-----------------------------|
| "hierarchical" | expert groups -> nodes (each group on one node,  | DeepSeek hierarchical       |
|                | num_groups / num_nodes per node), then replicas  | (rebalance_experts_         |
|                | and packing inside each node                     | hierarchical)               |
| "global"       | replicas over the whole layer, on any GPU        | DeepSeek global (the same   |
|                |                                                  | with 1 group on 1 node)     |

Never worse by construction: per layer, the result is the candidate with the lowest max GPU
load among ours, DeepSeek's same-mode placement, and DeepSeek's placement after our swap
refinement (within nodes in hierarchical mode), ours first on ties. Loads are compared in fp64.

`choose_mode` is the default rule: hierarchical when the model routes group-limited (n_group >
1, topk_group < n_group) and the run spans more than one node, else global. Hierarchical keeps
a token's experts on at most topk_group groups' nodes; global balances better but spreads groups
over nodes (see `epmoe.eplb.traffic` for the traffic each placement implies).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from epmoe.eplb.deepseek import deepseek_phy2log
from epmoe.eplb.packing import greedy_counts, lpt, pack_ours, refine, refine_placement
from epmoe.eplb.placement import Placement, as_f64, max_load

MODES = ("hierarchical", "global")


@dataclass(frozen=True)
class ModeChoice:
    """The placement mode a run uses and why (shown in the report)."""

    mode: str
    reason: str


def choose_mode(n_group: int, topk_group: int, num_nodes: int) -> ModeChoice:
    """The default mode for a model's grouping on `num_nodes` nodes."""
    if not (n_group > 1 and topk_group < n_group):
        return ModeChoice("global", f"routing is not group-limited (n_group {n_group}, "
                                    f"topk_group {topk_group}): no group to keep on a node")
    if num_nodes <= 1:
        return ModeChoice("global", "the run spans one node: nothing to keep inside a node")
    if n_group % num_nodes:
        return ModeChoice("global", f"n_group ({n_group}) is not divisible by the node count "
                                    f"({num_nodes}): groups cannot be spread evenly over nodes")
    return ModeChoice("hierarchical", f"group-limited routing (top {topk_group} of {n_group} "
                                      f"groups) on {num_nodes} nodes: each group stays on one "
                                      f"node, so a token reaches at most {topk_group} nodes")


def rebalance(weight_LE, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
              mode: str) -> Placement:
    """Place `num_replicas` slots per layer on `num_gpus` GPUs for the load `weight_LE` [L, E]."""
    w = as_f64(weight_LE)
    validate(w, num_replicas, num_groups, num_nodes, num_gpus, mode)
    E = w.shape[1]
    if mode == "global":
        ours = pack_ours(w, greedy_counts(w, num_replicas)[0], num_gpus)
        nodes = 1
    else:
        ours = _ours_hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
        nodes = num_nodes
    ds = deepseek_phy2log(w, num_replicas, num_groups, num_nodes, num_gpus, mode)
    cands = np.stack([ours, refine_placement(w, ds, num_gpus, nodes), ds])
    max_CL = np.stack([max_load(w, c, num_gpus) for c in cands])
    best_L = max_CL.argmin(0)  # the first minimum: ours wins ties
    return Placement.from_phy2log(cands[best_L, np.arange(w.shape[0])], E, num_gpus)


def deepseek_rebalance(weight_LE, num_replicas: int, num_groups: int, num_nodes: int,
                       num_gpus: int, mode: str | None = None) -> Placement:
    """DeepSeek EPLB's placement in `mode`; None = DeepSeek's own rule (hierarchical when
    num_groups % num_nodes == 0, else global)."""
    w = as_f64(weight_LE)
    if mode is None:
        mode = "hierarchical" if num_groups % num_nodes == 0 else "global"
    validate(w, num_replicas, num_groups, num_nodes, num_gpus, mode)
    return Placement.from_phy2log(
        deepseek_phy2log(w, num_replicas, num_groups, num_nodes, num_gpus, mode),
        w.shape[1], num_gpus)


def validate(w, num_replicas, num_groups, num_nodes, num_gpus, mode) -> None:
    E = w.shape[1]
    if mode not in MODES:
        raise ValueError(f"mode ({mode!r}) must be one of {MODES}; choose_mode() gives the "
                         f"default for a model and topology")
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups),
                    ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} ({v!r}) must be a positive int")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) must be divisible by num_gpus "
                         f"({num_gpus}): every GPU holds the same number of slots; use a "
                         f"multiple of {num_gpus}")
    if num_replicas < E:
        raise ValueError(f"num_replicas ({num_replicas}) must be >= num_experts ({E}): every "
                         f"logical expert needs a slot; add redundant slots")
    if mode == "global":
        return
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes}) "
                         f"for the hierarchical mode: every node has the same number of GPUs")
    if E % num_groups:
        raise ValueError(f"num_experts ({E}) must be divisible by num_groups ({num_groups}) "
                         f"for the hierarchical mode; pass the model's n_group")
    if num_groups % num_nodes:
        raise ValueError(f"num_groups ({num_groups}) must be divisible by num_nodes "
                         f"({num_nodes}) for the hierarchical mode; use mode='global'")


def _groups_to_nodes(gw_LN, num_nodes):
    """int64 [L, num_groups]: groups in node-major order (node n holds the n-th block of
    num_groups / num_nodes). Heaviest group to the lightest node with room, then swaps of
    groups between nodes while the heaviest node's load drops."""
    L, N = gw_LN.shape
    per = N // num_nodes
    o = np.argsort(-gw_LN, axis=1, kind="stable")
    load = np.take_along_axis(gw_LN, o, 1)
    node, _ = lpt(load, None, np.zeros((L, num_nodes)), np.full((L, num_nodes), per))
    by_node = np.argsort(node, axis=1, kind="stable")
    group_BGS = np.take_along_axis(o, by_node, 1).reshape(L, num_nodes, per)
    load_BGS = np.take_along_axis(load, by_node, 1).reshape(L, num_nodes, per)
    refine(load_BGS, group_BGS, N)
    return group_BGS.reshape(L, N)


def _ours_hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus):
    L, E = w.shape
    gs = E // num_groups
    groups = _groups_to_nodes(w.reshape(L, num_groups, gs).sum(-1), num_nodes)
    mlog2log = (groups[:, :, None] * gs + np.arange(gs)).reshape(L, E)  # node-major experts
    w_node = np.take_along_axis(w, mlog2log, 1).reshape(L * num_nodes, E // num_nodes)
    cnt, _ = greedy_counts(w_node, num_replicas // num_nodes)
    p = pack_ours(w_node, cnt, num_gpus // num_nodes)  # node-local expert ids
    p = p.reshape(L, num_nodes, -1) + (np.arange(num_nodes) * (E // num_nodes))[:, None]
    return np.take_along_axis(mlog2log, p.reshape(L, -1), 1)
