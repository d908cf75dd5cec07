"""symm-ll dispatch: decode-sized batches into the masked layout, fp8 quantization fused into
the send (the combine is in `ll_combine.py`). A token travels one of two ways
(`SymmOptions.ll_dedup`; the send kernel is in `ll_send.py`):

- direct (the default): one row per (token, expert), taken at the expert's rank with a
  system-scope atomic and stored straight into its masked layout (what DeepEP's LL kernels
  send); the receive only waits and reads the counts;
- staged (ll_dedup): once per destination rank, into the peer's staging region at [source]
  [token] with one message naming its local experts there; after the wait the receive (every
  SM) takes each slot's row with a local atomic and copies the staged row into it. At ep 2
  with top-8 a token hits ~4 experts per rank: a quarter of the direct way's bytes cross the
  link (ep 8: ~2/3), and the send waits for no remote atomic; the copy costs the receive
  2-8 us (BENCHMARKS.md 21, one H200). With ll_gather the receive copies nothing: it
  writes each row's staged row into ll_arow and the batch is the staged rows with that index,
  which the experts' GEMM reads through (`MaskedBatch.rows_EC`).

Regions of the LL arena (`LLShape.layout`), C = W * TMAX:

  ll_slots  [E_L] int32          rows filled per local expert (taken by atomic_add: the
                                 peers' sends, or this rank's staged receive; reset by this
                                 rank's combine_send)
  ll_data   [E_L][C][D]          fp8 or bf16 rows: the MaskedBatch x is a view of this region
  ll_scale  [E_L][G][C] fp32     scales per 128 columns, C unit stride (DeepGEMM's TMA layout)
  ll_meta   [E_L][C] int32       (source rank * TMAX + token) * K + k of each row
  ll_arow   [E_L][C] int32       ll_gather: the staged row (source rank * TMAX + token) each
                                 masked row reads (the MaskedBatch's rows_EC)
  ll_msg    [W][TMAX] MW words   source s's token t, if it went to this rank: the dispatch
                                 epoch, then per slot k its row here (le * C + slot; staged:
                                 the local expert, which the receive replaces with the row;
                                 -1: not here), and the fp32 weight (what combine_send reduces)
  ll_stage  [W][TMAX][D]         staged: source s's token t as it travelled (fp8 or bf16)
  ll_sstage [W][TMAX][G] fp32    staged: its scales (fp8)
  ll_ntok   [W] int32            tokens source s dispatched (the staged receive and
                                 combine_send scan only those)
  ll_comb   [2][W][TMAX][D] bf16 rank s's fp32-reduced partial sum for my token t (buffer =
                                 combine epoch % 2; as HT's ht_comb)

The masked region, the staging rows and the messages are single-buffered (the batch is a view
of the region, and a host-chosen parity would freeze in a CUDA graph): a sender waits until
every peer's combine_send of the previous call has released them (ack), which in a dispatch ->
experts -> combine sequence never spins. A message is current when its epoch word equals the
dispatch's epoch (the send's own call count, `send_epoch`: the same on every rank), so nothing
is cleared between calls. Rows of one expert land in atomic order (not token order); row
contents are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.kernels._common import INTERPRET, next_pow2
from epmoe.kernels.launcher import Launcher

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import LL_DISPATCH, ArenaLayout, RankArena  # noqa: E402
from epmoe.comm.symm.options import LL_SMS, SymmOptions, grid  # noqa: E402
from epmoe.comm.symm.ll_send import ROW_SPAN, _dispatch_send_kernel  # noqa: E402
from epmoe.comm.symm.sync import USE_TIMER, send_epoch, wait_ready  # noqa: E402
from epmoe.comm.symm.tiles import row_cols, source_block, span  # noqa: E402
from epmoe.config import QuantConfig  # noqa: E402
from epmoe.quant import FP8_DTYPE, QTensor  # noqa: E402

OP_D = tl.constexpr(LL_DISPATCH)
GROUP = 128


@dataclass(frozen=True)
class LLShape:
    """What sizes the LL arena: the run's worst case and the activation format."""

    world: int
    max_tokens: int
    hidden: int
    top_k: int
    num_local_experts: int
    fp8: bool

    @property
    def capacity(self) -> int:
        return self.world * max(1, self.max_tokens)

    @property
    def num_groups(self) -> int:
        return self.hidden // GROUP if self.fp8 else 0

    @property
    def msg_words(self) -> int:
        """Words of one message: epoch, K rows, K fp32 weights (16-byte aligned)."""
        return (1 + 2 * self.top_k + 3) // 4 * 4

    def layout(self) -> ArenaLayout:
        e_l, c, d = self.num_local_experts, self.capacity, self.hidden
        return ArenaLayout.build(self.world, [
            ("ll_slots", e_l * 4),
            ("ll_data", e_l * c * d * (1 if self.fp8 else 2)),
            ("ll_scale", e_l * self.num_groups * c * 4),
            ("ll_meta", e_l * c * 4),
            ("ll_arow", e_l * c * 4),
            ("ll_msg", c * self.msg_words * 4),
            ("ll_stage", c * d * (1 if self.fp8 else 2)),
            ("ll_sstage", c * self.num_groups * 4),
            ("ll_ntok", self.world * 4),
            ("ll_comb", 2 * c * d * 2)])


