"""Layer weights: deterministic synthetic weights and Hugging Face safetensors checkpoints.

Every expert's synthetic weights come from its own seed (seed, layer, expert), so a rank builds
exactly the experts it owns and any rank (or the oracle) can rebuild any expert bit-identically.
Scales keep activations O(1): w13 ~ N(0, 1/D), w2 ~ N(0, 1/I), gate ~ N(0, 1/D).

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


def _gen(seed: int, layer: int, expert: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + layer * 10_007 + expert + 1) % (2**63))
    return g


def synthetic_expert_fp32(cfg: MoEConfig, layer: int, expert: int, seed: int,
                          intermediate: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2I, D], w2 [D, I]) fp32 for one expert; expert -1 is the shared MLP."""
    i = cfg.moe_intermediate if intermediate is None else intermediate
    d = cfg.hidden
    g = _gen(seed, layer, expert)
    w13 = torch.randn(2 * i, d, generator=g) / d ** 0.5
    w2 = torch.randn(d, i, generator=g) / i ** 0.5
    return w13, w2


def synthetic_router(cfg: MoEConfig, layer: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = _gen(seed, layer, -7)
    gate = torch.randn(cfg.num_experts, cfg.hidden, generator=g) / cfg.hidden ** 0.5
    bias = None
    if cfg.router != "softmax":
        bias = torch.randn(cfg.num_experts, generator=g) * 0.1
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


def synthetic_layer(cfg: MoEConfig, quant: QuantConfig, layer: int, seed: int,
                    expert_ids, inter_slice=None, shared_slice=None, with_shared=True,
                    device=None) -> LayerWeights:
    """The rank's share of one layer: routed experts `expert_ids` (global ids), each sliced by
    inter_slice (TP), and the shared MLP sliced by shared_slice (or whole / absent)."""
    quant.check_shapes(cfg, inter_slice[1] if inter_slice else None)
    ids = list(expert_ids)
    w13s, w2s = [], []
    for e in ids:
        a, b = _slice_inter(*synthetic_expert_fp32(cfg, layer, e, seed), inter_slice)
        w13s.append(a)
        w2s.append(b)
    n_i = inter_slice[1] if inter_slice else cfg.moe_intermediate
    if not ids:
        w13 = torch.zeros(0, 2 * n_i, cfg.hidden)
        w2 = torch.zeros(0, cfg.hidden, n_i)
    else:
        w13, w2 = torch.stack(w13s), torch.stack(w2s)
    experts = build_expert_weights(w13, w2, quant, ids, device)
    shared = None
    if with_shared and cfg.num_shared_experts:
        sw13, sw2 = synthetic_expert_fp32(cfg, layer, -1, seed, cfg.shared_intermediate)
        sw13, sw2 = _slice_inter(sw13, sw2, shared_slice)
        shared = build_expert_weights(sw13[None], sw2[None], quant, [-1], device)
    gate, bias = synthetic_router(cfg, layer, seed)
    if device is not None:
        gate = gate.to(device)
        bias = None if bias is None else bias.to(device)
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
