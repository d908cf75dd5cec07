"""The `Placement` type: which logical expert each physical slot holds, per MoE layer, and the
load arithmetic every policy shares (numpy, fp64, vectorized over layers).

Shapes: L layers, E logical experts, R physical slots (replicas), G GPUs, S = R / G slots per
GPU. Slot s lives on GPU s // S; GPU g on node g // (G / num_nodes). A replica of expert e
carries w_e / cnt_e of its load (tokens are spread evenly over an expert's replicas).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Placement:
    """Replica placement for L layers. Slot s of a layer lives on GPU s // slots_per_gpu."""

    phy2log: torch.Tensor  # int64 [L, R]: logical expert held by each physical slot
    log2phy: torch.Tensor  # int64 [L, E, max_replicas]: slots of each expert, ascending, -1 pad
    logcnt: torch.Tensor  # int64 [L, E]: replica count per logical expert (>= 1)
    num_gpus: int

    @classmethod
    def from_phy2log(cls, phy2log_LR, num_experts: int, num_gpus: int) -> Placement:
        p = np.asarray(phy2log_LR, dtype=np.int64)
        L, R = p.shape
        cnt = counts(p, num_experts)
        order = np.argsort(p, axis=1, kind="stable")  # slots grouped by expert, ascending
        start = np.cumsum(cnt, 1) - cnt
        e_sorted = np.take_along_axis(p, order, 1)
        occ = np.arange(R)[None, :] - np.take_along_axis(start, e_sorted, 1)
        log2phy = np.full((L, num_experts, max(int(cnt.max()), 1)), -1, np.int64)
        log2phy[np.arange(L)[:, None], e_sorted, occ] = order
        return cls(torch.from_numpy(p.copy()), torch.from_numpy(log2phy),
                   torch.from_numpy(cnt), num_gpus)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_experts(self) -> int:
        return self.logcnt.shape[1]

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    def gpu_loads(self, weight_LE) -> torch.Tensor:
        """fp64 [L, G]: load per GPU, an expert's load split evenly over its replicas."""
        return torch.from_numpy(gpu_loads(as_f64(weight_LE), self.phy2log.numpy(),
                                          self.logcnt.numpy(), self.num_gpus))

    def max_load(self, weight_LE) -> torch.Tensor:
        """fp64 [L]: the load of the busiest GPU, per layer (the objective)."""
        return self.gpu_loads(weight_LE).max(1).values

    def balancedness(self, weight_LE) -> torch.Tensor:
        """fp64 [L]: mean / max GPU load (1.0 = perfect; a layer with no load counts as 1.0)."""
        return torch.from_numpy(balancedness(self.gpu_loads(weight_LE).numpy()))

    def groups_on_nodes(self, num_groups: int, num_nodes: int) -> torch.Tensor:
        """bool [L]: every expert group's replicas live on one node, and every node holds
        num_groups / num_nodes whole groups (what the hierarchical mode guarantees)."""
        return torch.from_numpy(groups_on_nodes(self.phy2log.numpy(), self.num_experts,
                                                num_groups, num_nodes))


def as_f64(weight_LE) -> np.ndarray:
    """Loads as a validated fp64 numpy array [L, E]."""
    w = weight_LE.detach().cpu().double().numpy() if isinstance(weight_LE, torch.Tensor) \
        else np.asarray(weight_LE, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"weight_LE must be 2-D [num_layers, num_experts], got shape "
                         f"{tuple(w.shape)}; stack per-layer loads into one tensor")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weight_LE must be finite and >= 0 (token counts per expert); "
                         "clean NaN/inf/negative entries first")
    return w


def counts(idx_BN, num_bins, mask_BN=None) -> np.ndarray:
    """int64 [B, num_bins]: how often each value occurs per row (only where mask_BN)."""
    B = idx_BN.shape[0]
    flat = (idx_BN + np.arange(B)[:, None] * num_bins).ravel()
    wts = None if mask_BN is None else mask_BN.ravel().astype(np.int64)
    return np.bincount(flat, wts, minlength=B * num_bins).astype(np.int64).reshape(B, num_bins)


def gpu_loads(w_LE, phy2log_LR, cnt_LE, num_gpus) -> np.ndarray:
    """fp64 [L, G]: per GPU, the sum of its replicas' loads w_e / cnt_e."""
    L, R = phy2log_LR.shape
    slot = np.take_along_axis(w_LE / cnt_LE, phy2log_LR, 1)
    return slot.reshape(L, num_gpus, R // num_gpus).sum(-1)


def max_load(w_LE, phy2log_LR, num_gpus, cnt_LE=None) -> np.ndarray:
    """fp64 [L]: the busiest GPU's load (the quantity every mode is compared on)."""
    if cnt_LE is None:
        cnt_LE = counts(phy2log_LR, w_LE.shape[1])
    return gpu_loads(w_LE, phy2log_LR, cnt_LE, num_gpus).max(1)


def balancedness(load_LG) -> np.ndarray:
    mx = load_LG.max(1)
    return np.where(mx > 0, load_LG.mean(1) / np.where(mx > 0, mx, 1), 1.0)


def groups_on_nodes(phy2log_LR, num_experts, num_groups, num_nodes) -> np.ndarray:
    L, R = phy2log_LR.shape
    if num_experts % num_groups or num_groups % num_nodes or R % num_nodes:
        return np.zeros(L, bool)
    node_of_slot = np.arange(R) // (R // num_nodes)
    grp = phy2log_LR // (num_experts // num_groups)
    # per layer x group: the set of nodes its slots lie on must be a single node
    seen = np.zeros((L, num_groups, num_nodes), bool)
    seen[np.arange(L)[:, None], grp, node_of_slot[None, :]] = True
    one_node = (seen.sum(-1) == 1).all(1)
    per_node = seen.sum(1)  # groups per node
    return one_node & (per_node == num_groups // num_nodes).all(1)
