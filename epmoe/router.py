"""Routers: fp32 gate logits -> (topk_weights_TK fp32, topk_ids_TK), and the replica hook.

Kinds (MoEConfig.router):
- softmax: softmax over all experts, top-k, optionally renormalized (Qwen3, Mixtral, gpt-oss);
  a bias, when given, is added to the logits first (gpt-oss's router: logits = x W^T + b).
- sigmoid_grouped (DeepSeek-V3 / Kimi-K2 "noaux_tc"): s = sigmoid(logits); selection on
  s + e_score_correction_bias, limited to the topk_group best of n_group groups (a group's score
  is the sum of its top-2 biased scores); weights are the UNBIASED s of the chosen experts,
  renormalized if configured, times routed_scaling_factor.
- sqrtsoftplus (DeepSeek-V4 style): s = sqrt(softplus(logits)); selection on s + bias; weights
  from unbiased s, renormalized, times routed_scaling_factor.
Ids are signed (int32 default, int64 on request); -1 marks an empty slot (weight 0).

EPLB hook: `ReplicaMap` maps logical expert ids to physical slots; a token's replica is chosen
deterministically and evenly by (token index + slot) modulo the expert's replica count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.config import MoEConfig


@dataclass(frozen=True)
class Routing:
    """Router output for T tokens.

    topk_ids_TK      int32/int64 [T, K]  logical (or, after ReplicaMap, physical) expert ids; -1 empty
    topk_weights_TK  fp32 [T, K]         combine weights (0 on empty slots)
    """

    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor


def _check_logits(logits_TE: torch.Tensor, cfg: MoEConfig) -> None:
    if logits_TE.dim() != 2 or logits_TE.shape[1] != cfg.num_experts:
        raise ValueError(f"router logits must be [T, num_experts={cfg.num_experts}], got "
                         f"{tuple(logits_TE.shape)}")
    if not logits_TE.is_floating_point():
        raise ValueError(f"router logits must be floating point, got {logits_TE.dtype}")


def _fast_path(t: torch.Tensor, cfg: MoEConfig, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend ({backend!r}) must be 'auto', 'triton' or 'torch'")
    if backend == "torch" or (backend == "auto" and not t.is_cuda):
        return False
    from epmoe.kernels.gate_topk import unsupported

    why = unsupported(cfg)
    if why is not None and backend == "triton":
        raise ValueError(f"the Triton router cannot run this config: {why}; use "
                         f"backend='torch'")
    return why is None


def group_best(cfg: MoEConfig) -> int:
    """A group's score is the sum of its this many best selection scores: 2 for the score
    routers (DeepSeek-V3), 1 for the softmax router (DeepSeek-V2's group_limited_greedy)."""
    return 1 if cfg.router == "softmax" else 2


def _keep_groups(sel: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """sel [T, E] with the experts outside each token's topk_group best groups at -inf."""
    t = sel.shape[0]
    grouped = sel.view(t, cfg.n_group, -1)
    group_scores = grouped.topk(min(group_best(cfg), grouped.shape[-1]), dim=-1).values.sum(-1)
    keep = torch.topk(group_scores, cfg.topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return sel.masked_fill(~mask.unsqueeze(-1).expand_as(grouped).reshape(t, -1), float("-inf"))


def route(logits_TE: torch.Tensor, cfg: MoEConfig, bias_E: torch.Tensor | None = None,
          id_dtype: torch.dtype = torch.int32, backend: str = "auto") -> Routing:
    """Select top_k experts per token. Computation in fp32 whatever the logits dtype.

    backend: 'auto' = the Triton kernel (`epmoe.kernels.gate_topk`) on CUDA when it supports
    the config, else this module's torch code (the reference); 'triton'; 'torch'."""
    _check_logits(logits_TE, cfg)
    if id_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"id_dtype must be torch.int32 or torch.int64, got {id_dtype}")
    if _fast_path(logits_TE, cfg, backend):
        from epmoe.kernels.gate_topk import triton_route_logits

        logits = logits_TE if logits_TE.stride(1) == 1 else logits_TE.contiguous()
        ids, w = triton_route_logits(logits, cfg, bias_E)
        return Routing(ids.to(id_dtype), w)
    scores, biased = _scores(logits_TE.float(), cfg, bias_E)
    if cfg.n_group > 1:
        biased = _keep_groups(biased, cfg)
    ids = torch.topk(biased, cfg.top_k, dim=-1).indices
    return Routing(ids.to(id_dtype), _weights(scores, ids, cfg))


def _scores(logits: torch.Tensor, cfg: MoEConfig, bias_E) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (scores the weights come from, scores the selection ranks)."""
    if cfg.router == "softmax":
        if bias_E is not None:  # gpt-oss's router bias: part of the logits
            logits = logits + bias_E.float()
        scores = torch.softmax(logits, dim=-1)
        return scores, scores
    scores = torch.sigmoid(logits) if cfg.router == "sigmoid_grouped" else \
        torch.softmax(logits, dim=-1) if cfg.router == "softmax_biased" else \
        torch.sqrt(torch.nn.functional.softplus(logits))
    return scores, (scores if bias_E is None else scores + bias_E.float())


def _weights(scores: torch.Tensor, ids: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """The chosen experts' scores, renormalized as configured, x routed_scaling_factor."""
    w = scores.gather(1, ids)
    if cfg.renormalize:
        w = w / (w.sum(-1, keepdim=True) + cfg.renorm_eps).clamp(min=1e-20)
    return (w * cfg.routed_scaling_factor).float()


@dataclass(frozen=True)
class TokenIds:
    """A hash layer's routing input: the token id of each of its rows (int [T]); the layer
    looks its experts up in its table (`hash_route`)."""

    token_ids_T: torch.Tensor


def hash_route(logits_TE: torch.Tensor, cfg: MoEConfig, tid2eid_VK: torch.Tensor,
               token_ids_T: torch.Tensor, id_dtype: torch.dtype = torch.int32,
               backend: str = "auto") -> Routing:
    """DeepSeek-V4's hash layers: the experts tid2eid[token id] (no selection, no bias); their
    weights the router's scores of those experts (cfg.router's score function), renormalized
    as configured, x routed_scaling_factor. Device ops only (CUDA-graph capturable).
    backend as `route`'s (the Triton kernel: `gate_topk.triton_hash_route`)."""
    _check_logits(logits_TE, cfg)
    _check_hash(logits_TE.shape[0], cfg, tid2eid_VK, token_ids_T, id_dtype)
    if _fast_path(logits_TE, cfg, backend):
        from epmoe.kernels.gate_topk import triton_hash_route

        logits = logits_TE if logits_TE.stride(1) == 1 else logits_TE.contiguous()
        ids, w = triton_hash_route(None, None, tid2eid_VK, token_ids_T, cfg, logits_TE=logits)
        return Routing(ids.to(id_dtype), w)
    scores, _ = _scores(logits_TE.float(), cfg, None)
    ids = tid2eid_VK[token_ids_T.long()].long()
    return Routing(ids.to(id_dtype), _weights(scores, ids, cfg))


def hash_gate_route(x_TD: torch.Tensor, gate_ED: torch.Tensor, cfg: MoEConfig,
                    tid2eid_VK: torch.Tensor, token_ids_T: torch.Tensor,
                    id_dtype: torch.dtype = torch.int32, backend: str = "auto") -> Routing:
    """Gate GEMM + a hash layer's routing (`hash_route`'s rules). On CUDA ('auto') the gate
    GEMM in bf16 with fp32 accumulation, split or fused as `route_tokens`' (the experts come
    from the table: only the weights see the bf16 GEMM's ~1e-3 relative logit error);
    elsewhere, or backend='torch', fp32 logits and the torch path (the reference)."""
    _check_gate(x_TD, gate_ED, cfg)
    _check_hash(x_TD.shape[0], cfg, tid2eid_VK, token_ids_T, id_dtype)
    if _fast_path(x_TD, cfg, backend):
        from epmoe.kernels.gate_topk import triton_hash_route

        ids, w = triton_hash_route(x_TD, gate_ED, tid2eid_VK, token_ids_T, cfg)
        return Routing(ids.to(id_dtype), w)
    return hash_route(x_TD.float() @ gate_ED.float().T, cfg, tid2eid_VK, token_ids_T,
                      id_dtype, backend="torch")


def _check_hash(t: int, cfg: MoEConfig, tid2eid_VK, token_ids_T, id_dtype) -> None:
    if tid2eid_VK.dim() != 2 or tid2eid_VK.shape[1] != cfg.top_k:
        raise ValueError(f"tid2eid must be [vocab, top_k={cfg.top_k}], got "
                         f"{tuple(tid2eid_VK.shape)}")
    if token_ids_T.shape != (t,):
        raise ValueError(f"token ids must be [T={t}], got {tuple(token_ids_T.shape)}")
    if token_ids_T.is_floating_point() or tid2eid_VK.is_floating_point():
        raise ValueError(f"token ids ({token_ids_T.dtype}) and tid2eid ({tid2eid_VK.dtype}) "
                         f"must be integers")
    if id_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"id_dtype must be torch.int32 or torch.int64, got {id_dtype}")


def route_tokens(x_TD: torch.Tensor, gate_ED: torch.Tensor, cfg: MoEConfig,
                 bias_E: torch.Tensor | None = None, id_dtype: torch.dtype = torch.int32,
                 backend: str = "auto") -> Routing:
    """Gate GEMM + routing: logits = x [T, D] @ gate [E, D].T, then `route`.

    On CUDA ('auto', when the kernel supports the config) a bf16 GEMM with fp32 accumulation
    and the routing kernel, split or fused as `epmoe.kernels.gate_topk.gate_way` picks (keep
    gate_ED in bf16 to skip a cast per call). Elsewhere, or backend='torch': fp32 logits
    `x.float() @ gate.float().T` and the torch router, the reference. The bf16 GEMM moves
    logits by ~1e-3 relative to the fp32 product, so ids can differ from the fp32 path where
    two candidates are that close."""
    _check_gate(x_TD, gate_ED, cfg)
    if id_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"id_dtype must be torch.int32 or torch.int64, got {id_dtype}")
    if _fast_path(x_TD, cfg, backend):
        from epmoe.kernels.gate_topk import triton_gate_route

        ids, w = triton_gate_route(x_TD, gate_ED, cfg, bias_E)
        return Routing(ids.to(id_dtype), w)
    return route(x_TD.float() @ gate_ED.float().T, cfg, bias_E, id_dtype, backend="torch")


