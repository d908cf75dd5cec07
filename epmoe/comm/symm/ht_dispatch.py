"""symm-ht dispatch: straight into the experts' contiguous layout (the combine is in
`ht_combine.py`). `HTDispatch` launches the kernel (its constants bound once, by the backend in
`ht.py`); plain functions prepare its inputs and outputs. Regions of the HT arena
(`HTShape.layout`), per buffer b in {0, 1} (b = epoch % 2) and source rank s:

  ht_rows   [2][W][TMAX] rows of ROW_W int32 words: data words, then scale words
  ht_meta   [2][W][TMAX] MW words: source token t, local expert e_k (-1: not here), pos_k, w_k
  ht_counts [2][W] CW words: tokens s sent me, pairs per local expert, s's send CTAs and
            slots per chunk
  ht_prog   [W][GMAX] int64: epoch << 32 | rounds of chunks send CTA c of rank s has landed
  ht_cdone  [W*TMAX] int32: the combine's done word of each block of received tokens
  ht_csum   [2][W][TMAX / SB] int32: partial rows rank s has landed here for my token block
  ht_comb   [2][W][TMAX] bf16 [D]: rank s's fp32-reduced partial sum for my token t

One kernel, two roles (one rank's view; a step moves whole rows of BT tokens, `tiles.py`):
  send     (ht_send.py) wait ack[s] >= e-2 (buffer b free) -> CTA 0: counts, ready[me] = e ->
           rounds of CK-slot chunks per peer, each round's progress released at every peer
  receive  (ht_recv.py) wait ready[s] >= e -> layout from the counts (groups aligned), the
           parts that need no row -> chunk by chunk as progress allows: rows stored to the
           layout rows of their local experts -> last CTA: seq = e, ack[me] = e everywhere
The roles run as two launches (SPLIT_SEND then SPLIT_RECV: the loopback world, run rank by
rank) or as one (PIPELINED: the first send CTAs to start send, the rest receive; on real
ranks the receive then overlaps the link). Epochs: the send counts its own calls (send_seq),
the receive its own (seq): in one launch the receive may finish first.
The combine (ht_combine.py, one kernel, up to three roles): reduce CTAs sum a received
token's K rows in fp32 (one bf16 cast) into the own ht_comb slot or a staging row, counting
each block done; push CTAs wait ack >= e-2, then copy each finished block's staged rows to
their sources' ht_comb[b][me][t] and count them into the sources' landing counters
(ht_csum[b][me][t // SB]); the sum (the same grid when pipelined, else the receive's launch)
waits per block of own tokens for the rows each rank owes it -> an fp32 sum over the ranks
the token went to, in rank order, one cast -> seq, ack.
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.kernels._common import INTERPRET, next_pow2
from epmoe.kernels.launcher import Launcher

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import HT_DISPATCH, RankArena  # noqa: E402
from epmoe.comm.symm.ht_recv import recv_rows  # noqa: E402
from epmoe.comm.symm.ht_send import finish_send_rows, send_rows  # noqa: E402
from epmoe.comm.symm.ht_shape import MAX_SEND_CTAS, HTShape, RowFormat, max_rows  # noqa: E402
from epmoe.comm.symm.options import SymmOptions, device_sms, grid  # noqa: E402
from epmoe.comm.symm.route import SendRoute  # noqa: E402
from epmoe.comm.symm.sync import (USE_TIMER, epoch, finish_recv_of,  # noqa: E402
                                  send_epoch, take_role)
from epmoe.comm.symm.tiles import row_cols, rows_per_step  # noqa: E402
from epmoe.layout import ContiguousLayout  # noqa: E402
from epmoe.quant import QTensor  # noqa: E402

OP_D = tl.constexpr(HT_DISPATCH)
SPLIT_SEND, SPLIT_RECV, PIPELINED = 1, 2, 0  # the kernel's MODE
RECV_ROWS = 8  # rows per receive step on GPU (tile_tokens overrides; BENCHMARKS.md 20)


# one compile for every rank and call (the ranks wait on each other: none may compile late)
@triton.jit(do_not_specialize=["TS", "me", "limit"])
def _dispatch_kernel(arena_ptr, delta_ptr, x_ptr, s_ptr, ids_ptr, w_ptr, pos_ptr, tok_ptr,
                     total_ptr, TS, xo_ptr, so_ptr, row_expert_ptr, inv_ptr, wo_ptr,
                     src_tok_ptr, info_ptr, arow_ptr, align, me, limit, G_SEND, G_RECV,
                     ROWS: tl.constexpr, META: tl.constexpr, CNT: tl.constexpr,
                     PROG: tl.constexpr, GMAX: tl.constexpr, TMAX: tl.constexpr,
                     W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                     E_L: tl.constexpr, EP: tl.constexpr, M_MAX: tl.constexpr,
                     DW: tl.constexpr, SW: tl.constexpr, CH: tl.constexpr, BSW: tl.constexpr,
                     ROW_W: tl.constexpr, MW: tl.constexpr, CW: tl.constexpr,
                     CK: tl.constexpr, BT_S: tl.constexpr, BT_R: tl.constexpr,
                     BR: tl.constexpr, MODE: tl.constexpr, GATHER: tl.constexpr,
                     USE_TIMER: tl.constexpr):
    """MODE 1: the send role on every CTA; 2: the receive role; 0 (pipelined): G_SEND + G_RECV
    CTAs, the first G_SEND to start send and the rest receive, so a chunk is placed in the
    layout while the next ones are still on the link."""
    i = tl.program_id(0)
    send_role = tl.full((), MODE == 1, dtype=tl.int1)
    if MODE == 0:
        i = take_role(arena_ptr, OP_D, G_SEND + G_RECV)
        send_role = i < G_SEND
        i = tl.where(send_role, i, i - G_SEND)
    if send_role:
        e = send_epoch(arena_ptr, OP_D)
        send_rows(arena_ptr, delta_ptr, x_ptr, s_ptr, ids_ptr, w_ptr, pos_ptr, tok_ptr,
                  total_ptr, TS, me, i, G_SEND, e, limit, ROWS, META, CNT, PROG, GMAX, TMAX,
                  W, WP, K, KP, E_L, EP, DW, SW, CH, BSW, ROW_W, MW, CW, CK, BT_S, MODE == 0,
                  USE_TIMER)
        finish_send_rows(arena_ptr, delta_ptr, PROG, GMAX, e, me, W, G_SEND)
    else:
        e = epoch(arena_ptr, OP_D)
        recv_rows(arena_ptr, x_ptr, s_ptr, ids_ptr, w_ptr, pos_ptr, tok_ptr, total_ptr, TS,
                  xo_ptr, so_ptr, row_expert_ptr, inv_ptr, wo_ptr, src_tok_ptr, info_ptr,
                  arow_ptr, align, me, i, G_RECV, e, limit, ROWS, META, CNT, PROG, GMAX, TMAX,
                  W, WP, K, KP, E_L, EP, M_MAX, DW, SW, CH, BSW, ROW_W, MW, CW, CK, BT_R, BR,
                  GATHER, USE_TIMER)
        finish_recv_of(arena_ptr, delta_ptr, OP_D, e, me, W, G_RECV)


# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HTReceived:
    """What a rank keeps between its dispatch receive and its combine (all on the device).

    inv_NK     int32 [W*TMAX, K] layout row of (received token n, slot k); -1: not here / n >= N
    w_NK       fp32 [W*TMAX, K] the top-k weights of those slots (0 where -1)
    src_tok_N  int32 [W*TMAX] source rank * TMAX + source token of received token n (-1 past N,
               and for a token whose rows timed out)
    info_I     int32: N, M used, counts_E [E_L], offsets_E1 [E_L + 1], row bases [W][E_L],
               tokens received up to each source [W]
    """

    inv_NK: torch.Tensor
    w_NK: torch.Tensor
    src_tok_N: torch.Tensor
    info_I: torch.Tensor


def _consts(arena: RankArena, shape: HTShape, opts: SymmOptions) -> dict:
    """The dispatch kernel's constexprs but MODE and M_MAX."""
    lay = arena.layout
    e_l = shape.num_local_experts
    dw, sw = shape.data_bytes // 4, shape.scale_bytes // 4
    ck = opts.chunk_rows_or_default()
    tile = opts.tile(rows_per_step(row_cols(dw)))
    return dict(ROWS=lay.offset("ht_rows"), META=lay.offset("ht_meta"),
                CNT=lay.offset("ht_counts"), PROG=lay.offset("ht_prog"), GMAX=MAX_SEND_CTAS,
                TMAX=max(1, shape.max_tokens), W=shape.world,
                WP=next_pow2(shape.world), K=shape.top_k, KP=next_pow2(shape.top_k), E_L=e_l,
                EP=next_pow2(e_l), DW=dw, SW=sw, CH=row_cols(dw), BSW=next_pow2(max(sw, 1)),
                ROW_W=shape.row_words, MW=shape.meta_words, CW=shape.count_words, CK=ck,
                # the receive: 8 rows a step (a [BT, CH] load, one store per slot): 24-27% less
                # time than 2 rows of a [BT, K, CH] store on a lent H200 with 48 receive CTAs,
                # 4-12% less with 132
                BT_S=min(tile, ck), BT_R=min(opts.tile(RECV_ROWS), ck),
                BR=1024 if INTERPRET else 2048, GATHER=bool(opts.ht_gather),
                USE_TIMER=USE_TIMER)


