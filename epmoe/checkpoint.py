"""Hugging Face safetensors checkpoints: one MoE layer's router and experts, read lazily.

Where a scheme keeps each tensor: `epmoe.namings.NAMINGS` (re-exported here). Per-expert
projections are read one expert at a time; fused [E, ...] tensors one row per expert asked for:
  granite  input_linear [E, 2I, D] (gate rows, then up), output_linear [E, D, I]; its shared
           MLP the same names without the expert axis
  bmm      gate_up_proj [E, D, 2I] (gate columns, then up), down_proj [E, I, D] (Llama 4,
           Qwen3-VL-MoE; a tensor saved [E, 2I, D] / [E, D, I] is read too where D != 2I)
  gpt_oss  bf16: experts.gate_up_proj [E, D, 2I] (gate / up columns interleaved: gate =
           0::2, up = 1::2), experts.gate_up_proj_bias [E, 2I] (interleaved alike),
           experts.down_proj [E, I, D], experts.down_proj_bias [E, D]; MXFP4:
           experts.{gate_up,down}_proj_blocks [E, N, K/32, 16] (two e2m1 codes a byte, low
           nibble first) and _scales [E, N, K/32] (e8m0, bias 127), rows N = 2I (interleaved)
           or D: the projection stored [out, in]; the biases as in bf16; router
           mlp.router.weight [E, D] and mlp.router.bias [E] (added to the logits)
"""

from __future__ import annotations

import json
import os

import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import ExpertWeights
from epmoe.namings import NAMINGS, located
from epmoe.quant import FP8_DTYPE, QWeight
from epmoe.weights import LayerWeights, build_expert_weights, slice_bias, slice_inter


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

    def get_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        """t[rows] of a stored tensor, reading only those rows (fused per-expert tensors)."""
        sl = self._handle(name).get_slice(name)
        return torch.cat([sl[r:r + 1] for r in rows]) if rows else sl[0:0]


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
    nm = located(NAMINGS[naming], ckpt.has, cl)
    g_name, u_name, d_name = nm["proj"]
    ids = list(expert_ids)
    if cfg.expert_bias and not nm.get("fused"):
        raise ValueError(f"config {cfg.name!r} has expert biases; naming {naming!r} stores "
                         f"none (gpt-oss checkpoints: naming 'gpt_oss')")
    if nm.get("fused"):
        experts = _fused_experts(ckpt, nm, cfg, quant, cl, ids, inter_slice, device)
        return _finish_layer(ckpt, nm, cfg, quant, cl, experts, shared_slice, with_shared,
                             device)

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
                experts = experts.to(device)
            return _finish_layer(ckpt, nm, cfg, quant, cl, experts, shared_slice, with_shared,
                                 device)

    w13s, w2s = [], []
    for e in ids:
        pre = nm["expert"].format(l=cl, e=e)
        w13 = torch.cat([_load_proj(ckpt, pre, g_name), _load_proj(ckpt, pre, u_name)])
        a, b = slice_inter(w13, _load_proj(ckpt, pre, d_name), inter_slice)
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
        bias = ckpt.get(nm["bias"].format(l=cl)).float().reshape(-1)
        _check_shape(bias, (cfg.num_experts,), "router bias")
    if cfg.router_bias and bias is None:
        raise ValueError(f"config {cfg.name!r} has a router bias; the checkpoint has no "
                         f"{nm['bias'] and nm['bias'].format(l=cl)!r}")
    shared = sgate = None
    if cfg.shared_gate and not nm.get("shared_gate"):
        raise ValueError(f"config {cfg.name!r} gates its shared expert; naming stores no "
                         f"shared_expert_gate (Qwen2-MoE / Qwen3-Next: 'qwen2_moe')")
    if with_shared and nm["shared"] and cfg.num_shared_experts:
        pre = nm["shared"].format(l=cl)
        g_name, u_name, d_name = nm.get("shared_proj", nm["proj"])
        w13 = _load_proj(ckpt, pre, g_name) if u_name is None else \
            torch.cat([_load_proj(ckpt, pre, g_name), _load_proj(ckpt, pre, u_name)])
        w2 = _load_proj(ckpt, pre, d_name)
        _check_shape(w13, (2 * cfg.shared_intermediate, cfg.hidden), "shared MLP's gate/up")
        _check_shape(w2, (cfg.hidden, cfg.shared_intermediate), "shared MLP's down")
        w13, w2 = slice_inter(w13, w2, shared_slice)
        shared = build_expert_weights(w13[None], w2[None], quant, [-1], device)
        if cfg.shared_gate:
            sgate = ckpt.get(nm["shared_gate"].format(l=cl)).float().reshape(-1)
            _check_shape(sgate, (cfg.hidden,), "shared expert gate")
    if device is not None:
        gate = gate.to(device)
        bias = None if bias is None else bias.to(device)
        sgate = None if sgate is None else sgate.to(device)
    return LayerWeights(gate, bias, experts, shared, sgate)


