"""What a placement costs in traffic: how many ranks and nodes a token reaches, and the
inter-node bytes per step. Plain functions of (placement, routing) for the rebalancer, the
reports and the planner's cost model.

A token's k-th expert e is served by replica r = (global token index + k) mod cnt_e (the
`ReplicaMap` rule), i.e. slot log2phy[e, r] on rank slot // S, node rank // (G / num_nodes).

- `traffic_from_routing(placement, topk_ids_LTK, num_nodes, ...)`: from recorded routing.
- `routing_from_loads(weight_LE, top_k, n_group, topk_group, ...)`: a routing sample with the
  model's group structure (a token keeps topk_group of n_group groups, drawn by group load,
  then top_k experts inside them, drawn by expert load); seeded, so estimates are repeatable.
- `traffic_from_loads(...)`: the two together, when no routing was recorded.

Inter-node bytes count, per token and layer, one copy per remote node it reaches (a node-
deduplicated transport such as DeepEP's internode kernels: RDMA once per node, NVLink inside)
times `token_bytes` (the dispatch row plus the combine row that come back). A transport that
sends once per rank moves more: `ranks_per_token` gives that count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.eplb.placement import Placement


@dataclass(frozen=True)
class Traffic:
    """Expected per-token fan-out of one placement, per layer, and the step's inter-node bytes.

    ranks_per_token_L         fp64 [L]  distinct ranks holding a token's top-k replicas
    nodes_per_token_L         fp64 [L]  distinct nodes among them
    remote_nodes_per_token_L  fp64 [L]  those other than the token's own node
    internode_bytes_per_step  float     sum over layers of tokens_per_step x remote nodes x
                                        token_bytes
    """

    ranks_per_token_L: torch.Tensor
    nodes_per_token_L: torch.Tensor
    remote_nodes_per_token_L: torch.Tensor
    internode_bytes_per_step: float

    def summary(self) -> dict:
        """Means over layers (JSON-ready)."""
        return dict(ranks_per_token=float(self.ranks_per_token_L.mean()),
                    nodes_per_token=float(self.nodes_per_token_L.mean()),
                    remote_nodes_per_token=float(self.remote_nodes_per_token_L.mean()),
                    internode_bytes_per_step=self.internode_bytes_per_step)


def physical_ids(placement: Placement, topk_ids_LTK: torch.Tensor, token_offset: int = 0):
    """int64 [L, T, K]: the slot each (token, k) is served by under `placement`."""
    L, T, K = topk_ids_LTK.shape
    ids = topk_ids_LTK.long().cpu()
    layer = torch.arange(L)[:, None, None]
    cnt = placement.logcnt[layer, ids]
    r = (torch.arange(T)[None, :, None] + token_offset + torch.arange(K)[None, None, :]) % cnt
    return placement.log2phy[layer, ids, r]


def _distinct(x_LTK: torch.Tensor) -> torch.Tensor:
    s = x_LTK.sort(-1).values
    return 1 + (s[..., 1:] != s[..., :-1]).sum(-1)


def traffic_from_routing(placement: Placement, topk_ids_LTK: torch.Tensor, num_nodes: int, *,
                         token_bytes: int, tokens_per_step: int | None = None,
                         src_rank_T: torch.Tensor | None = None,
                         token_offset: int = 0) -> Traffic:
    """Fan-out of the routed tokens `topk_ids_LTK` (logical ids, [L, T, K]) under `placement`.

    tokens_per_step  scales the sample to a step (default: T, the sample is the step)
    src_rank_T       each token's own rank; None: tokens spread evenly over the ranks, so a
                     token's own node is among the nodes it reaches with probability 1/num_nodes
                     per reached node
    """
    L, T, K = topk_ids_LTK.shape
    G = placement.num_gpus
    if placement.num_layers != L:
        raise ValueError(f"topk_ids_LTK has {L} layers but the placement {placement.num_layers}: "
                         f"pass one routing per placed layer")
    if G % num_nodes:
        raise ValueError(f"num_gpus ({G}) must be divisible by num_nodes ({num_nodes}): every "
                         f"node has the same number of ranks")
    rank = physical_ids(placement, topk_ids_LTK, token_offset) // placement.slots_per_gpu
    node = rank // (G // num_nodes)
    ranks = _distinct(rank).double()
    nodes = _distinct(node).double()
    if src_rank_T is None:
        remote = nodes * (1 - 1 / num_nodes)
    else:
        src_node = (src_rank_T.long().cpu() // (G // num_nodes))[None, :, None]
        remote = nodes - (node == src_node).any(-1).double()
    per_layer = remote.mean(1)
    n = T if tokens_per_step is None else tokens_per_step
    return Traffic(ranks.mean(1), nodes.mean(1), per_layer,
                   float(per_layer.sum()) * n * token_bytes)


def routing_from_loads(weight_LE, top_k: int, n_group: int = 1, topk_group: int = 1,
                       num_tokens: int = 1024, seed: int = 0) -> torch.Tensor:
    """int64 [L, T, K]: a routing sample that follows the loads and the group limit."""
    w = torch.as_tensor(weight_LE, dtype=torch.float64).cpu()
    L, E = w.shape
    if E % n_group or not 1 <= topk_group <= n_group or top_k > topk_group * (E // n_group):
        raise ValueError(f"num_experts ({E}), n_group ({n_group}), topk_group ({topk_group}) "
                         f"and top_k ({top_k}): need E % n_group == 0, topk_group <= n_group "
                         f"and top_k <= topk_group * E / n_group (the model's config)")
    # every expert keeps a little probability, so each kept group can supply top_k experts
    p = w / w.sum(1, keepdim=True).clamp(min=1e-300) + 1e-6 / E
    gen = torch.Generator().manual_seed(seed)
    p_T = p.repeat_interleave(num_tokens, 0)  # [L*T, E]
    if topk_group < n_group:
        groups = torch.multinomial(p_T.view(-1, n_group, E // n_group).sum(-1), topk_group,
                                   generator=gen)
        keep = torch.zeros(L * num_tokens, n_group, dtype=torch.bool).scatter_(1, groups, True)
        p_T = p_T * keep.repeat_interleave(E // n_group, 1)
    ids = torch.multinomial(p_T, top_k, generator=gen)
    return ids.view(L, num_tokens, top_k)


def traffic_from_loads(placement: Placement, weight_LE, num_nodes: int, *, top_k: int,
                       n_group: int = 1, topk_group: int = 1, token_bytes: int,
                       tokens_per_step: int, num_tokens: int = 1024, seed: int = 0) -> Traffic:
    """`traffic_from_routing` on `routing_from_loads` (no recorded routing)."""
    ids = routing_from_loads(weight_LE, top_k, n_group, topk_group, num_tokens, seed)
    return traffic_from_routing(placement, ids, num_nodes, token_bytes=token_bytes,
                                tokens_per_step=tokens_per_step)


def tradeoff(balancedness_old: float, balancedness_new: float, old: Traffic,
             new: Traffic, rel_tol: float = 0.01) -> str | None:
    """A sentence when the new placement balances better but sends more bytes between nodes
    (more than rel_tol more), else None."""
    more = new.internode_bytes_per_step > old.internode_bytes_per_step * (1 + rel_tol)
    if balancedness_new > balancedness_old and more:
        return (f"balancedness {balancedness_old:.3f} -> {balancedness_new:.3f} at the cost of "
                f"inter-node traffic {_mb(old.internode_bytes_per_step)} -> "
                f"{_mb(new.internode_bytes_per_step)} MB/step (nodes per token "
                f"{float(old.nodes_per_token_L.mean()):.2f} -> "
                f"{float(new.nodes_per_token_L.mean()):.2f})")
    return None


def _mb(b: float) -> str:
    return f"{b / 1e6:.2f}"