def _words(x: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Wire rows as int32 words: (data [T, DW], scales [T, SW]; the data again if none). Scale
    rows that are no whole number of words (mxfp8 at hidden 2880: 90 bytes) are copied into
    rows padded to one (a few bytes a token)."""
    data = x.data.contiguous().view(torch.int32)
    if x.scale is None:
        return data, data
    s = x.scale.contiguous()
    row_bytes = s.shape[-1] * s.element_size()
    if row_bytes % 4:
        pad = (4 - row_bytes % 4) // s.element_size()
        s = torch.nn.functional.pad(s.view(torch.uint8) if s.element_size() == 1 else s,
                                    (0, pad))
    return data, s.view(torch.int32)


@dataclass(frozen=True)
class HTDispatchArgs:
    """One dispatch call's inputs as the kernel takes them (send and receive roles alike):
    this rank's wire rows (the receive reads its own rows from them), its routing and table."""

    data: torch.Tensor
    scale: torch.Tensor
    ids_TK: torch.Tensor
    w_TK: torch.Tensor
    route: SendRoute


@dataclass(frozen=True)
class HTOutputs:
    """The receive's outputs, allocated before its launch (worst-case M rows). ht_gather:
    rows_M int32 [M] (-1 until the receive points a row at its arena slot) instead of the
    rows (xo, so: one row each, never written)."""

    xo: torch.Tensor
    so: torch.Tensor
    row_expert: torch.Tensor
    recv: HTReceived
    rows_M: torch.Tensor | None = None


def prepare(shape: HTShape, x: QTensor, topk_ids_TK: torch.Tensor,
            topk_weights_TK: torch.Tensor, rt: SendRoute) -> HTDispatchArgs:
    t = x.data.shape[0]
    if t > shape.max_tokens:
        raise ValueError(f"tokens per rank ({t}) exceed the arena's max_tokens_per_rank "
                         f"({shape.max_tokens}); size the CommContext for the run's worst case")
    data, scale = _words(x)
    return HTDispatchArgs(data, scale, topk_ids_TK.contiguous(),
                          topk_weights_TK.float().contiguous(), rt)


def allocate(arena: RankArena, shape: HTShape, alignment: int, gather: bool) -> HTOutputs:
    dev = arena.base.device
    e_l, w, k = shape.num_local_experts, shape.world, shape.top_k
    m = max_rows(shape, alignment)
    n = w * max(1, shape.max_tokens)
    dw, sw = shape.data_bytes // 4, shape.scale_bytes // 4
    rows = 1 if gather else m
    return HTOutputs(
        torch.empty((rows, dw), dtype=torch.int32, device=dev),
        torch.empty((rows, max(sw, 1)), dtype=torch.int32, device=dev),
        torch.empty(m, dtype=torch.int32, device=dev),
        HTReceived(torch.empty((n, k), dtype=torch.int32, device=dev),
                   torch.empty((n, k), dtype=torch.float32, device=dev),
                   torch.empty(n, dtype=torch.int32, device=dev),
                   torch.empty(3 + 2 * e_l + w * e_l + w, dtype=torch.int32, device=dev)),
        # -1 first: a row whose tokens never came (a timeout) must not point anywhere
        torch.full((m,), -1, dtype=torch.int32, device=dev) if gather else None)


class HTDispatch:
    """The dispatch kernel with its constants, options and grids bound once (a backend builds
    it at construction: a call then pays the launch, not Triton's per-call binding;
    `epmoe.kernels.launcher`), one Launcher per (MODE, M_MAX)."""

    def __init__(self, arena: RankArena, shape: HTShape, opts: SymmOptions):
        dev = arena.base.device
        g_send, g_recv = grid(opts, dev), grid(opts, dev, recv=True)
        if g_send >= MAX_SEND_CTAS:
            raise ValueError(f"symm-ht send CTAs ({g_send}) must be < {MAX_SEND_CTAS} (the "
                             f"arena's progress words per source, one of them the whole "
                             f"send's)")
        g_pipe = g_recv
        if not INTERPRET:  # pipelined: the roles share the SMs
            sms = device_sms(dev) or g_send + g_recv
            g_pipe = max(1, min(g_recv, sms - g_send)) if opts.recv_sms == 0 else g_recv
        # mode -> (grid, G_SEND, G_RECV)
        self.grids = {SPLIT_SEND: ((g_send,), g_send, g_recv),
                      SPLIT_RECV: ((g_recv,), g_send, g_recv),
                      PIPELINED: ((g_send + g_pipe,), g_send, g_pipe)}
        self.arena, self.warps = arena, opts.warps()
        self.consts = _consts(arena, shape, opts)
        self._kernels: dict[tuple[int, int], Launcher] = {}

    def kernel(self, mode: int, m_max: int) -> Launcher:
        """The Launcher of one MODE and M_MAX (the receive's output rows), built once."""
        k = self._kernels.get((mode, m_max))
        if k is None:
            k = self._kernels[(mode, m_max)] = Launcher(
                _dispatch_kernel, dict(self.consts, MODE=mode, M_MAX=m_max),
                num_warps=self.warps)
        return k

    def launch(self, alignment: int, a: HTDispatchArgs, out: HTOutputs | None, mode: int,
               opts: SymmOptions) -> None:
        """One launch of the dispatch kernel: mode SPLIT_SEND (send role on the send CTAs),
        SPLIT_RECV (receive role; out given) or PIPELINED (both roles in one grid; out
        given)."""
        g, g_send, g_recv = self.grids[mode]
        if out is None:  # the send role writes none of these
            out = HTOutputs(a.data, a.data, a.data, HTReceived(a.data, a.data, a.data, a.data))
        r, rt, arena = out.recv, a.route, self.arena
        self.kernel(mode, out.row_expert.shape[0] if mode != SPLIT_SEND else 1)(
            g, arena.base, arena.peer_delta_W, a.data, a.scale, a.ids_TK, a.w_TK, rt.pos_TK,
            rt.tok_WT, rt.total_C, rt.tok_WT.shape[1], out.xo, out.so, out.row_expert,
            r.inv_NK, r.w_NK, r.src_tok_N, r.info_I,
            out.row_expert if out.rows_M is None else out.rows_M, alignment, arena.rank,
            opts.spin_limit, g_send, g_recv)


def arena_rows(arena: RankArena, shape: HTShape, fmt: RowFormat) -> QTensor:
    """ht_rows as the rows a gathered batch indexes: [2 * W * TMAX, D], row stride ROW_W
    words (data, then its scales in the same row: views, no copy)."""
    u8 = arena.words("ht_rows", torch.uint8).view(-1, shape.row_words * 4)
    data = u8[:, :shape.data_bytes].view(fmt.data_dtype)
    scale = None if fmt.scale_dtype is None else u8[:, shape.data_bytes:shape.data_bytes + (
        fmt.scale_cols * fmt.scale_dtype.itemsize)].view(fmt.scale_dtype)
    return QTensor(data, scale, fmt.recipe, fmt.group, fmt.scale_fmt)


def received(shape: HTShape, fmt: RowFormat, alignment: int, out: HTOutputs,
             rows: QTensor | None) -> tuple[QTensor, ContiguousLayout, HTReceived]:
    """The receive's outputs as the experts' batch (valid in stream order after its launch);
    ht_gather: x is `rows` (`arena_rows`), read through out.rows_M."""
    e_l, sw = shape.num_local_experts, shape.scale_bytes // 4
    info = out.recv.info_I
    scale = None if sw == 0 else out.so.view(fmt.scale_dtype)[:, :fmt.scale_cols]
    x = rows if out.rows_M is not None else \
        QTensor(out.xo.view(fmt.data_dtype), scale, fmt.recipe, fmt.group, fmt.scale_fmt)
    layout = ContiguousLayout(row_expert_M=out.row_expert, inv_perm_NK=out.recv.inv_NK,
                              counts_E=info[2:2 + e_l], offsets_E1=info[2 + e_l:3 + 2 * e_l],
                              alignment=alignment)
    return x, layout, out.recv
