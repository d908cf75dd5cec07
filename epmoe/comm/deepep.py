"""DeepEP (v1, intranode NVLink) behind the comm contract: high-throughput and low-latency.

| class                      | dispatch ->                                 | combine                      |
|----------------------------|---------------------------------------------|------------------------------|
| DeepEPHighThroughputComm   | get_dispatch_layout -> dispatch (fp8 data + | combine: sums the experts'   |
|                            | fp32 scales for fp8_block, else bf16);      | weighted rows per token      |
|                            | TokenBatch, local ids (-1 elsewhere)        | (bf16 wire and out)          |
| DeepEPLowLatencyComm       | low_latency_dispatch (fp8 or bf16) ->       | low_latency_combine applies  |
|                            | MaskedBatch [E_local, C, D] + counts        | the top-k weights            |

One DeepEP `Buffer` per mode is shared by every layer of a rank: it is a resource of the
rank's `CommContext` (owned by the Runtime, destroyed by `CommContext.close`). DeepEP's NVSHMEM
(low-latency mode) initializes once per process, and one IPC buffer per layer would waste
memory. Buffers are sized from the run: HT from DeepEP's config size hints at the model's
hidden size; LL from the context's worst-case tokens per rank.
Experts are owned in contiguous blocks (rank r: slots [r*E/ep, (r+1)*E/ep)), as DeepEP assumes.
Single node only (NVLink): NVSHMEM runs with no remote transport.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.comm.base import Comm, MaskedBatch, TokenBatch
from epmoe.comm.wire import wire_quant
from epmoe.config import MoEConfig, QuantConfig
from epmoe.kernels.act_quant import per_token_group_quant
from epmoe.quant import QTensor

LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # DeepEP v1 SWITCH_HIDDEN
LL_MAX_TOPK = 11
HT_RANKS = (2, 4, 8)  # intranode configs DeepEP ships


def _deep_ep():
    import deep_ep  # noqa: PLC0415  (lazy: optional, CUDA-only dependency)

    return deep_ep


def shape_unsupported(cfg: MoEConfig, quant: QuantConfig, world: int | None) -> str | None:
    """The pure rules of epmoe's DeepEP (no device, no import; the planner calls them too):
    ranks (intranode configs; world None skips the rule), the recipes it carries, hidden."""
    if world is not None and world not in HT_RANKS:
        return f"DeepEP intranode runs at ep in {HT_RANKS} (one node), got ep={world}"
    if quant.recipe not in ("bf16", "fp8_block"):
        return f"DeepEP carries bf16 or fp8 1x128 tokens; recipe {quant.recipe} is not one"
    if cfg.hidden % 128:
        return f"hidden ({cfg.hidden}) must be a multiple of 128 for DeepEP"
    return None


def normal_layout_unsupported(world: int, num_nodes: int, gpus_per_node: int) -> str | None:
    """Where DeepEP V1's normal (HT) kernels run (the planner's model scope, which allows what
    epmoe's wrapper does not run yet): in one node its intranode kernels at 2, 4 or 8 ranks;
    across nodes its internode kernels, which take NUM_MAX_NVL_PEERS = 8 GPUs on every node
    (so not a GB200 NVL72 domain, DeepEP issue #392)."""
    if num_nodes == 1 and world not in HT_RANKS:
        return (f"DeepEP V1's normal kernels run at ep in {HT_RANKS} within one node (more "
                f"ranks: its internode kernels, 8 GPUs per node), got ep={world} on one node")
    if num_nodes > 1 and gpus_per_node != 8:
        return (f"DeepEP V1's internode normal kernels take 8 GPUs per node "
                f"(NUM_MAX_NVL_PEERS), got {gpus_per_node}")
    return None


def ll_shape_unsupported(cfg: MoEConfig) -> str | None:
    """The low-latency kernels' extra pure rules: compiled hidden sizes, top-k."""
    if cfg.hidden not in LL_HIDDEN:
        return f"DeepEP low-latency kernels take hidden in {LL_HIDDEN}, got {cfg.hidden}"
    if cfg.top_k > LL_MAX_TOPK:
        return f"DeepEP low-latency kernels take top_k <= {LL_MAX_TOPK}, got {cfg.top_k}"
    return None


def ll_rdma_bytes(max_tokens: int, hidden: int, num_experts: int) -> int:
    """Bytes of DeepEP V1's low-latency buffer (csrc/config.hpp LowLatencyLayout): odd/even
    send, receive and signalling buffers, the combine's send and every receive holding
    num_experts x max_tokens messages."""
    scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    recv = num_experts * max_tokens * max(dispatch_msg, combine_msg)
    signal = -(-num_experts * 4 // 128) * 128
    return 2 * (send + recv + signal)


# DeepEP V1 counts its buffer in int4 units in an int (csrc/deep_ep.cpp: num_rdma_bytes /
# sizeof(int4) < INT_MAX): a low-latency buffer must stay under 32 GiB
LL_RDMA_LIMIT = (2**31 - 1) * 16


def ll_tokens_unsupported(max_tokens: int, hidden: int, num_experts: int) -> str | None:
    """Why DeepEP's low-latency buffers cannot hold max_tokens per rank, or None."""
    need = ll_rdma_bytes(max_tokens, hidden, num_experts)
    if need >= LL_RDMA_LIMIT:
        return (f"deepep-ll's buffers for {max_tokens} tokens per rank would take "
                f"{need / 2**30:.1f} GiB, past DeepEP's 32 GiB limit; use deepep-ht")
    return None


def _common_unsupported(cfg: MoEConfig, quant: QuantConfig, device, world: int) -> str | None:
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        return f"device {device} is not CUDA"
    try:
        _deep_ep()
    except (ImportError, OSError, RuntimeError) as exc:
        return f"deep_ep unavailable ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    return shape_unsupported(cfg, quant, world)


class DeepEPBuffer:
    """A `deep_ep.Buffer` as a CommContext resource: `close()` destroys it (collectively)."""

    def __init__(self, group, num_nvl_bytes: int, num_rdma_bytes: int, **kw):
        import inspect

        ep = _deep_ep()
        self.explicit = "explicitly_destroy" in inspect.signature(ep.Buffer.__init__).parameters
        if self.explicit:
            kw["explicitly_destroy"] = True
        self.buffer = ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, **kw)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes

    def close(self) -> None:
        if self.buffer is not None and self.explicit:
            self.buffer.destroy()
        self.buffer = None


def _buffer(ctx, key: str, what: str, need: int, have, make) -> DeepEPBuffer:
    """The context's DeepEP buffer `key`, made on first use; a later layer that needs more than
    the first one allocated is refused (NVSHMEM allocates once per process)."""
    buf = ctx.resource(key, make)
    if have(buf) < need:
        raise ValueError(f"this rank's DeepEP {what} buffer has {have(buf)} bytes but this layer "
                         f"needs {need}; it is allocated once per process, so build the largest "
                         f"config (--tokens x hidden x experts) first")
    return buf


def _topk64(topk_ids_TK: torch.Tensor) -> torch.Tensor:
    return topk_ids_TK.to(torch.int64).contiguous()


@dataclass(frozen=True)
class DeepEPHandle:
    """What combine needs (high-throughput).

    deep_ep_handle  DeepEP's dispatch handle (its layout: prefix matrices, source indices)
    num_tokens      this rank's T
    """

    deep_ep_handle: tuple
    num_tokens: int


class DeepEPHighThroughputComm(Comm):
    """`num_sms`: SMs DeepEP's kernels take (DeepEP's default 20; 24-48 trades GEMM SMs for
    bandwidth). Repeated dispatch of the same routing tensors (same objects, unmodified) reuses
    DeepEP's cached layout: no get_dispatch_layout and no host sync for counts."""

    name = "deepep-ht"

    def __init__(self, cfg, quant, expert_map_E, ctx, num_sms: int | None = None):
        super().__init__(cfg, quant, expert_map_E, ctx)
        world = self.world
        why = self.supports(cfg, quant, ctx.device, world)
        if why:
            raise ValueError(f"comm backend 'deepep-ht' cannot run here: {why}")
        ep = _deep_ep()
        if num_sms is not None:
            ep.Buffer.set_num_sms(num_sms)
        self.num_experts = self.expert_map_E.shape[0]
        self.owner_of_slots()  # checks slots % world
        self.dispatch_config = ep.Buffer.get_dispatch_config(world)
        self.combine_config = ep.Buffer.get_combine_config(world)
        hidden_bytes = cfg.hidden * 2  # bf16 rows bound fp8 rows + scales
        nvl = max(self.dispatch_config.get_nvl_buffer_size_hint(hidden_bytes, world),
                  self.combine_config.get_nvl_buffer_size_hint(hidden_bytes, world))
        self.buffer = _buffer(ctx, "deepep-ht", "high-throughput", nvl,
                              lambda b: b.num_nvl_bytes,
                              lambda: DeepEPBuffer(ctx.group, nvl, 0)).buffer
        self.wire = wire_quant(quant)
        self._cache = None  # (ids, weights, versions, layout outputs)

    @classmethod
    def supports(cls, cfg, quant, device, world) -> str | None:
        return _common_unsupported(cfg, quant, device, world)

    def _payload(self, x_TD: torch.Tensor):
        if self.wire.recipe == "bf16":
            return x_TD.to(torch.bfloat16).contiguous()
        # one Triton pass; fp32 scales [T, D/128] (powers of two for the ue8m0 formats)
        with self.timer.stage("dispatch.quantize"):
            q = per_token_group_quant(x_TD.contiguous(), 128, self.wire.scale_fmt)
        return q.data, q.scale

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        ids = _topk64(topk_ids_TK)
        w = topk_weights_TK.float().contiguous()
        payload = self._payload(x_TD)
        c = self._cache
        if c is not None and c[0] is topk_ids_TK and c[1] is topk_weights_TK \
                and c[2] == (topk_ids_TK._version, topk_weights_TK._version):
            recv, *_ = self.buffer.dispatch(payload, handle=c[3].deep_ep_handle,
                                            config=self.dispatch_config)
            recv_ids, recv_w, handle = c[4], c[5], c[3]
        else:
            per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
                ids, self.num_experts)
            recv, recv_ids, recv_w, _, ep_handle, _ = self.buffer.dispatch(
                payload, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w,
                config=self.dispatch_config)
            handle = DeepEPHandle(ep_handle, x_TD.shape[0])
            self._cache = (topk_ids_TK, topk_weights_TK,
                           (topk_ids_TK._version, topk_weights_TK._version), handle,
                           recv_ids, recv_w)
        if isinstance(recv, tuple):
            xq = QTensor(recv[0], recv[1], "fp8_block", 128, self.wire.scale_fmt)
        else:
            xq = QTensor(recv, None, "bf16", 0, self.quant.scale_fmt)
        # DeepEP returns local expert ids (rank-relative, -1 elsewhere)
        return TokenBatch(xq, recv_ids.to(torch.int32), recv_w), handle

    def combine(self, expert_out, handle: DeepEPHandle):
        out, _, _ = self.buffer.combine(expert_out.to(torch.bfloat16).contiguous(),
                                        handle.deep_ep_handle, config=self.combine_config)
        return out  # bf16: DeepEP already reduced in fp32 and cast once


