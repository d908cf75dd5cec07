"""Layer weights: deterministic synthetic weights (checkpoints: `epmoe.checkpoint`).

Every expert's synthetic weights come from its own key (seed, layer, expert, tensor), so a rank
builds exactly the experts it owns and any rank (or the oracle) can rebuild any expert
bit-identically. The generator is counter-based (`counter_normal`: a 32-bit integer hash of
(key, element index) in exact int64 arithmetic, four 16-bit uniforms summed, one fp32
multiply), so the same values come out on the CPU and on a GPU: a rank generates its experts
on its own device (a full-size model starts in seconds) and the CPU oracle rebuilds them.
Scales keep activations O(1): w13, gate ~ (0, 1/D), w2 ~ (0, 1/I) (mean, variance); the
biases of configs that have them (gpt-oss) are large enough to move every output: router bias
std 0.5 (logits ~1), b13 std 0.5, b2 std 0.25.

Slicing for TP: `inter_slice=(start, length)` keeps gate/up rows [start, start+length) and the
same columns of down (and of b13); b2 stays with the slice that starts at 0, so the partial
outputs that TP sums carry it once. Slices must fall on quant-block boundaries (QuantConfig).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import ExpertWeights
from epmoe.quant import QWeight, dequantize_weight, quantize_weight
from epmoe.reference import Oracle


@dataclass(frozen=True)
class LayerWeights:
    """What one rank holds of one MoE layer.

    gate_ED   fp32 [E, D]   router weight (all logical experts; every rank routes)
    bias_E    fp32 [E] | None  router bias: score routers select on scores + bias
                               (e_score_correction_bias); the softmax router adds it to the
                               logits (gpt-oss's router bias)
    experts   ExpertWeights   the rank's routed experts (or intermediate slice of all, under TP)
    shared    ExpertWeights | None  the shared experts as one MLP (E=1), or this rank's slice
    shared_gate_D  fp32 [D] | None  with cfg.shared_gate: the shared MLP's output is scaled by
                               sigmoid(x . shared_gate_D) (held wherever a shared share is)
    tid2eid_VK  int32 [vocab, K] | None  a hash layer's experts per token id (cfg.hash_layers;
                               every rank holds all of it: every rank routes)
    """

    gate_ED: torch.Tensor
    bias_E: torch.Tensor | None
    experts: ExpertWeights
    shared: ExpertWeights | None
    shared_gate_D: torch.Tensor | None = None
    tid2eid_VK: torch.Tensor | None = None


# --------------------------------------------------------------------------------------------
# Counter-based generator (identical on every device: integer ops, then one IEEE fp32 multiply)

_M32 = 0xFFFFFFFF
# A 32-bit integer hash (H. Wellons' hash-prospector family); both multipliers are < 2**31, so
# every product of a 32-bit state fits in int64 without overflow on any device.
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97
_TAGS = {"w13": 0, "w2": 1, "gate": 2, "bias": 3, "b13": 4, "b2": 5, "sgate": 6,
         "tid2eid": 7}
# standard deviations of the synthetic biases (see the module docstring)
_ROUTER_BIAS_STD, _SCORE_BIAS_STD, _B13_STD, _B2_STD = 0.5, 0.1, 0.5, 0.25
_SHARED, _ROUTER = -1, -7  # the expert numbers of the shared MLP and of the router
# std of the sum of four uniforms on {0..65535}: sqrt(4 * (65536**2 - 1) / 12)
_SUM4_MEAN, _SUM4_STD = 2 * 65535, ((65536 ** 2 - 1) / 3) ** 0.5


def weight_key(seed: int, layer: int, expert: int, tensor: str) -> tuple[int, int]:
    """Two 32-bit keys of one synthetic tensor (splitmix64 of its coordinates, in Python)."""
    z = (seed * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + (expert + 8) * 0x94D049BB133111EB
         + _TAGS[tensor] + 1) % 2 ** 64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2 ** 64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2 ** 64
    z ^= z >> 31
    return z & _M32, z >> 32


def _hash32_(x: torch.Tensor, k2: int, tmp: torch.Tensor) -> torch.Tensor:
    """In place on int64 values in [0, 2**32): the keyed hash (k2 mixed in between rounds).
    `tmp`: a buffer like x (out= ops: a fresh large tensor costs more than the op on CPU)."""
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    x.mul_(_MUL1).bitwise_and_(_M32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp)).bitwise_xor_(k2)
    x.mul_(_MUL2).bitwise_and_(_M32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))


def _sum4_(a: torch.Tensor, b: torch.Tensor, key: tuple[int, int], tmp: torch.Tensor):
    """a, b: int64 counters 2i, 2i + 1 -> a = the centred sum of the four 16-bit halves of
    their hashes (exact integers, |a| < 2**18); b and tmp are clobbered."""
    k1, k2 = key
    for x in (a, b):
        _hash32_(x.bitwise_xor_(k1), k2, tmp)
    a.add_(torch.bitwise_right_shift(a, 16, out=tmp)).sub_(tmp.bitwise_left_shift_(16))
    a.add_(torch.bitwise_right_shift(b, 16, out=tmp)).add_(b.bitwise_and_(0xFFFF))
    return a.sub_(_SUM4_MEAN)


# elements per pass on the CPU: three int64 buffers stay in cache (several times faster than
# whole-tensor passes there); a GPU takes the tensor in one pass
_CPU_BLOCK = 1 << 16


def counter_normal(shape, key: tuple[int, int], std: float, device=None) -> torch.Tensor:
    """fp32 tensor of `shape`, mean 0 and standard deviation `std` (a sum of four uniforms,
    support +-3.46 std), element i a pure function of (key, i): the same bits on every device."""
    n = 1
    for d in shape:
        n *= d
    if n >= 2 ** 31:
        raise ValueError(f"counter_normal draws at most 2**31 - 1 values per tensor, asked {n}")
    device = torch.device("cpu" if device is None else device)
    out = torch.empty(n, dtype=torch.float32, device=device)
    block = _CPU_BLOCK if device.type == "cpu" else max(n, 1)
    a = torch.empty(min(block, n), dtype=torch.int64, device=device)
    b, tmp = torch.empty_like(a), torch.empty_like(a)
    scale = torch.tensor(std / _SUM4_STD, dtype=torch.float32)  # rounded to fp32 once, here
    for s0 in range(0, n, block):
        m = min(block, n - s0)
        am, bm, tm = a[:m], b[:m], tmp[:m]
        torch.arange(2 * s0, 2 * (s0 + m), 2, out=am)
        torch.add(am, 1, out=bm)
        dst = out[s0:s0 + m]
        dst.copy_(_sum4_(am, bm, key, tm))
        dst.mul_(scale)
    return out.reshape(shape)


def synthetic_expert_fp32(cfg: MoEConfig, layer: int, expert: int, seed: int,
                          intermediate: int | None = None,
                          device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2I, D], w2 [D, I]) fp32 for one expert, on `device`; expert -1 is the shared MLP."""
    i = cfg.moe_intermediate if intermediate is None else intermediate
    d = cfg.hidden
    w13 = counter_normal((2 * i, d), weight_key(seed, layer, expert, "w13"), d ** -0.5, device)
    w2 = counter_normal((d, i), weight_key(seed, layer, expert, "w2"), i ** -0.5, device)
    return w13, w2