def _check_gate(x_TD: torch.Tensor, gate_ED: torch.Tensor, cfg: MoEConfig) -> None:
    if x_TD.dim() != 2 or gate_ED.dim() != 2 or x_TD.shape[1] != gate_ED.shape[1]:
        raise ValueError(f"x {tuple(x_TD.shape)} and gate {tuple(gate_ED.shape)} must be "
                         f"[T, D] and [E, D]")
    if gate_ED.shape[0] != cfg.num_experts:
        raise ValueError(f"gate has {gate_ED.shape[0]} rows but num_experts is "
                         f"{cfg.num_experts}")


@dataclass(frozen=True)
class ReplicaMap:
    """Logical -> physical expert slots of one layer (EPLB).

    log2phy_ER  int64 [E, R_max]  physical slots of each logical expert, padded with -1
    logcnt_E    int64 [E]         replicas per logical expert (>= 1)
    """

    log2phy_ER: torch.Tensor
    logcnt_E: torch.Tensor

    @staticmethod
    def identity(num_experts: int, device=None) -> "ReplicaMap":
        ids = torch.arange(num_experts, device=device)
        return ReplicaMap(ids[:, None].clone(), torch.ones(num_experts, dtype=torch.long,
                                                            device=device))

    def to_physical(self, topk_ids_TK: torch.Tensor, token_offset: int = 0) -> torch.Tensor:
        """Replica r = (global token index + k) mod count(expert); -1 stays -1."""
        t, k = topk_ids_TK.shape
        ids = topk_ids_TK.long()
        valid = ids >= 0
        safe = ids.clamp(min=0)
        cnt = self.logcnt_E.to(ids.device)[safe]
        tok = torch.arange(t, device=ids.device)[:, None] + token_offset
        r = (tok + torch.arange(k, device=ids.device)[None, :]) % cnt
        phys = self.log2phy_ER.to(ids.device)[safe, r]
        return torch.where(valid, phys, torch.full_like(phys, -1)).to(topk_ids_TK.dtype)