# --------------------------------------------------------------------------------------------
# fused [E, ...] expert tensors: gpt-oss (bf16 or MXFP4), Granite, bmm (Llama 4, Qwen3-VL)

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., G, 16] (two e2m1 codes a byte, low nibble first) and e8m0 scales
    [..., G] -> fp32 [..., G * 32]: code value x 2**(scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks must be uint8 [..., G, 16] and scales uint8 [..., G], "
                         f"got {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} "
                         f"{tuple(scales.shape)}")
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]
    vals = lut[codes].flatten(-2)  # [..., G, 32]
    vals = torch.ldexp(vals, scales.long().sub(127)[..., None].float())
    return vals.flatten(-2)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss's [g0, u0, g1, u1, ...] along dim -> [gate | up] (epmoe's w13 row order)."""
    n = t.shape[dim]
    return torch.cat([t.index_select(dim, torch.arange(0, n, 2)),
                      t.index_select(dim, torch.arange(1, n, 2))], dim=dim)


def _fused_proj(ckpt: SafetensorsCheckpoint, pre: str, proj: str, ids: list[int]) -> torch.Tensor:
    """fp32 [n, out, in] of the experts `ids`: MXFP4 blocks if stored, else the bf16 tensor
    (stored [E, in, out], transposed here)."""
    if ckpt.has(pre + proj + "_blocks"):
        return dequantize_mxfp4(ckpt.get_rows(pre + proj + "_blocks", ids),
                                ckpt.get_rows(pre + proj + "_scales", ids))
    return ckpt.get_rows(pre + proj, ids).float().transpose(1, 2)


def _as_out_in(t: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """[E, in, out] as released (x @ w) -> [E, out, in]; a tensor saved already [E, out, in]
    is taken as it is (ambiguous only when out == in: the released layout is assumed)."""
    return t if out != inp and tuple(t.shape[1:]) == (out, inp) else t.transpose(1, 2)


def _fused_experts(ckpt, nm, cfg: MoEConfig, quant: QuantConfig, cl: int, ids: list[int],
                   inter_slice, device) -> ExpertWeights:
    pre = nm["expert"].format(l=cl)
    gu_name, _, d_name = nm["proj"]
    i, d, n = cfg.moe_intermediate, cfg.hidden, len(ids)
    if nm["fused"] == "granite":  # stored [E, out, in] as the GEMMs take them
        w13 = ckpt.get_rows(pre + gu_name + ".weight", ids).float()
        w2 = ckpt.get_rows(pre + d_name + ".weight", ids).float()
    elif nm["fused"] == "bmm":  # x @ w: [E, in, out], gate columns then up (Llama 4, Qwen3-VL)
        w13 = _as_out_in(ckpt.get_rows(pre + gu_name, ids).float(), 2 * i, d)
        w2 = _as_out_in(ckpt.get_rows(pre + d_name, ids).float(), d, i)
    else:
        w13 = _deinterleave(_fused_proj(ckpt, pre, gu_name, ids), 1)
        w2 = _fused_proj(ckpt, pre, d_name, ids)
    _check_shape(w13, (n, 2 * i, d), "experts' gate_up_proj (as [E, 2I, D])")
    _check_shape(w2, (n, d, i), "experts' down_proj (as [E, D, I])")
    b13 = b2 = None
    if ckpt.has(pre + gu_name + "_bias"):
        b13 = _deinterleave(ckpt.get_rows(pre + gu_name + "_bias", ids).float(), 1)
        b2 = ckpt.get_rows(pre + d_name + "_bias", ids).float()
        _check_shape(b13, (n, 2 * i), "experts' gate_up_proj_bias")
        _check_shape(b2, (n, d), "experts' down_proj_bias")
    if cfg.expert_bias != (b13 is not None):
        raise ValueError(f"config {cfg.name!r} has expert_bias={cfg.expert_bias} but the "
                         f"checkpoint {'has' if b13 is not None else 'has no'} expert biases")
    w13, w2 = slice_inter(w13, w2, inter_slice)
    if b13 is not None:
        b13, b2 = slice_bias(b13, b2, inter_slice)
    return build_expert_weights(w13, w2, quant, ids, device, b13, b2)
