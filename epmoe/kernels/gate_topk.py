"""Router kernel: (gate GEMM +) scoring + grouped top-k in one Triton launch.

A gate's routing runs one of two ways (`gate_way`, by measurement): split, cuBLAS's bf16 GEMM
with fp32 logits out, then this kernel on the logits; or fused, this kernel doing the GEMM too.

One program owns BLOCK_M tokens and the whole expert row (BLOCK_E >= E columns in registers):
  FUSED   logits = x [T, D] @ gate [E, D].T as a bf16 GEMM with fp32 accumulation (the logits
          never reach memory), else fp32 logits are read
  scores  softmax (selection on the logits: same order), sigmoid, sqrt(softplus) (softplus
          = x above 20, else an accurate log1p(exp(x))), or softmax_biased's softmax
  bias    softmax: added to the logits (gpt-oss); score routers: added to the scores for
          selection only (e_score_correction_bias)
  select  scores (+ bias); with n_group > 1 only the topk_group groups with the best sum of
          their top-2 biased scores stay (the softmax router: their best logit, DeepSeek-V2's
          group_limited_greedy); then top_k by repeated arg-max (first index on ties)
  weights the unbiased scores of the chosen experts, renormalized if asked (/ (sum +
          renorm_eps)), times the routed scaling factor
  HASH    a hash layer (DeepSeek-V4): no selection, no bias; the experts are the table's row
          of each token id (tid2eid [vocab, K]), weighted as above. A token id outside the
          table gets expert 0 at weight NaN (loud downstream; no read outside the table)
These are `epmoe.router.route`'s and `hash_route`'s rules. Ids match the torch path wherever
no two candidates tie (within the scores' last-bit differences: exp/sigmoid here use the fast
hardware exponent); weights agree to ~1e-6 relative.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from epmoe.kernels._common import INTERPRET, check, next_pow2

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.config import MoEConfig  # noqa: E402
from epmoe.router import group_best  # noqa: E402

_KIND = {"softmax": 0, "sigmoid_grouped": 1, "sqrtsoftplus": 2, "softmax_biased": 3}
_MAX_BLOCK_E = 512
_MAX_GROUPS = 64  # groups are unrolled where they do not tile a power-of-two row


@dataclass(frozen=True)
class RouterConfig:
    """tokens per program, K step of the gate GEMM, warps, pipeline stages."""

    block_m: int = 64
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4


# Tuned on one H200 at 4096 tokens x 256 experts x 7168 (`python -m epmoe.bench.kernel_tune`,
# 2026-12-01): 64 tokens, K step 64, 8 warps, 4 stages 117.7 us (32/64/4 warps 118.5, 64/64/4
# warps 195.2; K step 128 at 3 stages needs 240 KB of shared memory: refused).
TUNED_ROUTER = RouterConfig(64, 64, 8, 4)
# Per expert-row width (BLOCK_E) where it differs (`python -m epmoe.bench.router_tune`, one
# H100, 2026-12-07: 256 experts 80 / 174 us at 4096 / 16384 tokens, 115 / 271 before).
TUNED_ROUTERS: dict[int, RouterConfig] = {256: RouterConfig(64, 64, 16, 4)}
# On given logits there is no GEMM to feed: one token a program, one warp (one H100,
# 2026-12-07, the kernel alone at 1 / 128 / 4096 tokens: DeepSeek-V3 5.3 / 5.5 / 13.0 us
# against 9.9 / 10.0 / 15.9 at the former 16 tokens x 8 warps; Kimi-K2 5.7 / 6.1 / 18.1 vs
# 12.7 / 12.9 / 23.6; Qwen3-235B 4.4 / 4.6 / 8.0 vs 5.7 / 6.4 / 8.0; BENCHMARKS.md 46).
LOGITS_ROUTER = RouterConfig(1, 64, 1, 1)
# The gate GEMM's two ways (BENCHMARKS.md 45): "split", cuBLAS's bf16 GEMM with fp32 logits
# out and then the routing kernel on them, and "fused", one launch whose logits never reach
# memory. Each fused program streams the whole gate [E, D] through its own SM, so the fused
# way wins only with many programs and a small gate: at 128 experts split took 0.70-0.75x
# the fused time at 4096 tokens and 1.15-1.19x at 16384 (the switch between the two
# measured points); at 256 and 384 experts 0.17-0.56x up to 16384.
# BLOCK_E -> the tokens from which the fused way runs.
FUSED_FROM_TOKENS: dict[int, int] = {128: 12288}


def gate_way(num_experts: int, tokens: int) -> str:
    """'fused' or 'split': the faster way to route `tokens` through a gate of `num_experts`."""
    block_e = max(16, next_pow2(num_experts))
    need = min((t for width, t in FUSED_FROM_TOKENS.items() if block_e <= width), default=None)
    return "fused" if need is not None and tokens >= need else "split"


def gate_logits(x_TD: torch.Tensor, gate_ED: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ gate [E, D].T -> fp32 logits [T, E]: one bf16 GEMM with fp32 accumulation
    and output on CUDA (cuBLAS); elsewhere, or a torch without mm's out_dtype, in fp32 (bf16
    values are exact in fp32: the same products, another summation order)."""
    if x_TD.is_cuda:
        try:
            return torch.mm(x_TD, gate_ED.T, out_dtype=torch.float32)
        except TypeError:
            pass
    return torch.mm(x_TD.float(), gate_ED.float().T)


