"""symm-ll dispatch: decode-sized batches straight into the peers' masked layout, fp8
quantization fused into the send (the combine is in `ll_combine.py`). Regions of the LL arena
(`LLShape.layout`), C = W * TMAX rows per local expert (every token of every rank on one expert):

  ll_slots  [E_L] int32          rows filled per local expert (peers take a row with a system-
                                 scope atomic_add; reset by this rank's combine_send)
  ll_data   [E_L][C][D]          fp8 or bf16 rows: the MaskedBatch x is a view of this region
  ll_scale  [E_L][G][C] fp32     scales per 128 columns, C unit stride (DeepGEMM's TMA layout)
  ll_meta   [E_L][C] int32       (source rank * TMAX + token) * K + k of each row
  ll_msg    [W][TMAX] MW words   source s's token t, if it sent any slot here: the dispatch
                                 epoch, then per slot k its row here (le * C + slot; -1: not
                                 here) and its fp32 weight (what combine_send reduces)
  ll_ntok   [W] int32            tokens source s dispatched (combine_send scans only those)
  ll_comb   [2][W][TMAX][D] bf16 rank s's fp32-reduced partial sum for my token t (buffer =
                                 combine epoch % 2; as HT's ht_comb)

The masked region and the messages are single-buffered (the batch is a view of the region, and
a host-chosen parity would freeze in a CUDA graph): a sender waits until every peer's
combine_send of the previous call has released them (ack), which in a dispatch -> experts ->
combine sequence never spins. A message is current when its epoch word equals the dispatch's
epoch (epochs are the same on every rank: each counts its own calls), so nothing is cleared
between calls. Rows of one expert arrive in atomic order (not token order); row contents are
exact. The send takes the rows of all its (token, k) pairs first (one vector of system-scope
atomics per 16 tokens, kept in a [T, K] scratch), then quantizes each token once and stores it
K times, each time with the message of its destination (written once per slot: a rank holding
several of a token's slots receives the same message several times, which is cheaper than
finding the first).
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.kernels._common import INTERPRET, next_pow2, round_bf16, round_e4m3
from epmoe.kernels.launcher import Launcher

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm.arena import LL_DISPATCH, ArenaLayout, RankArena  # noqa: E402
from epmoe.comm.symm.options import LL_SMS, SymmOptions, grid  # noqa: E402
from epmoe.comm.symm.sync import (C_SEQ, USE_TIMER, ctrl_ptr, epoch, finish_send,  # noqa: E402
                                  peer_ptr, wait_acks, wait_ready)
from epmoe.comm.symm.tiles import row_cols  # noqa: E402
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
            ("ll_msg", c * self.msg_words * 4),
            ("ll_ntok", self.world * 4),
            ("ll_comb", 2 * c * d * 2)])


@triton.jit
def _quantize_rows(x, P: tl.constexpr, CH: tl.constexpr, POW2: tl.constexpr,
                   PRE_ROUND: tl.constexpr):
    """fp32 [P, CH] -> (fp8 codes as fp32 [P, CH], scales [P, CH // 128]): epmoe.quant's rule
    per 128 columns (amax >= 1e-10, scale = amax / 448, or its power-of-two ceiling)."""
    xg = tl.reshape(x, (P, CH // 128, 128))
    amax = tl.maximum(tl.max(tl.abs(xg), axis=2), 1e-10)
    s = tl.math.div_rn(amax, 448.0)
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        e8 = ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (e8 << 23).to(tl.float32, bitcast=True)
    q = tl.math.div_rn(xg, s[:, :, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if PRE_ROUND:
        q = round_e4m3(q)
    return tl.reshape(q, (P, CH)), s


@triton.jit(do_not_specialize=["T", "me", "limit"])
def _dispatch_send_kernel(arena_ptr, delta_ptr, x_ptr, ids_ptr, w_ptr, slot_ptr, msg_ptr, T,
                          me, limit, SLOTS: tl.constexpr, DATA: tl.constexpr,
                          SCALE: tl.constexpr, META: tl.constexpr, MSG: tl.constexpr,
                          MW: tl.constexpr, NTOK: tl.constexpr, TMAX: tl.constexpr,
                          W: tl.constexpr,
                          WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                          E_L: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
                          CH: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr,
                          FP8: tl.constexpr, POW2: tl.constexpr, PRE_ROUND: tl.constexpr,
                          BT: tl.constexpr, SA: tl.constexpr, USE_TIMER: tl.constexpr):
    """1: rows for this CTA's (token, k) pairs, SA tokens per vector of system-scope atomics
    (one round trip for a decode batch), kept in slot_TK (-1: none) with the rows' meta; the
    tokens' msg_TW rows cleared. 2: per step of BT tokens, the whole rows load together; each
    row is quantized once and stored to its K rows, each with its destination's message."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    e = epoch(arena_ptr, OP_D)
    ok = wait_acks(arena_ptr, OP_D, e - 1, limit, W, USE_TIMER)
    if ok != 0:
        kk = tl.arange(0, KP)
        km = kk < K
        jj = tl.arange(0, SA)
        dd = tl.arange(0, WP)
        steps = (T + G * BT - 1) // (G * BT)
        for s0 in range(0, steps, SA // BT):  # this CTA's tokens, as the steps below take them
            t = pid * BT + (s0 + jj // BT) * G * BT + jj % BT
            m2 = (t < T)[:, None] & km[None, :]
            t64 = t.to(tl.int64)
            ids = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=-1)
            ids = ids.to(tl.int32)
            valid = ids >= 0
            d = tl.where(valid, ids // E_L, 0)
            base = arena_ptr + tl.load(delta_ptr + d)
            le = ids - d * E_L
            slot = tl.atomic_add((base + SLOTS).to(tl.pointer_type(tl.int32)) + le, 1,
                                 mask=valid, sem="relaxed", scope="sys")
            valid = valid & (slot < C)
            tl.store((base + META).to(tl.pointer_type(tl.int32)) + le * C + slot,
                     (me * TMAX + t[:, None]) * K + kk[None, :], mask=valid)
            tl.store(slot_ptr + t64[:, None] * K + kk[None, :], tl.where(valid, slot, -1),
                     mask=m2)
            tl.store(msg_ptr + t64[:, None] * W + dd[None, :], -1,
                     mask=(t < T)[:, None] & (dd < W)[None, :])
        tl.debug_barrier()  # the slots this CTA took and its cleared msg_TW rows, CTA-wide
        cols = tl.arange(0, CH)
        cm = cols < D
        g = tl.arange(0, NGP)
        gm = g < NG
        for t0 in range(pid * BT, T, G * BT):
            t = t0 + tl.arange(0, BT)
            tm = t < T
            t64 = t.to(tl.int64)
            x = tl.load(x_ptr + t64[:, None] * D + cols[None, :], mask=tm[:, None] & cm[None, :],
                        other=0.0).to(tl.float32)
            # the token's slots as tiles, for the messages: rank, row there, weight
            m2 = tm[:, None] & km[None, :]
            slot2 = tl.load(slot_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=-1)
            ids2 = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=0)
            ids2 = ids2.to(tl.int32)
            w2 = tl.load(w_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=0.0)
            d2 = tl.where(slot2 >= 0, ids2 // E_L, -1)
            row2 = (ids2 - d2 * E_L) * C + slot2
            if FP8:
                q, sc = _quantize_rows(x, BT, CH, POW2, PRE_ROUND)
                q = q.to(tl.float8e4nv)
            else:
                if PRE_ROUND:
                    x = round_bf16(x)
                q = x.to(tl.bfloat16)
            for k in tl.static_range(K):
                # slot k of each token: its own [BT] loads (no pick out of a [BT, KP] tile:
                # a cross-thread reduction per k and field costs more than the loads)
                sk = tl.load(slot_ptr + t64 * K + k, mask=tm, other=-1)
                vk = sk >= 0
                idk = tl.load(ids_ptr + t64 * K + k, mask=vk, other=0).to(tl.int32)
                dk = idk // E_L
                lek = idk - dk * E_L
                pk = peer_ptr(arena_ptr, delta_ptr, dk)
                rk = (lek * C + sk).to(tl.int64)
                m2k = vk[:, None] & cm[None, :]
                if FP8:
                    dst = (pk + DATA).to(tl.pointer_type(tl.float8e4nv)) + rk * D
                    tl.store(dst[:, None] + cols[None, :], q, mask=m2k)
                    # scales [E_L][G][C]: (le * NG + g) * C + slot
                    sdst = (pk + SCALE).to(tl.pointer_type(tl.float32)) \
                        + lek.to(tl.int64) * NG * C + sk
                    tl.store(sdst[:, None] + g[None, :].to(tl.int64) * C, sc,
                             mask=vk[:, None] & gm[None, :])
                else:
                    dst = (pk + DATA).to(tl.pointer_type(tl.bfloat16)) + rk * D
                    tl.store(dst[:, None] + cols[None, :], q, mask=m2k)
                # the message of (me, t) at rank dk: epoch, rows there, weights
                here = (d2 == dk[:, None]) & m2
                msg = (pk + MSG).to(tl.pointer_type(tl.int32)) + (me * TMAX + t64) * MW
                mk = vk[:, None] & km[None, :]
                tl.store(msg, e, mask=vk)
                tl.store(msg[:, None] + 1 + kk[None, :], tl.where(here, row2, -1), mask=mk)
                tl.store((msg + 1 + K).to(tl.pointer_type(tl.float32))[:, None] + kk[None, :],
                         tl.where(here, w2, 0.0), mask=mk)
                tl.store(msg_ptr + t64 * W + dk, t, mask=vk)
        if pid == 0:
            for d in tl.static_range(W):
                tl.store((peer_ptr(arena_ptr, delta_ptr, d) + NTOK).to(tl.pointer_type(tl.int32))
                         + me, T)
    finish_send(arena_ptr, delta_ptr, OP_D, e, me, W)


@triton.jit(do_not_specialize=["limit"])
def _dispatch_recv_kernel(arena_ptr, counts_ptr, limit, SLOTS: tl.constexpr, W: tl.constexpr,
                          E_L: tl.constexpr, EP: tl.constexpr, C: tl.constexpr,
                          USE_TIMER: tl.constexpr):
    e = epoch(arena_ptr, OP_D)
    ok = wait_ready(arena_ptr, OP_D, e, limit, W, USE_TIMER)
    ee = tl.arange(0, EP)
    cnt = tl.load((arena_ptr + SLOTS).to(tl.pointer_type(tl.int32)) + ee, mask=ee < E_L,
                  other=0)
    tl.store(counts_ptr + ee, tl.where(ok != 0, tl.minimum(cnt, C), 0), mask=ee < E_L)
    tl.store(ctrl_ptr(arena_ptr, C_SEQ + OP_D), e)


# --------------------------------------------------------------------------------------------
class LLDispatch:
    """The dispatch's two kernels with their constants bound once, and the masked batch's
    views of the arena (a backend builds it at construction: a call then pays the launches,
    not Triton's per-call binding; `epmoe.kernels.launcher`)."""

    def __init__(self, arena: RankArena, shape: LLShape, quant: QuantConfig, opts: SymmOptions):
        lay, d, dev = arena.layout, shape.hidden, arena.base.device
        self.arena, self.shape = arena, shape
        bt = opts.tile(1)  # one token per step: fewest steps per CTA at decode sizes (sweep)
        self.send = Launcher(_dispatch_send_kernel, dict(
            SLOTS=lay.offset("ll_slots"), DATA=lay.offset("ll_data"),
            SCALE=lay.offset("ll_scale"), META=lay.offset("ll_meta"), MSG=lay.offset("ll_msg"),
            MW=shape.msg_words, NTOK=lay.offset("ll_ntok"), TMAX=max(1, shape.max_tokens),
            W=shape.world, WP=next_pow2(shape.world), K=shape.top_k,
            KP=next_pow2(shape.top_k), E_L=shape.num_local_experts, C=shape.capacity, D=d,
            CH=row_cols(d), NG=shape.num_groups, NGP=next_pow2(max(1, row_cols(d) // GROUP)),
            FP8=shape.fp8, POW2=shape.fp8 and quant.scale_fmt != "fp32", PRE_ROUND=INTERPRET,
            BT=bt, SA=next_pow2(16 * bt), USE_TIMER=USE_TIMER), num_warps=opts.warps())
        self.send_grid = (grid(opts, dev, send_default=LL_SMS),)
        e_l, c = shape.num_local_experts, shape.capacity
        self.recv = Launcher(_dispatch_recv_kernel, dict(
            SLOTS=lay.offset("ll_slots"), W=shape.world, E_L=e_l, EP=next_pow2(e_l), C=c,
            USE_TIMER=USE_TIMER))
        fmt = "ue8m0_fp32" if quant.scale_fmt == "ue8m0_packed" else quant.scale_fmt
        if shape.fp8:
            data = arena.words("ll_data", torch.uint8).view(FP8_DTYPE).view(e_l, c, d)
            scale = arena.words("ll_scale", torch.float32).view(e_l, shape.num_groups, c)
            self.x = QTensor(data, scale.transpose(1, 2), quant.recipe, GROUP, fmt)
        else:
            data = arena.words("ll_data", torch.bfloat16).view(e_l, c, d)
            self.x = QTensor(data, None, "bf16", 0, fmt)

    def dispatch_send(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                      topk_weights_TK: torch.Tensor, opts: SymmOptions) -> torch.Tensor:
        """Quantize (fp8_block: per 128 columns) and write every (token, k) row into the
        masked layout of the rank holding expert k, with each destination's message. ->
        msg_TW int32 [T, W]: >= 0 where the token went to that rank (combine_recv sums those
        partials)."""
        shape, arena = self.shape, self.arena
        t = x_TD.shape[0]
        if t > shape.max_tokens:
            raise ValueError(f"tokens per rank ({t}) exceed the low-latency arena's "
                             f"max_tokens_per_rank ({shape.max_tokens}); size the CommContext "
                             f"for the run's worst case or use symm-ht")
        slot = torch.empty((t, shape.top_k), dtype=torch.int32, device=x_TD.device)
        msg = torch.empty((t, shape.world), dtype=torch.int32, device=x_TD.device)
        self.send(self.send_grid, arena.base, arena.peer_delta_W, x_TD.contiguous(),
                  topk_ids_TK.contiguous(), topk_weights_TK.float().contiguous(), slot, msg, t,
                  arena.rank, opts.spin_limit)
        return msg

    def dispatch_recv(self, opts: SymmOptions) -> tuple[QTensor, torch.Tensor]:
        """Wait for every rank -> (x [E_L, C, D], a view of the arena valid until this rank's
        next combine_send; counts_E int32 [E_L])."""
        counts = torch.empty(self.shape.num_local_experts, dtype=torch.int32,
                             device=self.arena.base.device)
        self.recv((1,), self.arena.base, counts, opts.spin_limit)
        return self.x, counts


__all__ = ["LLShape", "LLDispatch"]
