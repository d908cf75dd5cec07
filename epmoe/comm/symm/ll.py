"""symm-ll: the low-latency backend on our symmetric arena (see the package docstring).

    comm = SymmLowLatencyComm(cfg, quant, expert_map_E, ctx)            # ctx: CommContext
    batch, handle = comm.dispatch(x_TD, topk_ids_TK, topk_weights_TK)   # MaskedBatch
    out_TD = comm.combine(experts.run(batch), handle)                   # bf16 [T, D]

No host sync, nothing allocated that depends on routing, epochs on the device: the whole
dispatch -> experts -> combine sequence can be captured in a CUDA graph and replayed with new
routing. `batch.x` is a view of the arena, valid until this rank's next `combine_send`.
Halves: `dispatch_send` -> `dispatch_recv`, `combine_recv(combine_send(...))`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.comm.base import Comm, MaskedBatch
from epmoe.comm.context import CommContext
from epmoe.comm.symm import ll_combine, ll_dispatch
from epmoe.comm.symm.arena import LL_COMBINE, LL_DISPATCH, ArenaLayout, acquire_arena
from epmoe.comm.symm.ht import check_blocks, cuda_unsupported
from epmoe.comm.symm.ll_dispatch import LLShape
from epmoe.comm.symm.options import LL_SMS, BoundOptions, SymmOptions, grid
from epmoe.config import MoEConfig, QuantConfig

ARENA_KEY = "symm-arena-ll"
MAX_TOKENS = 1024  # the masked region holds E_L x (W x tokens) rows: decode sizes only


@dataclass(frozen=True)
class SymmLLPending:
    """Between dispatch_send and dispatch_recv: msg_TW int32 [T, W], >= 0 where a token went
    to that rank (the partial sums combine_recv adds); counts_E int32 [E_L], zeroed by the
    send, filled by the receive."""

    msg_TW: torch.Tensor
    counts_E: torch.Tensor


@dataclass(frozen=True)
class SymmLLHandle:
    """counts_E  int32 [E_L] rows per local expert (the masked batch's counts)
    msg_TW    int32 [T, W] where this rank's tokens went (-1: not to that rank), for
              combine_recv's rank-ordered sum (the top-k weights are applied by the expert
              ranks' combine_send, from the dispatch's messages)"""

    counts_E: torch.Tensor
    msg_TW: torch.Tensor


class SymmLowLatencyComm(BoundOptions, Comm):
    """Masked layout [E_local, W x max_tokens, D], fp8 quantization fused into the send,
    CUDA-graph capturable."""

    name = "symm-ll"
    arena_key = ARENA_KEY

    def __init__(self, cfg: MoEConfig, quant: QuantConfig, expert_map_E: torch.Tensor,
                 ctx: CommContext | None = None, options: SymmOptions | None = None):
        super().__init__(cfg, quant, expert_map_E, ctx)
        why = _format_unsupported(cfg, quant)
        if why:
            raise ValueError(f"comm backend 'symm-ll' cannot run this layer: {why}")
        self.options = options or SymmOptions()
        self.e_l = check_blocks(self.expert_map_E, self.world, self.rank)
        self.shape = self.arena_shape(cfg, quant, self.world, self.ctx.max_tokens_per_rank)
        self.arena = acquire_arena(self.ctx, ARENA_KEY, self.shape.layout())
        self._bind()

    def _bind(self) -> None:
        """The kernels with their constants and grids bound (`epmoe.kernels.launcher`): at
        construction, and again when `options` is replaced."""
        view = self.arena.view
        self._dispatch = ll_dispatch.LLDispatch(view, self.shape, self.quant, self._options)
        self._combine = ll_combine.LLCombine(view, self.shape, self._options)

    @staticmethod
    def arena_shape(cfg: MoEConfig, quant: QuantConfig, world: int,
                    max_tokens_per_rank: int) -> LLShape:
        if not 1 <= max_tokens_per_rank <= MAX_TOKENS:
            raise ValueError(f"max_tokens_per_rank ({max_tokens_per_rank}) must lie in [1, "
                             f"{MAX_TOKENS}] for symm-ll (its masked region holds every "
                             f"rank's tokens per expert); use symm-ht for larger batches")
        return LLShape(world, max_tokens_per_rank, cfg.hidden, cfg.top_k,
                       cfg.num_experts // world, quant.recipe == "fp8_block")

    @classmethod
    def arena_layout(cls, cfg, quant, world, max_tokens_per_rank) -> ArenaLayout:
        return cls.arena_shape(cfg, quant, world, max_tokens_per_rank).layout()

    @classmethod
    def supports(cls, cfg, quant, device, world) -> str | None:
        return _format_unsupported(cfg, quant) or cuda_unsupported(device)

    @property
    def capacity(self) -> int:
        return self.shape.capacity

    # -------------------------------------------------------------- dispatch
    def dispatch_send(self, x_TD, topk_ids_TK, topk_weights_TK) -> SymmLLPending:
        """Quantize (fused into the send kernel) and send each token: a row per expert, or
        once per rank with `ll_dedup` (see ll_dispatch.py)."""
        opts = self.options.for_call(self.arena.begin(LL_DISPATCH))
        return SymmLLPending(*self._dispatch.dispatch_send(x_TD, topk_ids_TK, topk_weights_TK,
                                                           opts))

    def dispatch_recv(self, pending: SymmLLPending) -> tuple[MaskedBatch, SymmLLHandle]:
        opts = self.options.for_call(self.arena.end(LL_DISPATCH))
        x, counts, rows = self._dispatch.dispatch_recv(pending.counts_E, opts)
        return MaskedBatch(x, counts, rows), SymmLLHandle(counts, pending.msg_TW)

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        return self.dispatch_recv(self.dispatch_send(x_TD, topk_ids_TK, topk_weights_TK))

    # -------------------------------------------------------------- combine
    def combine_send(self, expert_out: torch.Tensor, handle: SymmLLHandle) -> SymmLLHandle:
        """-> what combine_recv takes (the handle)."""
        opts = self.options.for_call(self.arena.begin(LL_COMBINE))
        self._combine.combine_send(expert_out.to(torch.bfloat16), opts)
        return handle

    def combine_recv(self, handle: SymmLLHandle) -> torch.Tensor:
        opts = self.options.for_call(self.arena.end(LL_COMBINE))
        return self._combine.combine_recv(handle.msg_TW, opts)

    def combine(self, expert_out, handle: SymmLLHandle) -> torch.Tensor:
        return self.combine_recv(self.combine_send(expert_out, handle))

    def ctas(self) -> tuple[int, int]:
        """(send, receive) CTAs this backend's kernels run on its device (SymmOptions)."""
        dev = self.arena.view.base.device
        return (grid(self.options, dev, send_default=LL_SMS),
                grid(self.options, dev, recv=True))

    def check_errors(self) -> None:
        """Raise if a spin timed out on this rank (syncs: call at a sync point you have)."""
        self.arena.view.raise_if_error()


def _format_unsupported(cfg: MoEConfig, quant: QuantConfig) -> str | None:
    if quant.recipe not in ("bf16", "fp8_block"):
        return (f"symm-ll carries bf16 or fp8 1x128 tokens (quantized in its send kernel); "
                f"recipe {quant.recipe} is not one: use symm-ht")
    if cfg.hidden % 128:
        return f"hidden ({cfg.hidden}) must be a multiple of 128 for symm-ll"
    return None


__all__ = ["SymmLowLatencyComm", "SymmLLHandle", "SymmLLPending"]
