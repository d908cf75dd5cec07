"""The sender's routing table for symm-ht, on the device, without a host sync.

For this rank's tokens and their physical expert ids (experts in contiguous blocks of E_local
per rank, -1 = empty slot):

  pos_TK    int32 [T, K]  rank of (t, k) among this rank's pairs for the same expert, in token
                          order (-1 for empty slots): the receiver's row within that expert's
                          group is offset + (pairs of lower source ranks) + pos
  msg_TW    int32 [T, W]  index of token t among the tokens sent to rank d (a token goes once
                          to every rank holding one of its experts: dedup), -1 if not sent
  total_C   int32 [E + W] pairs per expert, then tokens sent per destination rank

Two passes over token chunks (counts per chunk, torch's inclusive cumsum over chunks, then
positions inside each chunk with `tl.cumsum`). Expert ids of one token must be distinct (top-k
over experts; EPLB replicas are distinct physical slots).
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.kernels._common import INTERPRET, next_pow2

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


@triton.jit
def _route_count_kernel(ids_ptr, cnt_ptr, T, K: tl.constexpr, E: tl.constexpr,
                        E_L: tl.constexpr, COLS: tl.constexpr, COLSP: tl.constexpr,
                        BT: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    hit = _hits(ids_ptr, t, t < T, K, E, E_L, COLSP, BT)
    c = tl.arange(0, COLSP)
    tl.store(cnt_ptr + pid * COLS + c, tl.sum(hit, axis=0), mask=c < COLS)


@triton.jit
def _route_pos_kernel(ids_ptr, incl_ptr, pos_ptr, msg_ptr, T, K: tl.constexpr,
                      E: tl.constexpr, E_L: tl.constexpr, W: tl.constexpr, COLS: tl.constexpr,
                      COLSP: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    tm = t < T
    hit = _hits(ids_ptr, t, tm, K, E, E_L, COLSP, BT)
    c = tl.arange(0, COLSP)
    incl = tl.load(incl_ptr + pid * COLS + c, mask=c < COLS, other=0)
    # exclusive position: chunks before this one, then tokens before t inside the chunk
    excl = incl[None, :] - tl.sum(hit, axis=0)[None, :] + tl.cumsum(hit, axis=0) - hit
    kk = tl.arange(0, KP)
    km = kk < K
    t64 = t.to(tl.int64)
    ids = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=tm[:, None] & km[None, :],
                  other=-1).to(tl.int32)
    pos = tl.zeros((BT, KP), dtype=tl.int32) - 1
    for k in tl.static_range(K):
        e_k = tl.sum(tl.where(kk[None, :] == k, ids, 0), axis=1)
        p_k = tl.sum(tl.where(c[None, :] == e_k[:, None], excl, 0), axis=1)
        pos = tl.where((kk[None, :] == k) & (e_k >= 0)[:, None], p_k[:, None], pos)
    tl.store(pos_ptr + t64[:, None] * K + kk[None, :], pos, mask=tm[:, None] & km[None, :])
    for d in tl.static_range(W):
        col = c[None, :] == E + d
        sent = tl.sum(tl.where(col, hit, 0), axis=1) > 0
        m = tl.sum(tl.where(col, excl, 0), axis=1)
        tl.store(msg_ptr + t64 * W + d, tl.where(sent, m, -1), mask=tm)


@dataclass(frozen=True)
class SendRoute:
    """The sender's table (see the module docstring); total_C stays on the device."""

    pos_TK: torch.Tensor
    msg_TW: torch.Tensor
    total_C: torch.Tensor


def route(topk_ids_TK: torch.Tensor, num_experts: int, world: int) -> SendRoute:
    """Positions and dedup table for this rank's tokens (no host sync; CUDA-graph safe)."""
    t, k = topk_ids_TK.shape
    if num_experts % world:
        raise ValueError(f"physical experts ({num_experts}) must be divisible by ep ({world})")
    e_l = num_experts // world
    dev = topk_ids_TK.device
    ids = topk_ids_TK.contiguous()
    cols = num_experts + world
    colsp = next_pow2(cols)
    bt = 64 if INTERPRET else max(1, min(16, 8192 // colsp))
    chunks = max(1, triton.cdiv(t, bt))
    cnt = torch.empty((chunks, cols), dtype=torch.int32, device=dev)
    meta = dict(K=k, E=num_experts, E_L=e_l, COLS=cols, COLSP=colsp, BT=bt)
    _route_count_kernel[(chunks,)](ids, cnt, t, **meta)
    incl = torch.cumsum(cnt, 0, dtype=torch.int32)
    pos = torch.empty((t, k), dtype=torch.int32, device=dev)
    msg = torch.empty((t, world), dtype=torch.int32, device=dev)
    _route_pos_kernel[(chunks,)](ids, incl, pos, msg, t, W=world, KP=next_pow2(k), **meta)
    return SendRoute(pos, msg, incl[-1])


__all__ = ["route", "SendRoute"]