def router_config(num_experts: int) -> RouterConfig:
    """The launch's config for a router over `num_experts`: the tuned one for its row width,
    its tokens per program capped so the program's [BLOCK_M, BLOCK_E] fp32 scores stay at
    <= 16384 values."""
    block_e = max(16, next_pow2(num_experts))
    c = TUNED_ROUTERS.get(block_e, TUNED_ROUTER)
    return dataclasses.replace(c, block_m=max(16, min(c.block_m, 16384 // block_e)))


@triton.jit
def _order_key(v, idx, N: tl.constexpr):
    """fp32 v and its column idx (< N) as one int64 that orders as (v, then the lower idx):
    v's bits made monotone (negatives' magnitude bits flipped; -0.0 as +0.0, equal as floats
    are) above N - 1 - idx. One max reduction of these picks the best value and its first
    index at once."""
    b = tl.where(v == 0.0, 0, v.to(tl.int32, bitcast=True))
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return (b.to(tl.int64) << 32) | (N - 1 - idx).to(tl.int64)


@triton.jit
def _key_index(key, N: tl.constexpr):
    """The column index `_order_key` packed into key."""
    return N - 1 - (key & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _key_value(key):
    """The fp32 value `_order_key` packed into key."""
    b = (key >> 32).to(tl.int32)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.float32, bitcast=True)


@triton.jit
def _keep_groups(sel, cols, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, N_GROUP: tl.constexpr,
                 NG_PAD: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 GROUP_BEST: tl.constexpr):
    """sel [BLOCK_M, BLOCK_E] with the experts outside each token's TOPK_GROUP best groups at
    -inf; a group's score: the sum of its GROUP_BEST best entries (first index on ties)."""
    neg = float("-inf")
    gidx = tl.arange(0, NG_PAD)[None, :]
    grp = (cols // GROUP_SIZE)[None, :]
    if GROUP_SIZE * N_GROUP == BLOCK_E:  # the groups tile the row: one reshape
        g3 = tl.reshape(sel, (BLOCK_M, N_GROUP, GROUP_SIZE))
        if GROUP_BEST == 2 and GROUP_SIZE > 1:
            idx = tl.arange(0, GROUP_SIZE)[None, None, :]
            best = tl.max(_order_key(g3, idx, GROUP_SIZE), axis=2)
            first = _key_index(best, GROUP_SIZE)
            gscore = _key_value(best) + tl.max(tl.where(idx == first[:, :, None], neg, g3),
                                               axis=2)
        else:
            gscore = tl.max(g3, axis=2)
    else:  # E no power of two (DeepSeek-V2's 160 experts in 8 groups): group by group
        gscore = tl.full((BLOCK_M, NG_PAD), neg, tl.float32)
        for g in tl.static_range(N_GROUP):
            vg = tl.where(grp == g, sel, neg)
            if GROUP_BEST == 2 and GROUP_SIZE > 1:
                best = tl.max(_order_key(vg, cols[None, :], BLOCK_E), axis=1)
                first = _key_index(best, BLOCK_E)
                val = _key_value(best) + tl.max(tl.where(cols[None, :] == first[:, None], neg,
                                                         vg), axis=1)
            else:
                val = tl.max(vg, axis=1)
            gscore = tl.where(gidx == g, val[:, None], gscore)
    gkey = _order_key(gscore, gidx, NG_PAD)
    keep = gidx < 0
    for _ in tl.static_range(TOPK_GROUP):
        gi = _key_index(tl.max(gkey, axis=1), NG_PAD)
        hit = gidx == gi[:, None]
        keep = keep | hit
        gkey = tl.where(hit, -(2**63), gkey)
    if GROUP_SIZE * N_GROUP == BLOCK_E:
        g3 = tl.reshape(sel, (BLOCK_M, N_GROUP, GROUP_SIZE))
        out = tl.reshape(tl.where(keep[:, :, None], g3, neg), (BLOCK_M, BLOCK_E))
    else:
        kept = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.int32) != 0
        for g in tl.static_range(N_GROUP):
            kg = tl.sum(tl.where(gidx == g, keep.to(tl.int32), 0), axis=1) > 0
            kept = kept | ((grp == g) & kg[:, None])
        out = tl.where(kept, sel, neg)
    return out


@triton.jit
def _router_kernel(x_ptr, g_ptr, l_ptr, bias_ptr, ids_ptr, w_ptr, tab_ptr, tok_ptr, T, E, D, V,
                   stride_x, stride_g, stride_l, scaling, renorm_eps, KIND: tl.constexpr,
                   FUSED: tl.constexpr, HASH: tl.constexpr,
                   HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr,
                   GROUP_SIZE: tl.constexpr, GROUP_BEST: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   TOP_K: tl.constexpr, RENORM: tl.constexpr, INTERP: tl.constexpr,
                   EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_K: tl.constexpr, K_PAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < T
    cols = tl.arange(0, BLOCK_E)
    cm = cols < E
    if FUSED:  # rows / experts clamped: loads need no mask (garbage lands in masked lanes)
        offs_k = tl.arange(0, BLOCK_K)
        xp = x_ptr + tl.minimum(rows, T - 1).to(tl.int64)[:, None] * stride_x + offs_k[None, :]
        gp = g_ptr + tl.minimum(cols, E - 1).to(tl.int64)[:, None] * stride_g + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            if EVEN_K:
                x = tl.load(xp)
                g = tl.load(gp)
            else:
                km = (offs_k < D - k0)[None, :]
                x = tl.load(xp, mask=km, other=0.0)
                g = tl.load(gp, mask=km, other=0.0)
            if INTERP:
                acc = tl.dot(x.to(tl.float32), tl.trans(g.to(tl.float32)), acc)
            else:
                acc = tl.dot(x, tl.trans(g), acc)
            xp += BLOCK_K
            gp += BLOCK_K
        logits = acc
    else:
        logits = tl.load(l_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                         mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
    neg = float("-inf")
    if KIND == 0 and HAS_BIAS:  # the softmax router's bias is part of the logits (gpt-oss)
        logits += tl.load(bias_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    if KIND == 0 or KIND == 3:  # softmax scores (KIND 3: selected on score + bias, ERNIE 4.5)
        lg = tl.where(cm[None, :], logits, neg)
        p = tl.exp(lg - tl.max(lg, axis=1)[:, None])
        score = p / tl.sum(p, axis=1)[:, None]
    if KIND == 0:
        sel = lg  # softmax is monotone: select on the exact logits
    else:
        if KIND == 1:
            score = 1.0 / (1.0 + tl.exp(-logits))
        elif KIND == 2:
            u = tl.exp(logits)
            y = 1.0 + u
            log1p = tl.where(y == 1.0, u, tl.log(y) * (u / (y - 1.0)))
            score = tl.sqrt(tl.where(logits > 20.0, logits, log1p))
        sel = score
        if HAS_BIAS:
            sel += tl.load(bias_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        sel = tl.where(cm[None, :], sel, neg)
    if N_GROUP > 1 and not HASH:
        sel = _keep_groups(sel, cols, BLOCK_M, BLOCK_E, N_GROUP, NG_PAD, GROUP_SIZE, TOPK_GROUP,
                           GROUP_BEST)
    kc = tl.arange(0, K_PAD)[None, :]
    ids = tl.zeros((BLOCK_M, K_PAD), dtype=tl.int32)
    ws = tl.zeros((BLOCK_M, K_PAD), dtype=tl.float32)
    if HASH:  # the table's experts of each token id (an id outside it: expert 0, NaN)
        tok = tl.load(tok_ptr + rows, mask=rm, other=0).to(tl.int64)
        bad = (tok < 0) | (tok >= V)
        tab = tab_ptr + tl.where(bad, 0, tok) * TOP_K
    if HASH:
        for j in tl.static_range(TOP_K):
            i = tl.where(bad, 0, tl.load(tab + j, mask=rm, other=0).to(tl.int32))
            wj = tl.sum(tl.where(cols[None, :] == i[:, None], score, 0.0), axis=1)
            ids = tl.where(kc == j, i[:, None], ids)
            ws = tl.where(kc == j, wj[:, None], ws)
    else:  # TOP_K rounds of one max over (score, index) keys, then one gather of the weights
        key = _order_key(sel, cols[None, :], BLOCK_E)
        for j in tl.static_range(TOP_K):
            i = _key_index(tl.max(key, axis=1), BLOCK_E)
            ids = tl.where(kc == j, i[:, None], ids)
            key = tl.where(cols[None, :] == i[:, None], -(2**63), key)
        ws = tl.where(kc < TOP_K, tl.gather(score, ids, axis=1), 0.0)
    if RENORM:  # + renorm_eps (LFM2-MoE's 1e-6; 0 elsewhere)
        ws = ws / tl.maximum(tl.sum(ws, axis=1) + renorm_eps, 1e-20)[:, None]
    ws = ws * scaling
    if HASH:
        ws = tl.where(bad[:, None], float("nan"), ws)
    out = rows.to(tl.int64)[:, None] * TOP_K + kc
    om = rm[:, None] & (kc < TOP_K)
    tl.store(ids_ptr + out, ids, mask=om)
    tl.store(w_ptr + out, ws, mask=om)


def unsupported(cfg: MoEConfig) -> str | None:
    """None if the kernel handles this router config, else why not (the torch path runs)."""
    block_e = next_pow2(cfg.num_experts)
    if block_e > _MAX_BLOCK_E:
        return f"num_experts ({cfg.num_experts}) > {_MAX_BLOCK_E}"
    if cfg.n_group > _MAX_GROUPS:
        return f"n_group ({cfg.n_group}) > {_MAX_GROUPS}"
    return None


def _launch(x, gate, logits, cfg: MoEConfig, bias_E, config: RouterConfig | None,
            table=None, token_ids=None):
    why = unsupported(cfg)
    check(why is None, f"the router kernel cannot run this config: {why}; use the torch path "
          f"(backend='torch')")
    src = x if x is not None else logits
    t = src.shape[0]
    dev = src.device
    ids = torch.empty((t, cfg.top_k), dtype=torch.int32, device=dev)
    w = torch.empty((t, cfg.top_k), dtype=torch.float32, device=dev)
    if t == 0:
        return ids, w
    c = config or (router_config(cfg.num_experts) if x is not None else LOGITS_ROUTER)
    if c.block_m & (c.block_m - 1):  # the message only on failure: this runs every route
        check(False, f"block_m ({c.block_m}) must be a power of two")
    block_e = max(16, next_pow2(cfg.num_experts))
    block_m = min(c.block_m, 16384 // block_e)
    if x is not None:  # the fused GEMM's dot needs >= 16 rows; on logits a program may own 1
        block_m = 16 if INTERPRET else max(16, block_m)
    d = x.shape[1] if x is not None else 0
    has_bias = bias_E is not None
    hashed = table is not None
    _router_kernel[(triton.cdiv(t, block_m),)](
        x if x is not None else logits, gate if gate is not None else logits,
        logits if logits is not None else x, bias_E if has_bias else w, ids, w,
        table if hashed else ids, token_ids if hashed else ids,
        t, cfg.num_experts, d, table.shape[0] if hashed else 0,
        x.stride(0) if x is not None else 0,
        gate.stride(0) if gate is not None else 0,
        logits.stride(0) if logits is not None else 0, float(cfg.routed_scaling_factor),
        float(cfg.renorm_eps), KIND=_KIND[cfg.router], FUSED=x is not None, HASH=hashed,
        HAS_BIAS=has_bias,
        N_GROUP=cfg.n_group, NG_PAD=next_pow2(cfg.n_group),
        GROUP_SIZE=cfg.num_experts // cfg.n_group, GROUP_BEST=group_best(cfg),
        TOPK_GROUP=cfg.topk_group,
        TOP_K=cfg.top_k, RENORM=cfg.renormalize, INTERP=INTERPRET,
        EVEN_K=d % c.block_k == 0, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_K=c.block_k,
        K_PAD=max(2, next_pow2(cfg.top_k)), num_warps=c.num_warps, num_stages=c.num_stages)
    return ids, w


def triton_route_logits(logits_TE: torch.Tensor, cfg: MoEConfig, bias_E=None,
                        config: RouterConfig | None = None):
    """fp32 (or bf16) logits [T, E] -> (topk_ids_TK int32, topk_weights_TK fp32)."""
    check(logits_TE.stride(1) == 1, f"logits rows must be contiguous (stride "
          f"{logits_TE.stride()})")
    return _launch(None, None, logits_TE, cfg, bias_E, config)


def triton_gate_route(x_TD: torch.Tensor, gate_ED: torch.Tensor, cfg: MoEConfig, bias_E=None,
                      config: RouterConfig | None = None, way: str | None = None):
    """x [T, D] @ gate [E, D].T in bf16 with fp32 accumulation, then routing ->
    (topk_ids_TK int32, topk_weights_TK fp32). way: 'fused' (one launch) or 'split' (the
    GEMM, then the routing kernel on its fp32 logits); default `gate_way`'s pick. fp32 inputs
    are cast to bf16 first (keep the gate in bf16 to skip that copy)."""
    check(x_TD.dim() == 2 and gate_ED.dim() == 2 and x_TD.shape[1] == gate_ED.shape[1] and
          gate_ED.shape[0] == cfg.num_experts,
          f"x {tuple(x_TD.shape)} and gate {tuple(gate_ED.shape)} must be [T, D] and "
          f"[num_experts={cfg.num_experts}, D]")
    return _gate_launch(x_TD, gate_ED, cfg, bias_E, config, way)


def _gate_launch(x_TD, gate_ED, cfg: MoEConfig, bias_E, config, way: str | None,
                 table=None, token_ids=None):
    """The gate GEMM and the routing kernel, split (the logits through memory) or fused."""
    check(way in (None, "fused", "split"), f"way ({way!r}) must be 'fused', 'split' or None")
    x, gate = _bf16_rows(x_TD), _bf16_rows(gate_ED)
    if (way or gate_way(cfg.num_experts, x.shape[0])) == "split":
        return _launch(None, None, gate_logits(x, gate), cfg, bias_E, config, table, token_ids)
    return _launch(x, gate, None, cfg, bias_E, config, table, token_ids)


def _bf16_rows(t: torch.Tensor) -> torch.Tensor:
    """t in bf16 with contiguous rows (a copy only where needed)."""
    t = t.to(torch.bfloat16)
    return t if t.stride(1) == 1 else t.contiguous()


def triton_hash_route(x_TD: torch.Tensor | None, gate_ED: torch.Tensor | None,
                      tid2eid_VK: torch.Tensor, token_ids_T: torch.Tensor, cfg: MoEConfig,
                      logits_TE: torch.Tensor | None = None,
                      config: RouterConfig | None = None, way: str | None = None):
    """A hash layer's routing: the scores of x @ gate.T (bf16 GEMM, fp32 accumulation, fused
    or split as `triton_gate_route`; or given fp32 / bf16 logits), the experts
    tid2eid[token id], their scores as weights -> (topk_ids_TK int32, topk_weights_TK fp32).
    Shapes are checked by the caller (`epmoe.router.hash_gate_route`)."""
    tab = tid2eid_VK if tid2eid_VK.dtype == torch.int32 and tid2eid_VK.is_contiguous() \
        else tid2eid_VK.to(torch.int32).contiguous()
    tok = token_ids_T.contiguous()
    if logits_TE is not None:
        check(logits_TE.stride(1) == 1, f"logits rows must be contiguous (stride "
              f"{logits_TE.stride()})")
        return _launch(None, None, logits_TE, cfg, None, config, tab, tok)
    return _gate_launch(x_TD, gate_ED, cfg, None, config, way, tab, tok)


__all__ = ["triton_route_logits", "triton_gate_route", "triton_hash_route", "RouterConfig",
           "unsupported", "gate_way", "gate_logits"]
