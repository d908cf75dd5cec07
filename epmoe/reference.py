"""The float64 oracle: plain loops, dequantized weights, no shared code with the fast paths
except the recipe's quantize-dequantize of activations (fake quant, opt-out).

`reference_route` re-derives each router from its definition; `reference_moe` runs the whole
layer token by token, expert by expert. Every numerical test compares against these.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.quant import dequantize_act, quantize_act

# max |out - ref| / max |ref| allowed per recipe. Measured with the torch backend: 0.3-0.5%
# for every recipe (bf16 output rounding dominates); the margin covers fused kernels whose fp32
# sums differ in order (an fp8 code of the intermediate can flip). Layer outputs are bf16; fp8/fp4
# paths re-quantize the intermediate, where bf16 rounding of GEMM1 can flip an fp8 code.
TOLERANCE = {"bf16": 1e-2, "fp8_block": 2e-2, "mxfp8": 2e-2, "w4a8_mxfp4": 3e-2}
# W4A8: one fp8 code of the intermediate's largest values (a step of up to 1/14 of the group's
# amax at the top of e4m3's range) times a coarse e2m1 weight moves an output by a few % of
# max|out| at the tests' sizes: seen in CI on the torch experts, swiglu_clamp, one token whose
# fp32 GEMM1 in a batch summed in another order than alone: 2.32e-2 (2026-12-07, weight seed
# 248098386, seed 321965278; 2,400 other seed pairs at most 3.1e-3), then 3.02e-2 (weight seed
# 903696624, seed 919725040), past this tolerance. No fixed tolerance bounds such flips, so
# checks against fp32-summing experts allow `rounding_slack` on top of it: what rounding h to
# its other bf16 neighbour moves each output by (the 3.02e-2 case: 3.1e-3 past its slack).
# fp8_block, where one-code flips of the intermediate are larger (x 1.5) or more frequent
# (x 1.5); with both causes the factors multiply:
#  - power-of-two activation scales (ue8m0_fp32 / ue8m0_packed): a scale rounded up by up to 2x
#    leaves the group's codes up to one bit coarser, so the flips that GEMM1's fp32-vs-float64
#    rounding of h causes weigh up to twice as much. Measured on one H200 (2026-12-03, Triton
#    experts, hidden 512, 200 tokens): 1.9-2.03e-2 of max|out| at the largest.
#  - GEMMs on a GPU's fp8 tensor cores (`Experts.fp8_mma`: Triton, DeepGEMM): the MMA sums each
#    K block of 128 at reduced precision before the fp32 promotion, so 4-7% of GEMM1's bf16
#    outputs land one bf16 step from bf16(exact) (0.02-0.08% for an fp32 matmul of the same
#    values), and each one can move the group's amax or a code. Measured on one H200
#    (2026-12-03, deepseek-v3-tiny, 256 tokens, fresh seeds; Triton and DeepGEMM bit-equal):
#    fp32 scales, 106 layer checks (78 Triton, 28 DeepGEMM): median 1.3e-2, largest 2.46e-2;
#    ue8m0_fp32, 30 checks: median 1.16e-2, largest 2.86e-2; the torch experts on the same GPU
#    (fp32 matmul) 3.9-5.6e-3.
#    BENCHMARKS.md section 10.
POW2_SCALE_FACTOR = 1.5
FP8_MMA_FACTOR = 1.5


def tolerance(quant: QuantConfig, fp8_mma: bool = False) -> float:
    """The stated tolerance of a recipe and scale format (see TOLERANCE); fp8_mma: the experts
    ran their fp8 GEMMs on a GPU's fp8 tensor cores (`Experts.fp8_mma`)."""
    tol = TOLERANCE[quant.recipe]
    if quant.recipe == "fp8_block":
        tol *= POW2_SCALE_FACTOR if quant.scale_fmt != "fp32" else 1.0
        tol *= FP8_MMA_FACTOR if fp8_mma else 1.0
    return tol


def max_rel_err(out: torch.Tensor, ref: torch.Tensor, slack: torch.Tensor | None = None) -> float:
    """max |out - ref| / max |ref|; with `slack` (`rounding_slack`), the most any |out - ref|
    exceeds its slack by, over max |ref|."""
    ref = ref.double()
    diff = (out.double() - ref).abs()
    if slack is not None:
        diff = (diff - slack).clamp(min=0)
    diff = diff.max().item() if ref.numel() else 0.0
    if math.isnan(diff):
        return float("inf")
    return diff / max(ref.abs().max().item(), 1e-30)


