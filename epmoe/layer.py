"""MoELayer = router -> comm.dispatch -> experts -> comm.combine (+ shared experts).

Everything that varies is injected: the parallel form (`LayerPlan`), the comm backend, the
experts backend, and an optional EPLB `ReplicaMap` (logical -> physical slots). The layer
itself is the same code on one rank and on many.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epmoe.comm.base import Comm
from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import Experts
from epmoe.parallel import LayerPlan
from epmoe.quant import quantize_act
from epmoe.router import ReplicaMap, Routing, route
from epmoe.timing import StageTimer
from epmoe.weights import LayerWeights


class MoELayer:
    def __init__(self, cfg: MoEConfig, quant: QuantConfig, weights: LayerWeights,
                 plan: LayerPlan, comm: Comm, experts: Experts,
                 shared_experts: Experts | None = None, replica_map: ReplicaMap | None = None,
                 group=None, timer: StageTimer | None = None):
        self.cfg, self.quant, self.weights, self.plan = cfg, quant, weights, plan
        self.comm, self.experts, self.shared_experts = comm, experts, shared_experts
        self.replica_map = replica_map
        self.group = group
        self.timer = timer or StageTimer(enabled=False)
        experts.timer = self.timer  # routed experts only: "shared" is timed as one stage
        comm.timer = self.timer
        self.last_routing: Routing | None = None  # logical routing of the last call (for stats)
        self.last_physical_ids: torch.Tensor | None = None

    def route(self, x_TD: torch.Tensor) -> Routing:
        logits = x_TD.float() @ self.weights.gate_ED.T
        return route(logits, self.cfg, self.weights.bias_E)

    def forward(self, x_TD: torch.Tensor, routing: Routing | None = None,
                token_offset: int = 0) -> torch.Tensor:
        """x [T, D] bf16 -> out [T, D] bf16. routing: precomputed logical routing (synthetic
        or replayed), else the layer's router. token_offset: the global index of this rank's
        first token (replica choice is a function of the global token index)."""
        if x_TD.dim() != 2 or x_TD.shape[1] != self.cfg.hidden:
            raise ValueError(f"x must be [T, hidden={self.cfg.hidden}], got {tuple(x_TD.shape)}")
        t = self.timer
        with t.stage("router"):
            if routing is None:
                routing = self.route(x_TD)
            ids, w = routing.topk_ids_TK, routing.topk_weights_TK
            if self.replica_map is not None:
                ids = self.replica_map.to_physical(ids, token_offset)
        self.last_routing, self.last_physical_ids = routing, ids
        x_in = x_TD
        if self.cfg.apply_router_weight_on_input:
            # top_k == 1 (checked by the config): scale the token, combine with weight 1
            x_in = (x_TD.float() * w[:, :1]).to(x_TD.dtype)
            w = torch.ones_like(w)
        with t.stage("dispatch"):
            batch, handle = self.comm.dispatch(x_in, ids, w)
        with t.stage("experts"):
            y = self.experts.run(batch)
        with t.stage("combine"):
            out = self.comm.combine(y, handle)  # bf16 [T, D], reduced in fp32 and cast once
        if self.weights.shared is not None and self.shared_experts is not None:
            with t.stage("shared"):
                out = out.float() + self._shared(x_TD).float()
        if self.plan.needs_all_reduce:
            # replicated forms: each rank holds a partial sum; summed in fp32
            with t.stage("all_reduce"):
                out = out.float()
                dist.all_reduce(out, group=self.group)
        return out.to(x_TD.dtype)

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor:
        n = x_TD.shape[0]
        ids = torch.zeros(n, 1, dtype=torch.int32, device=x_TD.device)
        w = torch.ones(n, 1, dtype=torch.float32, device=x_TD.device)
        return self.shared_experts.apply(quantize_act(x_TD, self.quant), ids, w)
