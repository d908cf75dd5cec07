"""Hugging Face safetensors checkpoints: one MoE layer's router and experts, read lazily.

Where a scheme keeps each tensor: `epmoe.namings.NAMINGS` (re-exported here), with the other
common ways a checkpoint holds them (`epmoe.namings.mlp_names`, `stored`). Per-expert
projections are read one expert at a time; fused [E, ...] tensors (`epmoe.fused_experts`: Granite,
transformers 5, Llama 4 / Qwen3-VL, DBRX, gpt-oss) only the rows of the experts asked for.
"""

from __future__ import annotations

import json
import os

import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import ExpertWeights
from epmoe.fused_experts import check_shape, dequantize_mxfp4, fused_experts
from epmoe.namings import NAMINGS, located, mlp_names, stored
from epmoe.quant import FP8_DTYPE, QWeight
from epmoe.weights import LayerWeights, build_expert_weights, slice_inter

__all__ = ["NAMINGS", "SafetensorsCheckpoint", "dequantize_mxfp4", "load_layer"]


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
        self._config = ...  # the folder's config.json, read on first use

    @classmethod
    def open(cls, path: str | None) -> "SafetensorsCheckpoint | None":
        """The checkpoint at `path`; None for None (synthetic weights)."""
        return None if path is None else cls(path)

    @property
    def config(self):
        """The folder's config.json as an `epmoe.hf_config.HFModel` (read once); None without
        one."""
        if self._config is ...:
            from epmoe.hf_config import read_hf_config

            has = os.path.isfile(os.path.join(self.path, "config.json"))
            self._config = read_hf_config(self.path) if has else None
        return self._config

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not in checkpoint {self.path!r}")
        fn = self.weight_map[name]
        if fn not in self._handles:
            self._handles[fn] = safe_open(os.path.join(self.path, fn), "pt")
        return self._handles[fn]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get_rows(self, name: str, rows: list[int], block: int = 1) -> torch.Tensor:
        """t[rows] of a stored tensor, reading only those rows (fused per-expert tensors);
        block > 1: [len(rows), block, ...], row r being t[r * block:(r + 1) * block]."""
        sl = self._handle(name).get_slice(name)
        if block == 1:
            return torch.cat([sl[r:r + 1] for r in rows]) if rows else sl[0:0]
        parts = [sl[r * block:(r + 1) * block] for r in rows]
        return torch.stack(parts) if parts else sl[0:block][None][0:0]


