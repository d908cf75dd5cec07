"""symm-ht: the high-throughput backend on our symmetric arena (see the package docstring).

    comm = SymmHighThroughputComm(cfg, quant, expert_map_E, ctx)        # ctx: CommContext
    comm.alignment = experts.alignment                                  # optional, default 128
    batch, handle = comm.dispatch(x_TD, topk_ids_TK, topk_weights_TK)   # LayoutBatch
    out_TD = comm.combine(experts.run(batch), handle)                   # bf16 [T, D]

or with the halves apart (compute may run between them): `dispatch_send` -> `dispatch_recv`,
`combine_recv(combine_send(...))`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.comm.base import Comm, LayoutBatch
from epmoe.comm.context import CommContext
from epmoe.comm.symm import ht_combine, ht_dispatch
from epmoe.comm.symm.arena import HT_COMBINE, HT_DISPATCH, ArenaLayout, acquire_arena
from epmoe.comm.symm.ht_dispatch import HTReceived
from epmoe.comm.symm.ht_shape import HTShape, RowFormat
from epmoe.comm.symm.options import BoundOptions, SymmOptions, grid
from epmoe.comm.symm.route import SendRouter
from epmoe.comm.wire import wire_quant
from epmoe.config import MoEConfig, QuantConfig
from epmoe.kernels.quantize import TokenQuantizer
from epmoe.layout import ContiguousLayout
from epmoe.quant import QTensor

ARENA_KEY = "symm-arena-ht"


def check_blocks(expert_map_E: torch.Tensor, world: int, rank: int) -> int:
    """-> experts per rank; the symm kernels assume rank r holds slots [r*E_L, (r+1)*E_L)."""
    slots = expert_map_E.shape[0]
    if slots % world:
        raise ValueError(f"physical experts ({slots}) must be divisible by ep ({world})")
    e_l = slots // world
    want = torch.full((slots,), -1, dtype=torch.int32)
    want[rank * e_l:(rank + 1) * e_l] = torch.arange(e_l, dtype=torch.int32)
    if not torch.equal(expert_map_E.cpu().to(torch.int32), want):
        raise ValueError(f"symm backends need contiguous expert blocks (rank {rank} holds slots "
                         f"[{rank * e_l}, {(rank + 1) * e_l}) as local 0..{e_l - 1}); this "
                         f"expert map differs: use all2all for other placements")
    return e_l


def cuda_unsupported(device) -> str | None:
    """Why NVSHMEM arenas cannot be made here (None if they can)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return (f"device {device} is not CUDA (symm arenas are NVSHMEM symmetric memory; on "
                f"CPU only the loopback world of the tests runs them)")
    try:
        import nvshmem.core  # noqa: F401, PLC0415  (lazy: GPU-only dependency)
    except (ImportError, OSError, RuntimeError) as exc:
        return f"nvshmem4py unavailable ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    return None


@dataclass(frozen=True)
class SymmHTPending:
    """Between dispatch_send and dispatch_recv: this rank's routing table (msg_TW: the ranks
    each token went to; combine reads it), the kernel's inputs (the receive reads the rank's
    own rows from its wire rows: the input must not change until dispatch_recv), and the
    receive's outputs when the pipelined kernel already wrote them."""

    msg_TW: torch.Tensor
    args: ht_dispatch.HTDispatchArgs
    outputs: ht_dispatch.HTOutputs | None


@dataclass(frozen=True)
class SymmHTHandle:
    """recv      what this rank received (layout rows, weights, sources), for combine_send
    msg_TW    int32 [T, W] where this rank's tokens went (-1: not to that rank), for
              combine_recv's rank-ordered sum
    num_tokens  T"""

    recv: HTReceived
    msg_TW: torch.Tensor
    num_tokens: int


