"""MoELayer = router -> comm.dispatch -> experts -> comm.combine (+ shared experts).

Everything that varies is injected: the parallel form (`LayerPlan`), the comm backend, the
experts backend, and an optional EPLB `ReplicaMap` (logical -> physical slots). The layer
itself is the same code on one rank and on many.

Overlap (epmoe.overlap): on CUDA the shared experts run on a side stream concurrently with
dispatch -> experts -> combine (`overlap_shared`, default on); `micro_batches=2` splits the
tokens in two so that one half's dispatch/combine overlaps the other half's expert GEMMs
(meant for ep >= 2). Both give the same result as the plain order (tested on CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epmoe.comm.base import Comm
from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import Experts
from epmoe.overlap import LayerStreams
from epmoe.plan.forms import LayerPlan
from epmoe.router import ReplicaMap, Routing, TokenIds, hash_gate_route, route_tokens
from epmoe.timing import StageTimer
from epmoe.weights import LayerWeights


class MoELayer:
    def __init__(self, cfg: MoEConfig, quant: QuantConfig, weights: LayerWeights,
                 plan: LayerPlan, comm: Comm, experts: Experts,
                 shared_experts: Experts | None = None, replica_map: ReplicaMap | None = None,
                 group=None, timer: StageTimer | None = None, overlap_shared: bool = True,
                 micro_batches: int = 1):
        self.cfg, self.quant, self.weights, self.plan = cfg, quant, weights, plan
        self.comm, self.experts, self.shared_experts = comm, experts, shared_experts
        self.replica_map = replica_map
        self.group = group
        self.timer = timer or StageTimer(enabled=False)
        experts.timer = self.timer  # routed experts only: "shared" is timed as one stage
        comm.timer = self.timer
        self.last_routing: Routing | None = None  # logical routing of the last call (for stats)
        self.last_physical_ids: torch.Tensor | None = None
        if micro_batches not in (1, 2):
            raise ValueError(f"micro_batches ({micro_batches}) must be 1 or 2")
        self.overlap_shared, self.micro_batches = overlap_shared, micro_batches
        self.streams = LayerStreams(weights.gate_ED.device)
        # the router's bf16 gate (CUDA); on CPU the fp32 gate and the torch router
        self._gate_bf16 = weights.gate_ED.to(torch.bfloat16) if weights.gate_ED.is_cuda \
            else None

    def route(self, x_TD: torch.Tensor, token_ids: TokenIds | None = None) -> Routing:
        """Gate GEMM + top-k on CUDA: cuBLAS's bf16 GEMM (fp32 out) then the routing kernel,
        or one fused Triton launch, as `epmoe.kernels.gate_topk.gate_way` picks; the fp32
        torch reference elsewhere (`epmoe.router.route_tokens`). A hash layer (its
        weights hold a token-id table) takes its experts from the table by `token_ids`, its
        weights from the same logits (`epmoe.router.hash_gate_route`: fused on CUDA too)."""
        tid2eid = self.weights.tid2eid_VK
        gate = self._gate_bf16 if self._gate_bf16 is not None and x_TD.is_cuda \
            else self.weights.gate_ED
        if tid2eid is not None:
            if token_ids is None:
                raise ValueError("a hash layer routes by token id: give the rows' TokenIds")
            return hash_gate_route(x_TD, gate, self.cfg, tid2eid, token_ids.token_ids_T)
        return route_tokens(x_TD, gate, self.cfg, self.weights.bias_E)

    def route_physical(self, x_TD: torch.Tensor, routing: Routing | TokenIds | None,
                       token_offset: int = 0) -> tuple[Routing, torch.Tensor]:
        """The router stage: the logical routing (the router's unless given; a hash layer's
        from its rows' token ids) and its physical ids (replica choice when the layer has a
        replica map)."""
        if routing is None or isinstance(routing, TokenIds):
            routing = self.route(x_TD, routing)
        ids = routing.topk_ids_TK
        if self.replica_map is not None:
            ids = self.replica_map.to_physical(ids, token_offset)
        return routing, ids

    def forward(self, x_TD: torch.Tensor, routing: Routing | TokenIds | None = None,
                token_offset: int = 0) -> torch.Tensor:
        """x [T, D] bf16 -> out [T, D] bf16. routing: precomputed logical routing (synthetic
        or replayed), else the layer's router (a hash layer's: given the rows' TokenIds).
        token_offset: the global index of this rank's first token (replica choice is a
        function of the global token index)."""
        if x_TD.dim() != 2 or x_TD.shape[1] != self.cfg.hidden:
            raise ValueError(f"x must be [T, hidden={self.cfg.hidden}], got {tuple(x_TD.shape)}")
        t = self.timer
        with t.stage("router"):
            routing, ids = self.route_physical(x_TD, routing, token_offset)
        w = routing.topk_weights_TK
        self.last_routing, self.last_physical_ids = routing, ids
        x_in = x_TD
        if self.cfg.apply_router_weight_on_input:
            # top_k == 1 (checked by the config): scale the token, combine with weight 1
            x_in = (x_TD.float() * w[:, :1]).to(x_TD.dtype)
            w = torch.ones_like(w)
        has_shared = self.weights.shared is not None and self.shared_experts is not None
        st = self.streams
        side = has_shared and self.overlap_shared and st.cuda
        if side:  # forked now: runs while the routed path below is issued and runs
            with st.on(st.shared, reads=x_TD), t.stage("shared"):
                shared_out = self._shared(x_TD)
            shared_done = st.mark(st.shared)
        if self.micro_batches == 2 and x_in.shape[0] >= 2:
            out = self._routed_micro_batches(x_in, ids, w)
        else:
            with t.stage("dispatch"):
                batch, handle = self.comm.dispatch(x_in, ids, w)
            with t.stage("experts"):
                y = self.experts.run(batch)
            with t.stage("combine"):
                out = self.comm.combine(y, handle)  # bf16 [T, D], fp32-reduced, cast once
        if has_shared:
            if side:
                st.wait(shared_done, reads=shared_out)
            else:
                with t.stage("shared"):
                    shared_out = self._shared(x_TD)
            out = out.float() + shared_out.float()
        if self.plan.needs_all_reduce:
            # replicated forms: each rank holds a partial sum; summed in fp32
            with t.stage("all_reduce"):
                out = out.float()
                dist.all_reduce(out, group=self.group)
        return out.to(x_TD.dtype)

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The shared MLP over every token: plain GEMMs (no permute / gather), bf16 [T, D]; with
        a shared gate (Qwen2-MoE) x sigmoid(x . w_g) per token, in fp32."""
        ex, g = self.shared_experts, self.weights.shared_gate_D
        y = ex.run_dense(ex.quantize_input(x_TD))
        if g is None:
            return y
        return y.float() * torch.sigmoid(x_TD.float() @ g)[:, None]

    def _routed_micro_batches(self, x_TD, ids_TK, w_TK) -> torch.Tensor:
        """Two halves: dispatch/combine on the comm stream, experts on this one, each half in
        its own experts slot (its buffers live until its combine has read them)."""
        st, t = self.streams, self.timer
        h = x_TD.shape[0] // 2
        parts = [(x_TD[:h], ids_TK[:h], w_TK[:h]), (x_TD[h:], ids_TK[h:], w_TK[h:])]
        comm = st.comm if st.cuda else None
        dispatched, outs = [], []
        with st.on(comm, reads=(x_TD, ids_TK, w_TK)), t.stage("dispatch"):
            dispatched.append(self.comm.dispatch(*parts[0]))
        ready = st.mark(comm)
        for i in range(2):
            batch, handle = dispatched[i]
            st.wait(ready, reads=batch)
            with self.experts.use_slot(i), t.stage("experts"):
                y = self.experts.run(batch)
            done = st.mark()
            if i == 0:  # the second half's dispatch overlaps the first half's GEMMs
                with st.on(comm, after=ready), t.stage("dispatch"):
                    dispatched.append(self.comm.dispatch(*parts[1]))
                ready = st.mark(comm)
            with st.on(comm, after=done, reads=y), t.stage("combine"):
                outs.append(self.comm.combine(y, handle))
        st.wait(st.mark(comm), reads=outs)
        return torch.cat(outs)