class Oracle(NamedTuple):
    """One layer's weights in float64, as the oracle reads them.

    gate [E, D]; bias [E] or None (softmax router: added to the logits; score routers: the
    selection-only correction bias); w13 [E, 2I, D]; w2 [E, D, I]; shared (w13 [2Is, D],
    w2 [D, Is]) or None; b13 [E, 2I] / b2 [E, D] expert biases or None; shared_gate [D] or
    None (the shared output x sigmoid(x . shared_gate)); tid2eid [vocab, K] int or None (a
    hash layer: reference_hash_route). A plain 5-tuple (gate, bias, w13, w2,
    shared) is accepted wherever an Oracle is."""

    gate: torch.Tensor
    bias: torch.Tensor | None
    w13: torch.Tensor
    w2: torch.Tensor
    shared: tuple | None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    tid2eid: torch.Tensor | None = None  # a hash layer's experts per token id [vocab, K]


def reference_route(logits_TE: torch.Tensor, cfg: MoEConfig, bias_E=None):
    """-> (topk_ids [T, K] int64, topk_weights [T, K] float64), token by token."""
    t = logits_TE.shape[0]
    k = cfg.top_k
    ids = torch.empty(t, k, dtype=torch.long)
    ws = torch.empty(t, k, dtype=torch.float64)
    for n in range(t):
        s = _reference_scores(logits_TE[n], cfg, bias_E)
        # selection: the score routers on score + their correction bias
        b = s if cfg.router == "softmax" or bias_E is None else s + bias_E.double()
        allowed = set(range(cfg.num_experts))
        if cfg.n_group > 1:  # groups ranked by the sum of their best 2 (DeepSeek-V3) or their
            per = cfg.num_experts // cfg.n_group  # best 1 (V2's softmax group_limited_greedy)
            best = 1 if cfg.router == "softmax" else 2
            gscore = [sum(sorted(b[g * per:(g + 1) * per].tolist(), reverse=True)[:best])
                      for g in range(cfg.n_group)]
            groups = sorted(range(cfg.n_group), key=lambda g: -gscore[g])[:cfg.topk_group]
            allowed = {g * per + i for g in groups for i in range(per)}
        order = sorted(allowed, key=lambda e: -b[e].item())[:k]
        ids[n] = torch.tensor(order)
        ws[n] = _reference_weights(s, order, cfg)
    return ids, ws


def _reference_scores(lg: torch.Tensor, cfg: MoEConfig, bias_E=None) -> torch.Tensor:
    """One token's float64 scores over all experts (the softmax router's bias is part of its
    logits, gpt-oss's)."""
    lg = lg.double()
    if cfg.router in ("softmax", "softmax_biased"):
        if cfg.router == "softmax" and bias_E is not None:  # gpt-oss: logits = x W^T + b
            lg = lg + bias_E.double()
        s = torch.exp(lg - lg.max())
        return s / s.sum()
    if cfg.router == "sigmoid_grouped":
        return 1.0 / (1.0 + torch.exp(-lg))
    return torch.sqrt(torch.logaddexp(lg, torch.zeros_like(lg)))  # softplus, no overflow


def _reference_weights(s: torch.Tensor, order, cfg: MoEConfig) -> torch.Tensor:
    w = torch.stack([s[e] for e in order])
    if cfg.renormalize:
        w = w / (w.sum() + cfg.renorm_eps)
    return w * cfg.routed_scaling_factor


def reference_hash_route(logits_TE: torch.Tensor, cfg: MoEConfig, tid2eid_VK: torch.Tensor,
                         token_ids_T: torch.Tensor):
    """A hash layer (DeepSeek-V4's Gate with tid2eid), token by token: its experts
    tid2eid[token id], their weights the float64 scores of those experts, renormalized as
    configured, x routed_scaling_factor -> (ids [T, K] int64, weights [T, K] float64)."""
    t = logits_TE.shape[0]
    ids = torch.empty(t, cfg.top_k, dtype=torch.long)
    ws = torch.empty(t, cfg.top_k, dtype=torch.float64)
    for n in range(t):
        order = [int(e) for e in tid2eid_VK[int(token_ids_T[n])]]
        ids[n] = torch.tensor(order)
        ws[n] = _reference_weights(_reference_scores(logits_TE[n], cfg), order, cfg)
    return ids, ws


