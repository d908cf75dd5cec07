"""Bytes per rank of one MoE layer under a candidate: its weights, one call's transient
workspace and the comm buffers a process allocates once (the planner's fit-in-memory check)."""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.plan import traffic as tr
from epmoe.plan.comm_cost import FITS_OF, HT_KERNELS, LL


@dataclass(frozen=True)
class Memory:
    """Bytes per rank: this layer's weights, the transient workspace of one layer call, and
    the comm buffers a process allocates once (shared by every layer)."""

    weights: float
    workspace: float
    buffers: float



def layer_memory(cand, work, topo, n_in, pairs, e_local, inter, plan, case) -> Memory:
    """One layer's bytes per rank for a candidate (cost.predict_layer's memory check)."""
    cfg, quant, d = work.cfg, work.quant, work.cfg.hidden
    weights = tr.expert_weight_bytes(e_local, d, inter, quant) + cfg.num_experts * d * 4.0
    if cfg.num_shared_experts:
        _, sl = plan.shared_slice(cfg, quant)
        width = sl[1] if sl is not None else cfg.shared_intermediate
        weights += 3.0 * width * d * tr.weight_bytes_per_elem(quant)
    row = tr.act_row_bytes(d, quant)
    permuted = row if tr.permute_copies_rows(cand.experts, quant.recipe) else tr.INDEX_BYTES
    ws = n_in * (row + 4.0 * d) + pairs * (permuted + 4.0 * inter
                                           + tr.act_row_bytes(inter, quant) + 2.0 * d)
    buffers = 0.0
    world = topo.world
    if cand.backend in HT_KERNELS:  # NVL (and RDMA) ring buffers: channels x peers x 256 rows
        sms = case.sms or case.prof.comm_fit(FITS_OF.get(cand.backend, cand.backend),
                                             topo.intra if topo.num_nodes == 1 else "rdma",
                                             "dispatch").sms or 20
        buffers = sms / 2 * min(world, topo.gpus_per_node) * 256 * 2.0 * d
        buffers *= 2 if topo.num_nodes > 1 else 1
    elif cand.backend == "deepep-ll":  # DeepEP's own layout (send, receive, double-buffered)
        from epmoe.comm.deepep import ll_rdma_bytes

        buffers = float(ll_rdma_bytes(case.max_tokens, d, work.num_slots))
    elif cand.backend in LL:  # per slot x max tokens, dispatch + combine, double-buffered
        buffers = 2.0 * work.num_slots * case.max_tokens * (
            row + tr.LL_HEADER_BYTES + 2.0 * d + tr.LL_HEADER_BYTES)
    return Memory(weights, ws, buffers)
