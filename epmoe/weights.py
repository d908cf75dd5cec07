"""Layer weights: deterministic synthetic weights and Hugging Face safetensors checkpoints.

Every expert's synthetic weights come from its own key (seed, layer, expert, tensor), so a rank
builds exactly the experts it owns and any rank (or the oracle) can rebuild any expert
bit-identically. The generator is counter-based (`counter_normal`: a 32-bit integer hash of
(key, element index) in exact int64 arithmetic, four 16-bit uniforms summed, one fp32
multiply), so the same values come out on the CPU and on a GPU: a rank generates its experts
on its own device (a full-size model starts in seconds) and the CPU oracle rebuilds them.
Scales keep activations O(1): w13, gate ~ (0, 1/D), w2 ~ (0, 1/I) (mean, variance).

Slicing for TP: `inter_slice=(start, length)` keeps gate/up rows [start, start+length) and the
same columns of down; slices must fall on quant-block boundaries (checked by QuantConfig).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import ExpertWeights
from epmoe.quant import FP8_DTYPE, QWeight, dequantize_weight, quantize_weight


@dataclass(frozen=True)
class LayerWeights:
    """What one rank holds of one MoE layer.

    gate_ED   fp32 [E, D]   router weight (all logical experts; every rank routes)
    bias_E    fp32 [E] | None  e_score_correction_bias (DeepSeek-style routers)
    experts   ExpertWeights   the rank's routed experts (or intermediate slice of all, under TP)
    shared    ExpertWeights | None  the shared experts as one MLP (E=1), or this rank's slice
    """

    gate_ED: torch.Tensor
    bias_E: torch.Tensor | None
    experts: ExpertWeights
    shared: ExpertWeights | None


# --------------------------------------------------------------------------------------------
# Counter-based generator (identical on every device: integer ops, then one IEEE fp32 multiply)

_M32 = 0xFFFFFFFF
# A 32-bit integer hash (H. Wellons' hash-prospector family); both multipliers are < 2**31, so
# every product of a 32-bit state fits in int64 without overflow on any device.
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97
_TAGS = {"w13": 0, "w2": 1, "gate": 2, "bias": 3}
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
    if cfg.router != "softmax":
        bias = counter_normal((cfg.num_experts,), weight_key(seed, layer, _ROUTER, "bias"), 0.1,
                              device)
    return gate, bias


def _slice_inter(w13: torch.Tensor, w2: torch.Tensor, inter_slice):
    if inter_slice is None:
        return w13, w2
    s, n = inter_slice
    i = w2.shape[-1]
    if s < 0 or n < 1 or s + n > i:
        raise ValueError(f"intermediate slice ({s}, {n}) outside [0, {i})")
    w13 = torch.cat([w13[..., s:s + n, :], w13[..., i + s:i + s + n, :]], dim=-2)
    return w13, w2[..., s:s + n]


def build_expert_weights(w13_EFD: torch.Tensor, w2_EDI: torch.Tensor, quant: QuantConfig,
                         expert_ids, device=None) -> ExpertWeights:
    ids = torch.as_tensor(list(expert_ids), dtype=torch.long)
    qw13 = quantize_weight(w13_EFD.to(device) if device else w13_EFD, quant)
    qw2 = quantize_weight(w2_EDI.to(device) if device else w2_EDI, quant)
    return ExpertWeights(qw13, qw2, ids.to(device) if device else ids)


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
        pairs = [_slice_inter(*synthetic_expert_fp32(cfg, layer, e, seed, inter, device),
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
    return ExpertWeights(out13, out2, torch.as_tensor(ids, dtype=torch.long, device=device))


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
    shared = None
    if with_shared and cfg.num_shared_experts:
        shared = _synthetic_experts(cfg, quant, layer, seed, [_SHARED], cfg.shared_intermediate,
                                    shared_slice, device)
    gate, bias = synthetic_router(cfg, layer, seed, device)
    return LayerWeights(gate, bias, experts, shared)


def dequantized_full_layer(cfg: MoEConfig, quant: QuantConfig, layer: int, seed: int):
    """Everything the float64 oracle needs: (gate, bias, w13 [E,F,D], w2 [E,D,I], shared or None),
    dequantized weights exactly as the ranks hold them (quantized per expert, whole)."""
    lw = synthetic_layer(cfg, quant, layer, seed, range(cfg.num_experts))
    return layer_to_oracle(lw)


def layer_to_oracle(lw: LayerWeights):
    w13 = dequantize_weight(lw.experts.w13).double()
    w2 = dequantize_weight(lw.experts.w2).double()
    shared = None
    if lw.shared is not None:
        shared = (dequantize_weight(lw.shared.w13)[0].double(),
                  dequantize_weight(lw.shared.w2)[0].double())
    return lw.gate_ED.double(), None if lw.bias_E is None else lw.bias_E.double(), w13, w2, shared


# --------------------------------------------------------------------------------------------
# Hugging Face safetensors checkpoints

# name templates per naming scheme: (router gate, router bias, expert prefix, shared prefix,
# gate/up/down projection names)
NAMINGS = {
    "deepseek": dict(gate="model.layers.{l}.mlp.gate.weight",
                     bias="model.layers.{l}.mlp.gate.e_score_correction_bias",
                     expert="model.layers.{l}.mlp.experts.{e}.",
                     shared="model.layers.{l}.mlp.shared_experts.",
                     proj=("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": dict(gate="model.layers.{l}.mlp.gate.weight", bias=None,
                      expert="model.layers.{l}.mlp.experts.{e}.", shared=None,
                      proj=("gate_proj", "up_proj", "down_proj")),
    "mixtral": dict(gate="model.layers.{l}.block_sparse_moe.gate.weight", bias=None,
                    expert="model.layers.{l}.block_sparse_moe.experts.{e}.", shared=None,
                    proj=("w1", "w3", "w2")),
}


class SafetensorsCheckpoint:
    """Lazy reader of a HF checkpoint dir (sharded with model.safetensors.index.json, or one
    .safetensors file): opens only the files holding the tensors asked for."""

    def __init__(self, path: str):
        from safetensors import safe_open  # noqa: F401  (fail early with a clear import error)

        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map = json.load(f)["weight_map"]
        else:
            files = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {path!r}")
            self.weight_map = {}
            for fn in files:
                with safe_open(os.path.join(path, fn), "pt") as f:
                    self.weight_map.update({k: fn for k in f.keys()})
        self._handles = {}

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not in checkpoint {self.path!r}")
        fn = self.weight_map[name]
        if fn not in self._handles:
            self._handles[fn] = safe_open(os.path.join(self.path, fn), "pt")
        return self._handles[fn].get_tensor(name)


def _load_proj(ckpt: SafetensorsCheckpoint, prefix: str, proj: str) -> torch.Tensor:
    """One projection as fp32, dequantizing fp8 `weight_scale_inv` 128x128 blocks."""
    w = ckpt.get(prefix + proj + ".weight")
    sname = prefix + proj + ".weight_scale_inv"
    if w.dtype == FP8_DTYPE or ckpt.has(sname):
        s = ckpt.get(sname).float()
        n, k = w.shape
        s_full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        return w.float() * s_full
    return w.float()


def _load_fp8_proj(ckpt, prefix, proj):
    """fp8 weight + fp32 block scale exactly as stored (no requantization)."""
    sname = prefix + proj + ".weight_scale_inv"
    w = ckpt.get(prefix + proj + ".weight")
    if w.dtype != FP8_DTYPE or not ckpt.has(sname):
        return None
    return w, ckpt.get(sname).float()


def load_layer(path: str, naming: str, cfg: MoEConfig, quant: QuantConfig, layer: int,
               expert_ids, ckpt_layer: int | None = None, inter_slice=None, shared_slice=None,
               with_shared=True, device=None) -> LayerWeights:
    """Read one MoE layer's router and the experts `expert_ids` (only those) from a checkpoint.

    ckpt_layer: the checkpoint's layer index (e.g. layer + first_k_dense_replace for DeepSeek).
    fp8 block checkpoints (DeepSeek-V3) loaded with recipe fp8_block keep their bytes; any
    other combination dequantizes to fp32 and quantizes with the recipe.
    """
    if naming not in NAMINGS:
        raise ValueError(f"unknown checkpoint naming {naming!r}; choose one of {sorted(NAMINGS)}")
    quant.check_shapes(cfg, inter_slice[1] if inter_slice else None)
    nm = NAMINGS[naming]
    ckpt = path if isinstance(path, SafetensorsCheckpoint) else SafetensorsCheckpoint(path)
    cl = layer if ckpt_layer is None else ckpt_layer
    g_name, u_name, d_name = nm["proj"]
    ids = list(expert_ids)

    keep_fp8 = quant.recipe == "fp8_block" and quant.scale_fmt == "fp32" and inter_slice is None
    if keep_fp8 and ids:
        raw = [[_load_fp8_proj(ckpt, nm["expert"].format(l=cl, e=e), p)
                for p in (g_name, u_name, d_name)] for e in ids]
        if all(r is not None for per in raw for r in per):
            w13 = torch.stack([torch.cat([g[0], u[0]]) for g, u, _ in raw])
            s13 = torch.stack([torch.cat([g[1], u[1]]) for g, u, _ in raw])
            w2 = torch.stack([d[0] for _, _, d in raw])
            s2 = torch.stack([d[1] for _, _, d in raw])
            _check_shape(w13, (len(ids), 2 * cfg.moe_intermediate, cfg.hidden),
                         "experts' gate/up")
            _check_shape(w2, (len(ids), cfg.hidden, cfg.moe_intermediate), "experts' down")
            experts = ExpertWeights(QWeight(w13, s13, "fp8_block"), QWeight(w2, s2, "fp8_block"),
                                    torch.as_tensor(ids, dtype=torch.long))
            if device is not None:
                experts = ExpertWeights(experts.w13.to(device), experts.w2.to(device),
                                        experts.expert_ids_E.to(device))
            return _finish_layer(ckpt, nm, cfg, quant, cl, experts, shared_slice, with_shared,
                                 device)

    w13s, w2s = [], []
    for e in ids:
        pre = nm["expert"].format(l=cl, e=e)
        w13 = torch.cat([_load_proj(ckpt, pre, g_name), _load_proj(ckpt, pre, u_name)])
        a, b = _slice_inter(w13, _load_proj(ckpt, pre, d_name), inter_slice)
        w13s.append(a)
        w2s.append(b)
    n_i = inter_slice[1] if inter_slice else cfg.moe_intermediate
    w13 = torch.stack(w13s) if ids else torch.zeros(0, 2 * n_i, cfg.hidden)
    w2 = torch.stack(w2s) if ids else torch.zeros(0, cfg.hidden, n_i)
    _check_shape(w13, (len(ids), 2 * n_i, cfg.hidden), "experts' gate/up")
    _check_shape(w2, (len(ids), cfg.hidden, n_i), "experts' down")
    experts = build_expert_weights(w13, w2, quant, ids, device)
    return _finish_layer(ckpt, nm, cfg, quant, cl, experts, shared_slice, with_shared, device)


def _check_shape(t, want, what):
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"checkpoint {what} has shape {tuple(t.shape)}, the config needs "
                         f"{tuple(want)}: check --model against the checkpoint")


def _finish_layer(ckpt, nm, cfg, quant, cl, experts, shared_slice, with_shared, device):
    gate = ckpt.get(nm["gate"].format(l=cl)).float()
    _check_shape(gate, (cfg.num_experts, cfg.hidden), "router gate")
    bias = None
    if nm["bias"] and ckpt.has(nm["bias"].format(l=cl)):
        bias = ckpt.get(nm["bias"].format(l=cl)).float()
    shared = None
    if with_shared and nm["shared"] and cfg.num_shared_experts:
        pre = nm["shared"].format(l=cl)
        g_name, u_name, d_name = nm["proj"]
        w13 = torch.cat([_load_proj(ckpt, pre, g_name), _load_proj(ckpt, pre, u_name)])
        w13, w2 = _slice_inter(w13, _load_proj(ckpt, pre, d_name), shared_slice)
        shared = build_expert_weights(w13[None], w2[None], quant, [-1], device)
    if device is not None:
        gate = gate.to(device)
        bias = None if bias is None else bias.to(device)
    return LayerWeights(gate, bias, experts, shared)
