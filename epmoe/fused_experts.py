"""Checkpoints whose expert tensors carry an expert axis: read the rows of the experts asked for.

The layouts (`fused` in an `epmoe.namings` scheme), each read into epmoe's [E, 2I, D] gate/up
(gate rows, then up) and [E, D, I] down:
  out_in   gate_up [E, 2I, D] (gate rows, then up), down [E, D, I]: Granite's input_linear /
           output_linear (its shared MLP the same names without the expert axis), and
           transformers 5's experts.gate_up_proj / experts.down_proj (Qwen3.5-MoE)
  bmm      gate_up_proj [E, D, 2I] (gate columns, then up), down_proj [E, I, D] (Llama 4,
           Qwen3-VL-MoE; a tensor saved [E, 2I, D] / [E, D, I] is read too where D != 2I)
  dbrx     w1 (gate) / v1 (up) / w2 [E*I, D]: expert e's rows e*I .. (e+1)*I; its down
           projection is those w2 rows transposed (DBRX's x @ w2[e])
  gpt_oss  bf16: experts.gate_up_proj [E, D, 2I] (gate / up columns interleaved: gate =
           0::2, up = 1::2), experts.gate_up_proj_bias [E, 2I] (interleaved alike),
           experts.down_proj [E, I, D], experts.down_proj_bias [E, D]; MXFP4:
           experts.{gate_up,down}_proj_blocks [E, N, K/32, 16] (two e2m1 codes a byte, low
           nibble first) and _scales [E, N, K/32] (e8m0, bias 127), rows N = 2I (interleaved)
           or D: the projection stored [out, in]; the biases as in bf16
Tensors are read as stored in bf16 / fp16 / fp32; fp8 fused experts are refused (no scale
layout for them is read).
"""

from __future__ import annotations

import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import ExpertWeights
from epmoe.weights import build_expert_weights, slice_bias, slice_inter

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


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


def _floats(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype not in _FLOATS:
        raise ValueError(f"checkpoint tensor {name!r} is {t.dtype}: epmoe reads fused expert "
                         f"tensors in bf16, fp16 or fp32 only (dequantize the checkpoint)")
    return t.float()


def _rows(ckpt, name: str, ids: list[int], block: int = 1) -> torch.Tensor:
    return _floats(ckpt.get_rows(name, ids, block), name)


def _fused_proj(ckpt, pre: str, proj: str, ids: list[int]) -> torch.Tensor:
    """fp32 [n, out, in] of the experts `ids`: MXFP4 blocks if stored, else the bf16 tensor
    (stored [E, in, out], transposed here)."""
    if ckpt.has(pre + proj + "_blocks"):
        return dequantize_mxfp4(ckpt.get_rows(pre + proj + "_blocks", ids),
                                ckpt.get_rows(pre + proj + "_scales", ids))
    return _rows(ckpt, pre + proj, ids).transpose(1, 2)


def _as_out_in(t: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """[E, in, out] as released (x @ w) -> [E, out, in]; a tensor saved already [E, out, in]
    is taken as it is (ambiguous only when out == in: the released layout is assumed)."""
    return t if out != inp and tuple(t.shape[1:]) == (out, inp) else t.transpose(1, 2)


def check_shape(shape, want, what):
    """A clear error where a checkpoint tensor's shape is not what the config needs."""
    if tuple(shape) != tuple(want):
        raise ValueError(f"checkpoint {what} has shape {tuple(shape)}, the config needs "
                         f"{tuple(want)}: check --model against the checkpoint")


def fused_experts(ckpt, nm: dict, cfg: MoEConfig, quant: QuantConfig, cl: int, ids: list[int],
                  inter_slice, device) -> ExpertWeights:
    """The experts `ids` of checkpoint layer `cl` from scheme `nm`'s fused tensors (only their
    rows are read), sliced to `inter_slice` and quantized with the recipe."""
    pre = nm["expert"].format(l=cl)
    gu_name, u_name, d_name = nm["proj"]
    i, d, n = cfg.moe_intermediate, cfg.hidden, len(ids)
    layout = nm["fused"]
    if layout == "out_in":  # stored [E, out, in] as the GEMMs take them
        w13, w2 = _rows(ckpt, pre + gu_name, ids), _rows(ckpt, pre + d_name, ids)
    elif layout == "bmm":  # x @ w: [E, in, out], gate columns then up (Llama 4, Qwen3-VL)
        w13 = _as_out_in(_rows(ckpt, pre + gu_name, ids), 2 * i, d)
        w2 = _as_out_in(_rows(ckpt, pre + d_name, ids), d, i)
    elif layout == "dbrx":  # [E*I, D] each: an expert's I rows; down = its w2 rows^T
        for name in (gu_name, u_name, d_name):
            check_shape(ckpt.shape(pre + name), (cfg.num_experts * i, d),
                        f"experts' {name} (as [E*I, D])")
        w13 = torch.cat([_rows(ckpt, pre + gu_name, ids, i),
                         _rows(ckpt, pre + u_name, ids, i)], dim=1)
        w2 = _rows(ckpt, pre + d_name, ids, i).transpose(1, 2)
    elif layout == "gpt_oss":
        w13 = _deinterleave(_fused_proj(ckpt, pre, gu_name, ids), 1)
        w2 = _fused_proj(ckpt, pre, d_name, ids)
    else:
        raise ValueError(f"unknown fused expert layout {layout!r}")
    check_shape(w13.shape, (n, 2 * i, d), "experts' gate/up (as [E, 2I, D])")
    check_shape(w2.shape, (n, d, i), "experts' down (as [E, D, I])")
    b13 = b2 = None
    if layout == "gpt_oss" and ckpt.has(pre + gu_name + "_bias"):
        b13 = _deinterleave(ckpt.get_rows(pre + gu_name + "_bias", ids).float(), 1)
        b2 = ckpt.get_rows(pre + d_name + "_bias", ids).float()
        check_shape(b13.shape, (n, 2 * i), "experts' gate_up_proj_bias")
        check_shape(b2.shape, (n, d), "experts' down_proj_bias")
    if cfg.expert_bias != (b13 is not None):
        raise ValueError(f"config {cfg.name!r} has expert_bias={cfg.expert_bias} but the "
                         f"checkpoint {'has' if b13 is not None else 'has no'} expert biases")
    w13, w2 = slice_inter(w13, w2, inter_slice)
    if b13 is not None:
        b13, b2 = slice_bias(b13, b2, inter_slice)
    return build_expert_weights(w13, w2, quant, ids, device, b13, b2)
