"""The sender's routing table for symm-ht, on the device, without a host sync.

For this rank's tokens and their physical expert ids (experts in contiguous blocks of E_local
per rank, -1 = empty slot):

  pos_TK    int32 [T, K]  rank of (t, k) among this rank's pairs for the same expert, in token
                          order (-1 for empty slots): the receiver's row within that expert's
                          group is offset + (pairs of lower source ranks) + pos
  msg_TW    int32 [T, W]  index of token t among the tokens sent to rank d (a token goes once
                          to every rank holding one of its experts: dedup), -1 if not sent
  tok_WT    int32 [W, T]  the inverse of msg_TW: tok_WT[d, m] = the token sent as rank d's m-th
                          (m < tokens sent to d; the rest is not written)
  total_C   int32 [E + W] pairs per expert, then tokens sent per destination rank

Three small kernels over token chunks (no host sync): counts per chunk and column, their
inclusive scan over chunks, then per chunk the position of every (t, k) pair (its rank among the
chunk's earlier pairs of the same expert: one [P, P] compare, P = pairs per chunk) and of every
token among those sent to each rank. Expert ids of one token must be distinct (top-k over
experts; EPLB replicas are distinct physical slots).
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.kernels._common import INTERPRET, next_pow2
from epmoe.kernels.launcher import Launcher

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _hits(ids_ptr, t, tm, K: tl.constexpr, E: tl.constexpr, E_L: tl.constexpr,
          COLSP: tl.constexpr, BT: tl.constexpr):
    """[BT, COLSP] int32: token t uses column c (expert c < E, or destination rank E + d)."""
    c = tl.arange(0, COLSP)
    hit = tl.zeros((BT, COLSP), dtype=tl.int32)
    for k in tl.static_range(K):
        e = tl.load(ids_ptr + t.to(tl.int64) * K + k, mask=tm, other=-1).to(tl.int32)
        dcol = E + e // E_L
        h = ((c[None, :] == e[:, None]) | (c[None, :] == dcol[:, None])) & (e >= 0)[:, None]
        hit = hit | h.to(tl.int32)
    return hit


@triton.jit(do_not_specialize=["T"])
def _route_count_kernel(ids_ptr, cnt_ptr, T, K: tl.constexpr, E: tl.constexpr,
                        E_L: tl.constexpr, COLS: tl.constexpr, COLSP: tl.constexpr,
                        BT: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    hit = _hits(ids_ptr, t, t < T, K, E, E_L, COLSP, BT)
    c = tl.arange(0, COLSP)
    tl.store(cnt_ptr + pid * COLS + c, tl.sum(hit, axis=0), mask=c < COLS)


@triton.jit(do_not_specialize=["chunks"])
def _route_scan_kernel(cnt_ptr, incl_ptr, chunks, COLS: tl.constexpr, BC: tl.constexpr,
                       RB: tl.constexpr):
    """incl[c] = sum of cnt[0..c] over chunks (inclusive), BC columns per program."""
    col = tl.program_id(0) * BC + tl.arange(0, BC)
    cm = col < COLS
    carry = tl.zeros((BC,), dtype=tl.int32)
    for r0 in range(0, chunks, RB):
        r = r0 + tl.arange(0, RB)
        m = (r < chunks)[:, None] & cm[None, :]
        x = tl.load(cnt_ptr + r[:, None] * COLS + col[None, :], mask=m, other=0)
        tl.store(incl_ptr + r[:, None] * COLS + col[None, :],
                 tl.cumsum(x, axis=0) + carry[None, :], mask=m)
        carry += tl.sum(x, axis=0)


@triton.jit(do_not_specialize=["T"])
def _route_pos_kernel(ids_ptr, incl_ptr, cnt_ptr, pos_ptr, msg_ptr, tok_ptr, T,
                      K: tl.constexpr, E: tl.constexpr, E_L: tl.constexpr, W: tl.constexpr,
                      COLS: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr):
    """Positions of one chunk: pairs are ranked by their flat index t * KP + k (token order:
    one token's expert ids are distinct), base = pairs of earlier chunks (incl - cnt)."""
    pid = tl.program_id(0)
    f = tl.arange(0, BT * KP)
    t = pid * BT + f // KP
    k = f % KP
    pm = (t < T) & (k < K)
    t64 = t.to(tl.int64)
    e = tl.load(ids_ptr + t64 * K + k, mask=pm, other=-1).to(tl.int32)
    v = e >= 0
    before = (e[:, None] == e[None, :]) & (f[None, :] < f[:, None]) & v[None, :]
    within = tl.sum(before.to(tl.int32), axis=1)
    row = pid * COLS + e
    base = tl.load(incl_ptr + row, mask=v, other=0) - tl.load(cnt_ptr + row, mask=v, other=0)
    tl.store(pos_ptr + t64 * K + k, tl.where(v, base + within, -1), mask=pm)
    tok = pid * BT + tl.arange(0, BT)
    tm = tok < T
    kk = tl.arange(0, KP)
    ids = tl.load(ids_ptr + tok.to(tl.int64)[:, None] * K + kk[None, :],
                  mask=tm[:, None] & (kk < K)[None, :], other=-1).to(tl.int32)
    for d in tl.static_range(W):
        on_d = (ids >= d * E_L) & (ids < (d + 1) * E_L)
        sent = tl.max(on_d.to(tl.int32), axis=1)
        col = pid * COLS + E + d
        m = tl.load(incl_ptr + col) - tl.load(cnt_ptr + col) + tl.cumsum(sent, axis=0) - sent
        tl.store(msg_ptr + tok.to(tl.int64) * W + d, tl.where(sent > 0, m, -1), mask=tm)
        tl.store(tok_ptr + d * T + m, tok, mask=tm & (sent > 0))


@dataclass(frozen=True)
class SendRoute:
    """The sender's table (see the module docstring); total_C stays on the device."""

    pos_TK: torch.Tensor
    msg_TW: torch.Tensor
    tok_WT: torch.Tensor
    total_C: torch.Tensor


class SendRouter:
    """The three routing kernels with their constants bound once (a backend builds it at
    construction; `epmoe.kernels.launcher`): call with topk_ids_TK [T, top_k]."""

    def __init__(self, num_experts: int, world: int, top_k: int):
        if num_experts % world:
            raise ValueError(f"physical experts ({num_experts}) must be divisible by ep "
                             f"({world})")
        self.world, self.top_k = world, top_k
        self.cols = cols = num_experts + world
        colsp = next_pow2(cols)
        self.bt = bt = 64 if INTERPRET else max(1, min(16, 8192 // colsp))
        meta = dict(K=top_k, E=num_experts, E_L=num_experts // world, COLS=cols, BT=bt)
        self.count = Launcher(_route_count_kernel, dict(COLSP=colsp, **meta))
        self.scan = Launcher(_route_scan_kernel, dict(COLS=cols, BC=128,
                                                      RB=2 if INTERPRET else 32))
        self.scan_grid = (triton.cdiv(cols, 128),)
        self.pos = Launcher(_route_pos_kernel, dict(W=world, KP=next_pow2(top_k), **meta))

    def __call__(self, topk_ids_TK: torch.Tensor) -> SendRoute:
        """Positions and dedup table for this rank's tokens (no host sync; CUDA-graph
        safe)."""
        t, k = topk_ids_TK.shape
        if k != self.top_k:
            raise ValueError(f"topk_ids_TK has {k} columns, the router was built for top_k "
                             f"{self.top_k}")
        dev, cols = topk_ids_TK.device, self.cols
        ids = topk_ids_TK.contiguous()
        chunks = max(1, triton.cdiv(t, self.bt))
        cnt = torch.empty((chunks, cols), dtype=torch.int32, device=dev)
        self.count((chunks,), ids, cnt, t)
        incl = torch.empty((chunks, cols), dtype=torch.int32, device=dev)
        self.scan(self.scan_grid, cnt, incl, chunks)
        pos = torch.empty((t, k), dtype=torch.int32, device=dev)
        msg = torch.empty((t, self.world), dtype=torch.int32, device=dev)
        tok = torch.empty((self.world, max(t, 1)), dtype=torch.int32, device=dev)
        self.pos((chunks,), ids, incl, cnt, pos, msg, tok, t)
        return SendRoute(pos, msg, tok, incl[-1])


__all__ = ["SendRoute", "SendRouter"]