def _act(h: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    i = h.shape[-1] // 2
    g, u = h[..., :i], h[..., i:]
    lim = cfg.swiglu_limit
    if lim is not None:
        g = g.clamp(max=lim)
        u = u.clamp(-lim, lim)
    if cfg.activation == "swiglu":
        return g / (1 + torch.exp(-g)) * u
    a = cfg.activation_alpha
    return g / (1 + torch.exp(-a * g)) * (u + 1)


def _fake_quant(x: torch.Tensor, quant: QuantConfig, on: bool) -> torch.Tensor:
    if not on or quant.recipe == "bf16":
        return x.to(torch.bfloat16).double() if on else x
    return dequantize_act(quantize_act(x.float()[None], quant))[0].double()


def _quantized_act(h_NF, cfg, quant, b13_F=None):
    """The intermediate as the experts write it from GEMM1's bf16 h (rows): the activation in
    fp32 (the bias joins h in fp32, as the fused activation adds it), then quantized."""
    hf = h_NF.float() if b13_F is None else h_NF.float() + b13_F.float()
    a = _act(hf, cfg)
    if quant.recipe == "bf16":
        return a.to(torch.bfloat16).double()
    return dequantize_act(quantize_act(a, quant)).double()


def _mlp(x_D, w13_FD, w2_DI, cfg, quant, fq, b13_F=None, b2_D=None):
    h = w13_FD @ x_D
    if fq:  # GEMM1 writes bf16 in every fused path (DeepGEMM, Triton): part of the recipe
        # ...and the activation is evaluated in fp32 before it is quantized. h is bf16, so two
        # elements of a group often share a gate value and a/amax is an exact ratio that lands
        # on an fp8 rounding tie; float64 would then round it the other way from every fp32
        # path, a one-code flip worth ~2-3% of the output at small intermediate sizes.
        a = _quantized_act(h.to(torch.bfloat16).double()[None], cfg, quant, b13_F)[0]
    else:
        a = _fake_quant(_act(h if b13_F is None else h + b13_F.double(), cfg), quant, fq)
    y = w2_DI @ a
    return y if b2_D is None else y + b2_D.double()


def expert_mlp_ref(x_ND: torch.Tensor, w13_FD: torch.Tensor, w2_DI: torch.Tensor,
                   cfg: MoEConfig, quant: QuantConfig, fake_quant: bool = True,
                   b13_F=None, b2_D=None) -> torch.Tensor:
    """float64 [N, D]: one expert's MLP on rows that already hold their quantized values
    (e.g. `dequantize_act(x_q)`), with the recipe's intermediate rounding as in `reference_moe`;
    b13_F / b2_D: the expert's biases, if it has them."""
    x = x_ND.double()
    if not x.shape[0]:
        return x.new_zeros(0, w2_DI.shape[0])
    return torch.stack([_mlp(x[n], w13_FD, w2_DI, cfg, quant, fake_quant, b13_F, b2_D)
                        for n in range(x.shape[0])])


def _biases(b13, b2, e):
    return (None if b13 is None else b13[e]), (None if b2 is None else b2[e])


def reference_moe(x_TD: torch.Tensor, oracle, cfg: MoEConfig, quant: QuantConfig,
                  topk_ids_TK: torch.Tensor | None = None, topk_weights_TK=None,
                  fake_quant: bool = True) -> torch.Tensor:
    """float64 [T, D]. oracle: an `Oracle` (or its first five fields as a tuple) in float64
    (see weights.dequantized_full_layer). Routing from the oracle's own router unless given
    (given ids are logical expert ids; -1 = empty slot)."""
    return _layer(x_TD, oracle, cfg, quant, topk_ids_TK, topk_weights_TK, fake_quant, _mlp)


def rounding_slack(x_TD: torch.Tensor, oracle, cfg: MoEConfig, quant: QuantConfig,
                   topk_ids_TK: torch.Tensor | None = None,
                   topk_weights_TK=None) -> torch.Tensor:
    """float64 [T, D] >= 0: how far each output of `reference_moe` may move, beyond a
    tolerance, when an fp32 GEMM1 rounds h to the other bf16 neighbour.

    The oracle rounds h = w13 @ x to bf16 from float64; an fp32 sum of the same exact
    products lands within (K + 2) * 2^-24 * sum|w13 * x| of it in any order (K the
    reduction length), and where a bf16 rounding boundary lies in that band the fp32 path may
    round the other way. Downstream of the intermediate's quantization that one step can move a
    code, or the group's amax and with it every code of the group: both are correct results.
    Each such element's effect is the oracle's own output with h taken at the band's ends; a
    term's slack is the sum of its elements' effects (flips are rare and nearly independent),
    weighted as the layer weights the term (router weights are non-negative). Zero away from
    such elements: a check that allows `slack` on top of its tolerance still fails on any error
    the rounding cannot explain."""
    return _layer(x_TD, oracle, cfg, quant, topk_ids_TK, topk_weights_TK, True, _mlp_slack)


def _mlp_slack(x_D, w13_FD, w2_DI, cfg, quant, fq, b13_F=None, b2_D=None):
    h = w13_FD @ x_D
    band = (x_D.numel() + 2) * 2.0 ** -24 * (w13_FD.abs() @ x_D.abs())
    hb = h.to(torch.bfloat16).double()
    ends = ((h - band).to(torch.bfloat16).double(), (h + band).to(torch.bfloat16).double())
    idx = ((ends[0] != hb) | (ends[1] != hb)).nonzero().flatten()  # elements that may flip
    if not idx.numel():
        return x_D.new_zeros(w2_DI.shape[0])
    a0 = _quantized_act(hb[None], cfg, quant, b13_F)
    worst = None  # per element that may flip: its larger effect of the band's two ends
    for end in ends:
        hp = hb.repeat(idx.numel(), 1)  # one row per element moved to this end of its band
        hp[torch.arange(idx.numel()), idx] = end[idx]
        moved = ((_quantized_act(hp, cfg, quant, b13_F) - a0) @ w2_DI.T).abs()
        worst = moved if worst is None else torch.maximum(worst, moved)
    return worst.sum(0)


def _layer(x_TD, oracle, cfg, quant, topk_ids_TK, topk_weights_TK, fake_quant, mlp):
    """The layer token by token with `mlp` for each expert's MLP (`_mlp`: the output;
    `_mlp_slack`: its rounding slack)."""
    gate, bias, w13, w2, shared, b13, b2, shared_gate, tid2eid = Oracle(*oracle)
    x = x_TD.double()
    if topk_ids_TK is None:
        if tid2eid is not None:
            raise ValueError("a hash layer routes by token id: give its routing "
                             "(reference_hash_route)")
        topk_ids_TK, topk_weights_TK = reference_route(x @ gate.T, cfg, bias)
    xq_T = [_fake_quant(x[n], quant, fake_quant) for n in range(x.shape[0])]
    # expert by expert (a lazy oracle then holds one expert's float64 weights at a time), each
    # (token, slot)'s term kept apart, then summed per token in slot order as before
    ids = topk_ids_TK.tolist()
    term = x.new_zeros(x.shape[0], topk_ids_TK.shape[1], x.shape[1])
    for e in sorted({e for row in ids for e in row if e >= 0}):
        we13, we2, bias_e = w13[e], w2[e], _biases(b13, b2, e)
        for n, j in ((n, j) for n, row in enumerate(ids) for j, f in enumerate(row) if f == e):
            w = float(topk_weights_TK[n, j])
            if cfg.apply_router_weight_on_input:
                # the scaled token is an activation in the input dtype (bf16) before it is
                # quantized, as in the layer: without that rounding the fp8 codes decorrelate
                xw = x[n] * w
                xw = xw.to(torch.bfloat16).double() if fake_quant else xw
                term[n, j] = mlp(_fake_quant(xw, quant, fake_quant), we13, we2, cfg, quant,
                                 fake_quant, *bias_e)
            else:
                term[n, j] = w * mlp(xq_T[n], we13, we2, cfg, quant, fake_quant, *bias_e)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        xq = xq_T[n]
        acc = torch.zeros_like(x[n])
        for j in range(topk_ids_TK.shape[1]):
            if ids[n][j] >= 0:
                acc += term[n, j]
        if shared is not None:
            y = mlp(xq, shared[0], shared[1], cfg.shared_mlp_cfg, quant, fake_quant)
            if shared_gate is not None:  # on the layer's input, as the model's gate sees it
                y = y / (1.0 + torch.exp(-(x[n] @ shared_gate.double())))
            acc += y
        out[n] = acc
    return out