@dataclass(frozen=True)
class DeepEPLowLatencyHandle:
    """deep_ep_handle   DeepEP's LL handle (source info, layout range, sizes)
    topk_ids_TK      int64 [T, K] physical ids (the combine re-reads them)
    topk_weights_TK  fp32 [T, K] (applied by the combine)"""

    deep_ep_handle: tuple
    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor


class DeepEPLowLatencyComm(Comm):
    """Preallocated NVSHMEM buffers sized for the context's max tokens per rank (--tokens);
    dispatch and combine make no host sync and allocate nothing that varies with routing, so
    the pair can be captured in a CUDA graph."""

    name = "deepep-ll"

    def __init__(self, cfg, quant, expert_map_E, ctx):
        super().__init__(cfg, quant, expert_map_E, ctx)
        world = self.world
        why = self.supports(cfg, quant, ctx.device, world)
        if why:
            raise ValueError(f"comm backend 'deepep-ll' cannot run here: {why}")
        if ctx.has("symm-nvshmem"):
            raise ValueError("deepep-ll initializes NVSHMEM itself, but this rank's context "
                             "already started NVSHMEM for a symm arena; run symm-* and "
                             "deepep-ll in separate processes (separate runs)")
        if ctx.max_tokens_per_rank < 1:
            raise ValueError("deepep-ll preallocates its buffers: the CommContext needs "
                             "max_tokens_per_rank >= 1 (the run's --tokens)")
        ep = _deep_ep()
        self.num_experts = self.expert_map_E.shape[0]
        self.owner_of_slots()  # checks slots % world
        self.max_tokens = ctx.max_tokens_per_rank
        why = ll_tokens_unsupported(self.max_tokens, cfg.hidden, self.num_experts)
        if why:  # before DeepEP's own assertion ends the process's NVSHMEM
            raise ValueError(why)
        need = ep.Buffer.get_low_latency_rdma_size_hint(self.max_tokens, cfg.hidden, world,
                                                        self.num_experts)
        self.buffer = _buffer(ctx, "deepep-ll", "low-latency", need, lambda b: b.num_rdma_bytes,
                              lambda: DeepEPBuffer(
                                  ctx.group, 0, need, low_latency_mode=True,
                                  num_qps_per_rank=max(1, self.num_experts // world))).buffer
        self.use_fp8 = quant.recipe == "fp8_block"

    @classmethod
    def supports(cls, cfg, quant, device, world) -> str | None:
        return _common_unsupported(cfg, quant, device, world) or ll_shape_unsupported(cfg)

    @property
    def capacity(self) -> int:
        """Rows per local expert in the masked batch: max_tokens x ranks."""
        return self.max_tokens * self.world

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        t = x_TD.shape[0]
        if t > self.max_tokens:
            raise ValueError(f"tokens per rank ({t}) exceed the low-latency buffers' "
                             f"max_tokens ({self.max_tokens}); size them with --tokens (max tokens "
                             f"per rank) of at least {t}, or use deepep-ht")
        ids = _topk64(topk_ids_TK)
        fmt = self.quant.scale_fmt
        recv, counts, ep_handle, _, _ = self.buffer.low_latency_dispatch(
            x_TD.to(torch.bfloat16).contiguous(), ids, self.max_tokens, self.num_experts,
            use_fp8=self.use_fp8, round_scale=self.use_fp8 and fmt != "fp32",
            use_ue8m0=self.use_fp8 and fmt == "ue8m0_packed")
        if self.use_fp8:
            # scales [E, C, G] with C the unit stride (DeepGEMM's TMA layout per expert)
            xq = QTensor(recv[0], recv[1], "fp8_block", 128, fmt)
        else:
            xq = QTensor(recv, None, "bf16", 0, fmt)
        batch = MaskedBatch(xq, counts)
        return batch, DeepEPLowLatencyHandle(ep_handle, ids, topk_weights_TK.float().contiguous())

    def combine(self, expert_out, handle: DeepEPLowLatencyHandle):
        out, _, _ = self.buffer.low_latency_combine(
            expert_out.to(torch.bfloat16).contiguous(), handle.topk_ids_TK,
            handle.topk_weights_TK, handle.deep_ep_handle)
        return out  # bf16: DeepEP already reduced in fp32 and cast once


__all__ = ["ll_rdma_bytes", "ll_tokens_unsupported", "DeepEPHighThroughputComm",
           "DeepEPLowLatencyComm", "DeepEPHandle",
           "DeepEPLowLatencyHandle", "DeepEPBuffer"]