def synthetic_router(cfg: MoEConfig, layer: int, seed: int,
                     device=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    gate = counter_normal((cfg.num_experts, cfg.hidden), weight_key(seed, layer, _ROUTER, "gate"),
                          cfg.hidden ** -0.5, device)
    bias = None
    if cfg.router_bias if cfg.router == "softmax" else cfg.selection_bias:
        std = _ROUTER_BIAS_STD if cfg.router == "softmax" else _SCORE_BIAS_STD
        if cfg.router == "softmax_biased":  # its scores sum to 1: ~1 / E each
            std /= cfg.num_experts
        bias = counter_normal((cfg.num_experts,), weight_key(seed, layer, _ROUTER, "bias"), std,
                              device)
    return gate, bias


def synthetic_hash_table(cfg: MoEConfig, layer: int, seed: int, device=None) -> torch.Tensor:
    """A hash layer's int32 [vocab, K] table: K distinct experts per token id, start + j x
    step (mod E) with the step coprime to E; start and step drawn per token id by a CPU
    generator keyed by (seed, layer): the same table on every rank and device."""
    k0, k1 = weight_key(seed, layer, _ROUTER, "tid2eid")
    g = torch.Generator().manual_seed((k1 << 31) ^ k0)
    e, v = cfg.num_experts, cfg.vocab_size
    steps = torch.tensor([s for s in range(1, e) if math.gcd(s, e) == 1] or [1])
    start = torch.randint(0, e, (v,), generator=g)
    step = steps[torch.randint(0, len(steps), (v,), generator=g)]
    ids = (start[:, None] + torch.arange(cfg.top_k)[None, :] * step[:, None]) % e
    return ids.to(torch.int32).to(device or "cpu")


def synthetic_expert_bias(cfg: MoEConfig, layer: int, expert: int, seed: int,
                          device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(b13 [2I], b2 [D]) fp32 for one routed expert of a config with expert biases."""
    i, d = cfg.moe_intermediate, cfg.hidden
    return (counter_normal((2 * i,), weight_key(seed, layer, expert, "b13"), _B13_STD, device),
            counter_normal((d,), weight_key(seed, layer, expert, "b2"), _B2_STD, device))


def slice_bias(b13: torch.Tensor, b2: torch.Tensor, inter_slice):
    """The TP share of an expert's biases: b13's gate / up columns of the slice; b2 only for
    the slice that starts at intermediate 0 (else None)."""
    if inter_slice is None:
        return b13, b2
    s, n = inter_slice
    i = b13.shape[-1] // 2
    return (torch.cat([b13[..., s:s + n], b13[..., i + s:i + s + n]], dim=-1),
            b2 if s == 0 else None)


def slice_inter(w13: torch.Tensor, w2: torch.Tensor, inter_slice):
    if inter_slice is None:
        return w13, w2
    s, n = inter_slice
    i = w2.shape[-1]
    if s < 0 or n < 1 or s + n > i:
        raise ValueError(f"intermediate slice ({s}, {n}) outside [0, {i})")
    w13 = torch.cat([w13[..., s:s + n, :], w13[..., i + s:i + s + n, :]], dim=-2)
    return w13, w2[..., s:s + n]


def build_expert_weights(w13_EFD: torch.Tensor, w2_EDI: torch.Tensor, quant: QuantConfig,
                         expert_ids, device=None, b13_EF=None, b2_ED=None) -> ExpertWeights:
    ids = torch.as_tensor(list(expert_ids), dtype=torch.long)
    qw13 = quantize_weight(w13_EFD.to(device) if device else w13_EFD, quant)
    qw2 = quantize_weight(w2_EDI.to(device) if device else w2_EDI, quant)
    ew = ExpertWeights(qw13, qw2, ids, None if b13_EF is None else b13_EF.float(),
                       None if b2_ED is None else b2_ED.float())
    return ew.to(device) if device else ew


# fp32 bytes generated at a time before they are quantized (quantization is per expert, so the
# chunking changes no bit of the result)
_CHUNK_BYTES = 1 << 28


def _synthetic_experts(cfg: MoEConfig, quant: QuantConfig, layer: int, seed: int, ids,
                       inter: int, inter_slice, device) -> ExpertWeights:
    """The experts `ids` ([-1] = the shared MLP at width `inter`), generated on `device` a few
    experts at a time and quantized into preallocated [E, ...] weights."""
    ids = list(ids)
    n_i = inter_slice[1] if inter_slice else inter
    per_expert = 3 * inter * cfg.hidden * 4
    step = max(1, _CHUNK_BYTES // per_expert)
    out13 = out2 = None
    for c0 in range(0, len(ids), step):
        chunk = ids[c0:c0 + step]
        pairs = [slice_inter(*synthetic_expert_fp32(cfg, layer, e, seed, inter, device),
                              inter_slice) for e in chunk]
        q13 = quantize_weight(torch.stack([a for a, _ in pairs]), quant)
        q2 = quantize_weight(torch.stack([b for _, b in pairs]), quant)
        if out13 is None:
            out13, out2 = _alloc_like(q13, len(ids)), _alloc_like(q2, len(ids))
        for out, q in ((out13, q13), (out2, q2)):
            out.data[c0:c0 + len(chunk)].copy_(q.data)
            if q.scale is not None:
                out.scale[c0:c0 + len(chunk)].copy_(q.scale)
    if out13 is None:  # no experts: empty weights of the recipe's types
        z13 = torch.zeros(0, 2 * n_i, cfg.hidden, device=device)
        z2 = torch.zeros(0, cfg.hidden, n_i, device=device)
        out13, out2 = quantize_weight(z13, quant), quantize_weight(z2, quant)
    b13 = b2 = None
    if cfg.expert_bias and ids != [_SHARED]:  # the shared MLP has none (no model pairs them)
        pairs = [slice_bias(*synthetic_expert_bias(cfg, layer, e, seed, device), inter_slice)
                 for e in ids]
        b13 = torch.stack([a for a, _ in pairs]) if ids else \
            torch.zeros(0, 2 * n_i, device=device)
        if not inter_slice or inter_slice[0] == 0:
            b2 = torch.stack([b for _, b in pairs]) if ids else \
                torch.zeros(0, cfg.hidden, device=device)
    return ExpertWeights(out13, out2, torch.as_tensor(ids, dtype=torch.long, device=device),
                         b13, b2)


def _alloc_like(q: QWeight, e: int) -> QWeight:
    data = q.data.new_empty((e, *q.data.shape[1:]))
    scale = None if q.scale is None else q.scale.new_empty((e, *q.scale.shape[1:]))
    return QWeight(data, scale, q.recipe, q.scale_fmt)


def synthetic_layer(cfg: MoEConfig, quant: QuantConfig, layer: int, seed: int,
                    expert_ids, inter_slice=None, shared_slice=None, with_shared=True,
                    device=None) -> LayerWeights:
    """The rank's share of one layer: routed experts `expert_ids` (global ids), each sliced by
    inter_slice (TP), and the shared MLP sliced by shared_slice (or whole / absent). Generated
    and quantized on `device` (default CPU): the same bits on every device."""
    quant.check_shapes(cfg, inter_slice[1] if inter_slice else None)
    experts = _synthetic_experts(cfg, quant, layer, seed, expert_ids, cfg.moe_intermediate,
                                 inter_slice, device)
    shared = sgate = None
    if with_shared and cfg.num_shared_experts:
        shared = _synthetic_experts(cfg, quant, layer, seed, [_SHARED], cfg.shared_intermediate,
                                    shared_slice, device)
        if cfg.shared_gate:
            sgate = counter_normal((cfg.hidden,), weight_key(seed, layer, _SHARED, "sgate"),
                                   cfg.hidden ** -0.5, device)
    gate, bias = synthetic_router(cfg, layer, seed, device)
    table = synthetic_hash_table(cfg, layer, seed, device) if layer in cfg.hash_layers else None
    return LayerWeights(gate, None if table is not None else bias, experts, shared, sgate,
                        table)


def layer_weights(cfg: MoEConfig, quant: QuantConfig, layer: int, seed: int, expert_ids,
                  inter_slice=None, shared_slice=None, with_shared=True, device=None,
                  checkpoint=None) -> LayerWeights:
    """`synthetic_layer`'s share of MoE layer `layer`, or, given a checkpoint (a Hugging Face
    folder with its config.json, or an open `SafetensorsCheckpoint` of one), the same share
    read from it (epmoe.checkpoint.load_layer: naming and layer index from the config)."""
    if checkpoint is None:
        return synthetic_layer(cfg, quant, layer, seed, expert_ids, inter_slice, shared_slice,
                               with_shared, device)
    from epmoe.checkpoint import load_layer

    return load_layer(checkpoint, None, cfg, quant, layer, expert_ids, inter_slice=inter_slice,
                      shared_slice=shared_slice, with_shared=with_shared, device=device)


def expert_weights(cfg: MoEConfig, quant: QuantConfig, layer: int, seed: int, expert_ids,
                   device=None, checkpoint=None) -> ExpertWeights:
    """`layer_weights`' routed experts only, whole (no router or shared MLP built or read)."""
    if checkpoint is None:
        return _synthetic_experts(cfg, quant, layer, seed, expert_ids, cfg.moe_intermediate,
                                  None, device)
    from epmoe.checkpoint import load_experts

    return load_experts(checkpoint, None, cfg, quant, layer, expert_ids, device=device)


def dequantized_full_layer(cfg: MoEConfig, quant: QuantConfig, layer: int, seed: int) -> Oracle:
    """Everything the float64 oracle needs (`reference.Oracle`): dequantized weights exactly as
    the ranks hold them (quantized per expert, whole), and the biases."""
    lw = synthetic_layer(cfg, quant, layer, seed, range(cfg.num_experts))
    return layer_to_oracle(lw)


def layer_to_oracle(lw: LayerWeights) -> Oracle:
    w13 = dequantize_weight(lw.experts.w13).double()
    w2 = dequantize_weight(lw.experts.w2).double()
    shared = None
    if lw.shared is not None:
        shared = (dequantize_weight(lw.shared.w13)[0].double(),
                  dequantize_weight(lw.shared.w2)[0].double())

    def f64(t):
        return None if t is None else t.double()
    return Oracle(lw.gate_ED.double(), f64(lw.bias_E), w13, w2, shared, f64(lw.experts.b13),
                  f64(lw.experts.b2), f64(lw.shared_gate_D),
                  None if lw.tid2eid_VK is None else lw.tid2eid_VK.cpu().long())