@triton.jit
def _place_staged(arena_ptr, counts_ptr, e, pid, G, SLOTS: tl.constexpr, DATA: tl.constexpr,
                  SCALE: tl.constexpr, META: tl.constexpr, AROW: tl.constexpr,
                  MSG: tl.constexpr, MW: tl.constexpr,
                  STAGE: tl.constexpr, SSTAGE: tl.constexpr, NTOK: tl.constexpr,
                  TMAX: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr,
                  KP: tl.constexpr, C: tl.constexpr, D: tl.constexpr, CH: tl.constexpr,
                  NG: tl.constexpr, NGP: tl.constexpr, FP8: tl.constexpr,
                  GATHER: tl.constexpr, BT: tl.constexpr):
    """Staged: per block of BT staged tokens of one source, a row per slot here (one vector
    of local atomics), the rows written into the message (for combine_send) and meta, then
    the staged row copied to each (GATHER: its index written instead). counts_E (zeroed by
    this rank's send) is raised to each row taken + 1 (a reduction nothing waits for), so no
    CTA waits for the others."""
    msg = (arena_ptr + MSG).to(tl.pointer_type(tl.int32))
    ss = tl.arange(0, WP)
    ntok = tl.minimum(tl.load((arena_ptr + NTOK).to(tl.pointer_type(tl.int32)) + ss,
                              mask=ss < W, other=0), TMAX)
    kk, km = span(KP, K)
    cols, cm = span(CH, D)
    g, gm = span(NGP, NG)
    for blk in range(pid, tl.sum((ntok + BT - 1) // BT, axis=0), G):
        src, t, nm = source_block(blk, ntok, ss, W, BT)
        n64 = (src * TMAX + t).to(tl.int64)
        nm = nm & (tl.load(msg + n64 * MW, mask=nm, other=0) == e)  # current only
        m2 = nm[:, None] & km[None, :]
        le2 = tl.load(msg + n64[:, None] * MW + 1 + kk[None, :], mask=m2, other=-1)
        if not GATHER:  # the staged rows first: their loads overlap the atomics below
            if FP8:
                xr = tl.load((arena_ptr + STAGE).to(tl.pointer_type(tl.float8e4nv))
                             + n64[:, None] * D + cols[None, :], mask=nm[:, None] & cm[None, :])
                sr = tl.load((arena_ptr + SSTAGE).to(tl.pointer_type(tl.float32))
                             + n64[:, None] * NG + g[None, :], mask=nm[:, None] & gm[None, :])
            else:
                xr = tl.load((arena_ptr + STAGE).to(tl.pointer_type(tl.bfloat16))
                             + n64[:, None] * D + cols[None, :], mask=nm[:, None] & cm[None, :])
                sr = xr  # no scales
        v2 = le2 >= 0
        slot2 = tl.atomic_add((arena_ptr + SLOTS).to(tl.pointer_type(tl.int32)) + le2, 1,
                              mask=v2, sem="relaxed", scope="gpu")
        v2 = v2 & (slot2 < C)
        row2 = le2 * C + slot2
        tl.atomic_max(counts_ptr + le2, slot2 + 1, mask=v2, sem="relaxed", scope="gpu")
        tl.store(msg + n64[:, None] * MW + 1 + kk[None, :], tl.where(v2, row2, -1), mask=m2)
        tl.store((arena_ptr + META).to(tl.pointer_type(tl.int32)) + row2,
                 (n64[:, None] * K + kk[None, :]).to(tl.int32), mask=v2)
        if GATHER:  # the row reads the staged one where it is
            tl.store((arena_ptr + AROW).to(tl.pointer_type(tl.int32)) + row2,
                     n64[:, None].to(tl.int32) + 0 * kk[None, :], mask=v2)
        else:
            _copy_staged(arena_ptr, msg, n64, nm, xr, sr, DATA, SCALE, MW, K, C, D, cols, cm,
                         g, gm, NG, FP8)


@triton.jit
def _copy_staged(arena_ptr, msg, n64, nm, xr, sr, DATA: tl.constexpr, SCALE: tl.constexpr,
                 MW: tl.constexpr, K: tl.constexpr, C: tl.constexpr, D: tl.constexpr, cols, cm,
                 g, gm, NG: tl.constexpr, FP8: tl.constexpr):
    """Each slot's row of a block of staged tokens: the token's row and scales copied in."""
    tl.debug_barrier()  # the rows, CTA-wide: each slot's is its own [BT] load below
    for k in tl.static_range(K):
        rk = tl.load(msg + n64 * MW + 1 + k, mask=nm, other=-1)
        vk = rk >= 0
        r64 = rk.to(tl.int64)
        if FP8:
            dst = (arena_ptr + DATA).to(tl.pointer_type(tl.float8e4nv)) + r64 * D
            tl.store(dst[:, None] + cols[None, :], xr, mask=vk[:, None] & cm[None, :])
            lek = rk // C
            sdst = (arena_ptr + SCALE).to(tl.pointer_type(tl.float32)) \
                + lek.to(tl.int64) * NG * C + (rk - lek * C)
            tl.store(sdst[:, None] + g[None, :].to(tl.int64) * C, sr,
                     mask=vk[:, None] & gm[None, :])
        else:
            dst = (arena_ptr + DATA).to(tl.pointer_type(tl.bfloat16)) + r64 * D
            tl.store(dst[:, None] + cols[None, :], xr, mask=vk[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["limit"])
def _dispatch_recv_kernel(arena_ptr, counts_ptr, limit, SLOTS: tl.constexpr, DATA: tl.constexpr,
                          SCALE: tl.constexpr, META: tl.constexpr, AROW: tl.constexpr,
                          MSG: tl.constexpr,
                          MW: tl.constexpr, STAGE: tl.constexpr, SSTAGE: tl.constexpr,
                          NTOK: tl.constexpr, TMAX: tl.constexpr, W: tl.constexpr,
                          WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                          E_L: tl.constexpr, EP: tl.constexpr, C: tl.constexpr,
                          D: tl.constexpr, CH: tl.constexpr, NG: tl.constexpr,
                          NGP: tl.constexpr, FP8: tl.constexpr, STAGED: tl.constexpr,
                          GATHER: tl.constexpr, BT: tl.constexpr, USE_TIMER: tl.constexpr):
    """Wait for every source's send of this call (the epoch this rank's send stored); staged:
    place the staged rows (every CTA); direct (one CTA): counts_E = the rows taken here."""
    e = send_epoch(arena_ptr, OP_D) - 1
    ok = wait_ready(arena_ptr, OP_D, e, limit, W, USE_TIMER)
    if STAGED:
        if ok != 0:
            _place_staged(arena_ptr, counts_ptr, e, tl.program_id(0), tl.num_programs(0),
                          SLOTS, DATA, SCALE, META, AROW, MSG, MW, STAGE, SSTAGE, NTOK, TMAX, W,
                          WP, K, KP, C, D, CH, NG, NGP, FP8, GATHER, BT)
    else:
        ee = tl.arange(0, EP)
        cnt = tl.load((arena_ptr + SLOTS).to(tl.pointer_type(tl.int32)) + ee, mask=ee < E_L,
                      other=0)
        tl.store(counts_ptr + ee, tl.where(ok != 0, tl.minimum(cnt, C), 0), mask=ee < E_L)


def _check_dest_words(arena: RankArena, rows: int) -> None:
    """The direct send keeps each slot's destination in one int64 word (`ll_send._dest`):
    its rank's base // 128 in the high 40 bits, row + 1 in the low 24."""
    span = int(ROW_SPAN.value)
    far = int(arena.peer_delta_W.abs().max())
    if rows >= span - 1 or far >= 2 ** 45:
        raise ValueError(f"symm-ll's direct send cannot address this arena: {rows} masked rows "
                         f"(at most {span - 2}) and peers {far} bytes apart (at most 2^45); "
                         f"lower max_tokens_per_rank or use ll_dedup")


# --------------------------------------------------------------------------------------------
class LLDispatch:
    """The dispatch's two kernels with their constants bound once, and the masked batch's
    views of the arena (a backend builds it at construction: a call then pays the launches,
    not Triton's per-call binding; `epmoe.kernels.launcher`)."""

    def __init__(self, arena: RankArena, shape: LLShape, quant: QuantConfig, opts: SymmOptions):
        lay, d, dev = arena.layout, shape.hidden, arena.base.device
        self.arena, self.shape = arena, shape
        e_l, c = shape.num_local_experts, shape.capacity
        self.staged, self.gather = bool(opts.ll_dedup), bool(opts.ll_gather)
        if not self.staged:
            _check_dest_words(arena, e_l * c)
        common = dict(SLOTS=lay.offset("ll_slots"), DATA=lay.offset("ll_data"),
                      SCALE=lay.offset("ll_scale"), META=lay.offset("ll_meta"),
                      MSG=lay.offset("ll_msg"), MW=shape.msg_words,
                      STAGE=lay.offset("ll_stage"), SSTAGE=lay.offset("ll_sstage"),
                      NTOK=lay.offset("ll_ntok"), TMAX=max(1, shape.max_tokens),
                      W=shape.world, WP=next_pow2(shape.world), K=shape.top_k,
                      KP=next_pow2(shape.top_k), E_L=e_l, EP=next_pow2(e_l), C=c, D=d,
                      CH=row_cols(d), NG=shape.num_groups,
                      NGP=next_pow2(max(1, row_cols(d) // GROUP)), FP8=shape.fp8,
                      STAGED=self.staged, USE_TIMER=USE_TIMER)
        bt = opts.tile(1)  # one token per step: fewest steps per CTA at decode sizes (sweep)
        self.send = Launcher(_dispatch_send_kernel, dict(
            common, POW2=shape.fp8 and quant.scale_fmt != "fp32", PRE_ROUND=INTERPRET, BT=bt,
            SA=next_pow2(16 * bt)), num_warps=opts.warps())
        self.send_grid = (grid(opts, dev, send_default=LL_SMS),)
        # staged: every SM copies, two staged tokens a block (at 128 tokens per rank and ep 2
        # one block per CTA of an H200); direct: one CTA reads the counts
        self.recv = Launcher(_dispatch_recv_kernel, dict(
            common, AROW=lay.offset("ll_arow"), GATHER=self.gather, BT=opts.tile(2)),
                             num_warps=opts.warps() if self.staged else 4)
        self.recv_grid = (grid(opts, dev, recv=True) if self.staged else 1,)
        fmt = "ue8m0_fp32" if quant.scale_fmt == "ue8m0_packed" else quant.scale_fmt
        self.rows_EC = arena.words("ll_arow", torch.int32).view(e_l, c) if self.gather \
            else None
        if self.gather:  # the staged rows [W * TMAX, D] as they travelled, and their scales
            dt = FP8_DTYPE if shape.fp8 else torch.bfloat16
            data = arena.words("ll_stage", torch.uint8).view(dt).view(c, d)
            scale = arena.words("ll_sstage", torch.float32).view(c, shape.num_groups) \
                if shape.fp8 else None
            self.x = QTensor(data, scale, quant.recipe if shape.fp8 else "bf16",
                             GROUP if shape.fp8 else 0, fmt)
        elif shape.fp8:
            data = arena.words("ll_data", torch.uint8).view(FP8_DTYPE).view(e_l, c, d)
            scale = arena.words("ll_scale", torch.float32).view(e_l, shape.num_groups, c)
            self.x = QTensor(data, scale.transpose(1, 2), quant.recipe, GROUP, fmt)
        else:
            data = arena.words("ll_data", torch.bfloat16).view(e_l, c, d)
            self.x = QTensor(data, None, "bf16", 0, fmt)

    def dispatch_send(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                      topk_weights_TK: torch.Tensor,
                      opts: SymmOptions) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize (fp8_block: per 128 columns) and send each token to the ranks holding its
        experts (direct: a row per expert; staged: once per rank), with its messages. ->
        (msg_TW int32 [T, W]: >= 0 where the token went to that rank (combine_recv sums those
        partials); counts_E int32 [E_L], which dispatch_recv fills)."""
        shape, arena = self.shape, self.arena
        t = x_TD.shape[0]
        if t > shape.max_tokens:
            raise ValueError(f"tokens per rank ({t}) exceed the low-latency arena's "
                             f"max_tokens_per_rank ({shape.max_tokens}); size the CommContext "
                             f"for the run's worst case or use symm-ht")
        dev = x_TD.device
        msg = torch.empty((t, shape.world), dtype=torch.int32, device=dev)
        counts = torch.empty(shape.num_local_experts, dtype=torch.int32, device=dev)
        dest = msg if self.staged else torch.empty((t, shape.top_k), dtype=torch.int64,
                                                     device=dev)  # the rows taken (direct)
        self.send(self.send_grid, arena.base, arena.peer_delta_W, x_TD.contiguous(),
                  topk_ids_TK.contiguous(), topk_weights_TK.float().contiguous(), dest, msg,
                  counts, t, arena.rank, opts.spin_limit)
        return msg, counts

    def dispatch_recv(self, counts: torch.Tensor,
                      opts: SymmOptions) -> tuple[QTensor, torch.Tensor, torch.Tensor | None]:
        """Wait for every rank (staged: then copy each staged token into its experts' rows) ->
        (x [E_L, C, D], a view of the arena valid until this rank's next combine_send;
        counts_E int32 [E_L], from dispatch_send; rows_EC None). ll_gather: x is the staged
        rows [C, D] and rows_EC int32 [E_L, C] the one each masked row reads (`MaskedBatch`)."""
        self.recv(self.recv_grid, self.arena.base, counts, opts.spin_limit)
        return self.x, counts, self.rows_EC


__all__ = ["LLShape", "LLDispatch"]