# a projection's scale: Hugging Face's fp8 block scale, or DeepSeek's own (V4: `.scale`, e8m0)
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
_PACKED_FP4 = (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", torch.uint8))


def _scale_name(ckpt, prefix: str, proj: str) -> str | None:
    return next((prefix + proj + s for s in SCALE_SUFFIXES if ckpt.has(prefix + proj + s)),
                None)


def _load_proj(ckpt: SafetensorsCheckpoint, prefix: str, proj: str) -> torch.Tensor:
    """One projection as fp32: fp8 with 128x128 block scales (`weight_scale_inv` fp32, or
    DeepSeek-V4's `scale` e8m0), or e2m1 packed two a byte [N, K/2] with an e8m0 scale per 32
    [N, K/32] (DeepSeek-V4's MXFP4 experts), or as stored."""
    name = prefix + proj + ".weight"
    w = ckpt.get(name)
    sname = _scale_name(ckpt, prefix, proj)
    if w.dtype in _PACKED_FP4:
        if sname is None:
            raise ValueError(f"checkpoint tensor {name!r} is {w.dtype}: packed e2m1 needs its "
                             f"scale ({prefix + proj}.scale)")
        s = ckpt.get(sname)
        n, half = w.shape
        check_shape(tuple(s.shape), (n, half // 16), f"MXFP4 scale of {name!r}")
        return dequantize_mxfp4(w.view(torch.uint8).reshape(n, half // 16, 16),
                                s.view(torch.uint8))
    if w.dtype == FP8_DTYPE or sname is not None:
        s = ckpt.get(sname).float()
        n, k = w.shape
        s_full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        return w.float() * s_full
    return w.float()


def _load_w13(ckpt, pre: str, proj: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """One MLP's gate/up [2I, D] (gate rows first) and down [D, I] as fp32, read as the
    checkpoint holds them (`mlp_names`: separate, or one fused gate/up tensor)."""
    (g_name, u_name, d_name), up_first = mlp_names(ckpt.has, pre, proj)
    if u_name is None:
        w13 = _load_proj(ckpt, pre, g_name)
        if up_first:
            w13 = torch.cat(w13.chunk(2)[::-1])
    else:
        w13 = torch.cat([_load_proj(ckpt, pre, g_name), _load_proj(ckpt, pre, u_name)])
    return w13, _load_proj(ckpt, pre, d_name)


def _load_fp8_proj(ckpt, prefix, proj):
    """fp8 weight + its 128x128 block scale as fp32, exactly as stored (no requantization);
    None where the checkpoint holds it otherwise."""
    sname = _scale_name(ckpt, prefix, proj)
    if not ckpt.has(prefix + proj + ".weight") or sname is None:
        return None
    w = ckpt.get(prefix + proj + ".weight")
    return (w, ckpt.get(sname).float()) if w.dtype == FP8_DTYPE else None


def load_layer(path: str, naming: str | None, cfg: MoEConfig, quant: QuantConfig, layer: int,
               expert_ids, ckpt_layer: int | None = None, inter_slice=None, shared_slice=None,
               with_shared=True, device=None) -> LayerWeights:
    """Read one MoE layer's router and the experts `expert_ids` (only those) from a checkpoint.

    naming None: the one of the folder's config.json (epmoe.hf_config).
    ckpt_layer: the checkpoint's layer index (e.g. layer + first_k_dense_replace for DeepSeek);
    None: MoE layer `layer` of the folder's config.json, else `layer`.
    fp8 block checkpoints (DeepSeek-V3) loaded with recipe fp8_block keep their bytes; any
    other combination dequantizes to fp32 and quantizes with the recipe (gpt-oss's MXFP4
    experts loaded with w4a8_mxfp4 come back with the same values: a power-of-two rescale).
    """
    ckpt, nm, cl = _located(path, naming, cfg, quant, layer, ckpt_layer, inter_slice)
    experts = _experts(ckpt, nm, cl, cfg, quant, list(expert_ids), inter_slice, device)
    return _finish_layer(ckpt, nm, cfg, quant, cl, experts, shared_slice, with_shared, device,
                         layer in cfg.hash_layers)


def load_experts(path: str, naming: str | None, cfg: MoEConfig, quant: QuantConfig, layer: int,
                 expert_ids, ckpt_layer: int | None = None, inter_slice=None,
                 device=None) -> ExpertWeights:
    """`load_layer`'s routed experts only (no router, no shared MLP read)."""
    ckpt, nm, cl = _located(path, naming, cfg, quant, layer, ckpt_layer, inter_slice)
    return _experts(ckpt, nm, cl, cfg, quant, list(expert_ids), inter_slice, device)


def _located(path, naming, cfg, quant, layer, ckpt_layer, inter_slice):
    """(the open checkpoint, its names for layer `layer`, the checkpoint's layer index)."""
    ckpt = path if isinstance(path, SafetensorsCheckpoint) else SafetensorsCheckpoint(path)
    hf = ckpt.config
    if naming is None:
        if hf is None:
            raise ValueError(f"{ckpt.path!r} has no config.json: name the checkpoint's naming")
        naming = hf.naming
        if naming is None:
            raise ValueError(f"{ckpt.path!r}: epmoe does not read {hf.model_type} checkpoints")
    if ckpt_layer is None and hf is not None:
        if not 0 <= layer < len(hf.moe_layers):
            raise ValueError(f"layer {layer}: {ckpt.path!r} has {len(hf.moe_layers)} MoE layers")
        ckpt_layer = hf.moe_layers[layer]
    if naming not in NAMINGS:
        raise ValueError(f"unknown checkpoint naming {naming!r}; choose one of {sorted(NAMINGS)}")
    quant.check_shapes(cfg, inter_slice[1] if inter_slice else None)
    cl = layer if ckpt_layer is None else ckpt_layer
    nm = stored(located(NAMINGS[naming], ckpt.has, cl), ckpt.has, cl)
    if cfg.expert_bias and nm.get("fused") != "gpt_oss":
        raise ValueError(f"config {cfg.name!r} has expert biases; naming {naming!r} stores "
                         f"none (gpt-oss checkpoints: naming 'gpt_oss')")
    return ckpt, nm, cl


def _experts(ckpt, nm, cl, cfg, quant, ids, inter_slice, device) -> ExpertWeights:
    """The routed experts `ids` of checkpoint layer cl."""
    g_name, u_name, d_name = nm["proj"]
    if nm.get("fused"):
        return fused_experts(ckpt, nm, cfg, quant, cl, ids, inter_slice, device)
    keep_fp8 = quant.recipe == "fp8_block" and quant.scale_fmt == "fp32" and inter_slice is None
    if keep_fp8 and ids:
        raw = [[_load_fp8_proj(ckpt, nm["expert"].format(l=cl, e=e), p)
                for p in (g_name, u_name, d_name)] for e in ids]
        if all(r is not None for per in raw for r in per):
            w13 = torch.stack([torch.cat([g[0], u[0]]) for g, u, _ in raw])
            s13 = torch.stack([torch.cat([g[1], u[1]]) for g, u, _ in raw])
            w2 = torch.stack([d[0] for _, _, d in raw])
            s2 = torch.stack([d[1] for _, _, d in raw])
            check_shape(w13.shape, (len(ids), 2 * cfg.moe_intermediate, cfg.hidden),
                        "experts' gate/up")
            check_shape(w2.shape, (len(ids), cfg.hidden, cfg.moe_intermediate), "experts' down")
            experts = ExpertWeights(QWeight(w13, s13, "fp8_block"), QWeight(w2, s2, "fp8_block"),
                                    torch.as_tensor(ids, dtype=torch.long))
            return experts if device is None else experts.to(device)
    w13s, w2s = [], []
    for e in ids:
        a, b = slice_inter(*_load_w13(ckpt, nm["expert"].format(l=cl, e=e), nm["proj"]),
                           inter_slice)
        w13s.append(a)
        w2s.append(b)
    n_i = inter_slice[1] if inter_slice else cfg.moe_intermediate
    w13 = torch.stack(w13s) if ids else torch.zeros(0, 2 * n_i, cfg.hidden)
    w2 = torch.stack(w2s) if ids else torch.zeros(0, cfg.hidden, n_i)
    check_shape(w13.shape, (len(ids), 2 * n_i, cfg.hidden), "experts' gate/up")
    check_shape(w2.shape, (len(ids), cfg.hidden, n_i), "experts' down")
    return build_expert_weights(w13, w2, quant, ids, device)


def _hash_table(ckpt, nm, cfg, cl) -> torch.Tensor:
    """A hash layer's [vocab, K] experts per token id, beside its gate (`gate.tid2eid`)."""
    name = nm["gate"].format(l=cl).removesuffix("weight") + "tid2eid"
    t = ckpt.get(name)
    check_shape(tuple(t.shape), (cfg.vocab_size, cfg.top_k), f"hash layer table {name!r}")
    if t.is_floating_point() or t.numel() and not 0 <= int(t.min()) <= int(t.max()) < \
            cfg.num_experts:
        raise ValueError(f"{name!r} must hold expert ids in [0, {cfg.num_experts})")
    return t.to(torch.int32)


def _finish_layer(ckpt, nm, cfg, quant, cl, experts, shared_slice, with_shared, device,
                  hashed=False):
    gate = ckpt.get(nm["gate"].format(l=cl)).float()
    check_shape(gate.shape, (cfg.num_experts, cfg.hidden), "router gate")
    table = _hash_table(ckpt, nm, cfg, cl) if hashed else None
    bias = None
    if table is None and nm["bias"] and ckpt.has(nm["bias"].format(l=cl)):
        bias = ckpt.get(nm["bias"].format(l=cl)).float().reshape(-1)
        check_shape(bias.shape, (cfg.num_experts,), "router bias")
    if cfg.router_bias and bias is None:
        raise ValueError(f"config {cfg.name!r} has a router bias; the checkpoint has no "
                         f"{nm['bias'] and nm['bias'].format(l=cl)!r}")
    shared = sgate = None
    if cfg.shared_gate and not nm.get("shared_gate"):
        raise ValueError(f"config {cfg.name!r} gates its shared expert; naming stores no "
                         f"shared_expert_gate (Qwen2-MoE / Qwen3-Next: 'qwen2_moe')")
    if with_shared and nm["shared"] and cfg.num_shared_experts:
        pre = nm["shared"].format(l=cl)
        w13, w2 = _load_w13(ckpt, pre, nm.get("shared_proj", nm["proj"]))
        check_shape(w13.shape, (2 * cfg.shared_intermediate, cfg.hidden), "shared MLP's gate/up")
        check_shape(w2.shape, (cfg.hidden, cfg.shared_intermediate), "shared MLP's down")
        w13, w2 = slice_inter(w13, w2, shared_slice)
        shared = build_expert_weights(w13[None], w2[None], quant, [-1], device)
        if cfg.shared_gate:
            sgate = ckpt.get(nm["shared_gate"].format(l=cl)).float().reshape(-1)
            check_shape(sgate.shape, (cfg.hidden,), "shared expert gate")
    if device is not None:
        gate = gate.to(device)
        bias = None if bias is None else bias.to(device)
        sgate = None if sgate is None else sgate.to(device)
        table = None if table is None else table.to(device)
    return LayerWeights(gate, bias, experts, shared, sgate, table)