class SymmHighThroughputComm(BoundOptions, Comm):
    """Dedup per destination rank, device-side counts, rows written straight into the experts'
    contiguous layout (groups padded to `alignment`), combine pre-reduced per (token, rank).
    `alignment`: the experts' GEMM M block (the runtime may set it from the experts)."""

    name = "symm-ht"
    arena_key = ARENA_KEY

    def __init__(self, cfg: MoEConfig, quant: QuantConfig, expert_map_E: torch.Tensor,
                 ctx: CommContext | None = None, options: SymmOptions | None = None,
                 alignment: int = 128):
        super().__init__(cfg, quant, expert_map_E, ctx)
        self.options = options or SymmOptions()
        self.alignment = alignment
        self.num_experts = self.expert_map_E.shape[0]
        self.e_l = check_blocks(self.expert_map_E, self.world, self.rank)
        self.wire = wire_quant(quant)
        self.fmt = RowFormat.of(quant, cfg.hidden)
        self.shape = self.arena_shape(cfg, quant, self.world, self.ctx.max_tokens_per_rank)
        self.arena = acquire_arena(self.ctx, ARENA_KEY, self.shape.layout())
        self._router = SendRouter(self.num_experts, self.world, self.shape.top_k)
        self._quantizer = None if self.wire.recipe == "bf16" else \
            TokenQuantizer(self.wire, cfg.hidden)
        self._bind()

    def _bind(self) -> None:
        """The kernels with their constants and grids bound (`epmoe.kernels.launcher`): at
        construction, and again when `options` is replaced."""
        view = self.arena.view
        self._dispatch = ht_dispatch.HTDispatch(view, self.shape, self._options)
        self._combine = ht_combine.HTCombine(view, self.shape, self._options)
        self._rows = ht_dispatch.arena_rows(view, self.shape, self.fmt) \
            if self._options.ht_gather else None

    @staticmethod
    def arena_shape(cfg: MoEConfig, quant: QuantConfig, world: int,
                    max_tokens_per_rank: int) -> HTShape:
        if max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank ({max_tokens_per_rank}) must be >= 1: the "
                             f"symmetric arena is sized for the run's worst case (CommContext)")
        fmt = RowFormat.of(quant, cfg.hidden)
        return HTShape(world, max_tokens_per_rank, cfg.hidden, cfg.top_k,
                       cfg.num_experts // world if cfg.num_experts % world == 0 else 0,
                       fmt.data_bytes, fmt.scale_bytes)

    @classmethod
    def arena_layout(cls, cfg, quant, world, max_tokens_per_rank) -> ArenaLayout:
        return cls.arena_shape(cfg, quant, world, max_tokens_per_rank).layout()

    @classmethod
    def supports(cls, cfg, quant, device, world) -> str | None:
        why = RowFormat.of(quant, cfg.hidden).check()
        return why or cuda_unsupported(device)

    def _quantize(self, x_TD: torch.Tensor) -> QTensor:
        """The wire recipe in one Triton pass (no host tensor: CUDA-graph capturable)."""
        w = self.wire
        with self.timer.stage("dispatch.quantize"):
            if w.recipe == "bf16":
                return QTensor(x_TD.to(torch.bfloat16), None, "bf16", 0, w.scale_fmt)
            return self._quantizer(x_TD.contiguous())

    # -------------------------------------------------------------- dispatch
    @property
    def pipelined(self) -> bool:
        """One kernel for every role of a dispatch, and of a combine (SymmOptions.pipelined;
        default: real ranks)."""
        p = self.options.pipelined
        return (not self.arena.view.loopback) if p is None else p

    def dispatch_send(self, x_TD, topk_ids_TK, topk_weights_TK) -> SymmHTPending:
        opts = self.options.for_call(self.arena.begin(HT_DISPATCH))
        xq = self._quantize(x_TD)
        rt = self._router(topk_ids_TK)
        args = ht_dispatch.prepare(self.shape, xq, topk_ids_TK, topk_weights_TK, rt)
        out = None
        if self.pipelined:  # both roles now: the receive overlaps the link
            out = self._allocate()
            self._dispatch.launch(self.alignment, args, out, ht_dispatch.PIPELINED, opts)
        else:
            self._dispatch.launch(self.alignment, args, None, ht_dispatch.SPLIT_SEND, opts)
        return SymmHTPending(rt.msg_TW, args, out)

    def dispatch_recv(self, pending: SymmHTPending) -> tuple[LayoutBatch, SymmHTHandle]:
        opts = self.options.for_call(self.arena.end(HT_DISPATCH))
        out = pending.outputs
        if out is None:
            out = self._allocate()
            self._dispatch.launch(self.alignment, pending.args, out, ht_dispatch.SPLIT_RECV,
                                  opts)
        x, layout, recv = ht_dispatch.received(self.shape, self.fmt, self.alignment, out,
                                               self._rows)
        batch = LayoutBatch(x, layout, out.rows_M)
        if self.options.exact_rows:
            batch = _exact(batch, int(recv.info_I[1]))  # the one host sync
        return batch, SymmHTHandle(recv, pending.msg_TW, pending.msg_TW.shape[0])

    def _allocate(self) -> ht_dispatch.HTOutputs:
        return ht_dispatch.allocate(self.arena.view, self.shape, self.alignment,
                                    self._rows is not None)

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        return self.dispatch_recv(self.dispatch_send(x_TD, topk_ids_TK, topk_weights_TK))

    # -------------------------------------------------------------- combine
    def combine_send(self, expert_out: torch.Tensor,
                     handle: SymmHTHandle) -> ht_combine.HTCombineArgs:
        """Reduce and push (pipelined: and the sum, as rows land) -> what combine_recv takes."""
        opts = self.options.for_call(self.arena.begin(HT_COMBINE))
        args = ht_combine.prepare(self.shape, expert_out.to(torch.bfloat16), handle.recv,
                                  handle.msg_TW)
        mode = ht_combine.PIPELINED if self.pipelined else ht_combine.SPLIT
        self._combine.combine_send(args, mode, opts)
        return args

    def combine_recv(self, sent: ht_combine.HTCombineArgs) -> torch.Tensor:
        """-> bf16 [T, D] (pipelined: the send's kernel already summed; nothing to launch)."""
        opts = self.options.for_call(self.arena.end(HT_COMBINE))
        if self.pipelined:
            return sent.out_TD
        return self._combine.combine_recv(sent, opts)

    def combine(self, expert_out, handle: SymmHTHandle) -> torch.Tensor:
        return self.combine_recv(self.combine_send(expert_out, handle))

    def ctas(self) -> tuple[int, int]:
        """(send, receive) CTAs this backend's kernels run on its device (SymmOptions)."""
        dev = self.arena.view.base.device
        return (grid(self.options, dev), grid(self.options, dev, recv=True))

    def check_errors(self) -> None:
        """Raise if a spin timed out on this rank (syncs: call at a sync point you have)."""
        self.arena.view.raise_if_error()

    def set_alignment(self, alignment: int) -> None:
        if alignment < 1:
            raise ValueError(f"alignment ({alignment}) must be >= 1")
        self.alignment = alignment


def _exact(batch: LayoutBatch, m: int) -> LayoutBatch:
    """The first m rows (every group lies in them): views, no copy (gathered: the index's
    first m; the rows it reads stay as they are)."""
    x, layout = batch.x, batch.layout
    if batch.rows_M is None:
        scale = None if x.scale is None else x.scale[:m]
        x = QTensor(x.data[:m], scale, x.recipe, x.group, x.scale_fmt)
    return LayoutBatch(x, ContiguousLayout(layout.row_expert_M[:m], layout.inv_perm_NK,
                                           layout.counts_E, layout.offsets_E1,
                                           layout.alignment),
                       None if batch.rows_M is None else batch.rows_M[:m])


__all__ = ["SymmHighThroughputComm", "SymmHTHandle", "SymmHTPending", "check_blocks",
           "cuda_unsupported"]
