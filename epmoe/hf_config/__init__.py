"""A model's MoE layers from its Hugging Face `config.json`: `--model path/to/config.json`.

`read_hf_config(path)` (the file, or the checkpoint folder holding it) -> `HFModel`: the
`MoEConfig` of its MoE layers, the checkpoint naming (`epmoe.checkpoint.NAMINGS`), which of the
checkpoint's layers are MoE layers, and how the checkpoint stores the experts.

Families are read by `model_type` (multimodal configs: their text config; fields.py). Field
names differ between families and releases (`n_routed_experts` / `num_experts` /
`num_local_experts`), so each figure is read from the first name present (fields.py); a figure
no name gives is an error naming them, and so is a router or expert feature epmoe does not
compute (the model is refused, not approximated: families.py). The router's semantics follow
each family's Hugging Face modeling code:
  deepseek_v3, deepseek_v32,  sigmoid scores + selection bias, group-limited top-k,
  kimi_k2, glm4_moe, dots1,   renormalized if norm_topk_prob, then x routed_scaling_factor
  glm4v_moe_text,             (GLM-4.5V: its layers under model.language_model.)
  glm4_moe_lite, solar_open
  minimax_m2                  sigmoid scores + selection bias (use_routing_bias), top-k over
                              all experts, always renormalized, no scale; no shared expert
  deepseek_v4                 sqrt(softplus) (or its scoring_func) + selection bias, top-k
                              over all experts, always renormalized, x routed_scaling_factor;
                              routed experts clamp gate / up at swiglu_limit (the shared expert
                              does not). Its first layers (mlp_layer_types "hash_moe", else
                              num_hash_layers) take their experts from gate.tid2eid by token
                              id, weighted by the same scores (MoEConfig.hash_layers).
                              Checkpoints in DeepSeek's own layout (layers.{l}.ffn.: MXFP4
                              experts, fp8 shared MLP, e8m0 `scale`s) or transformers' names.
  deepseek_v2                 softmax top-k ("greedy", or "group_limited_greedy": the
                              topk_group groups with the best expert); x routed_scaling_factor
                              only when not renormalized (its modeling code)
  qwen3_moe, olmoe, mixtral   softmax top-k, renormalized if norm_topk_prob
  qwen2_moe, qwen3_next       the same, plus a gated shared expert: one SwiGLU MLP of
                              shared_expert_intermediate_size, its output x sigmoid(x . w_g)
  qwen3_5_moe_text            Qwen3-Next's block, always renormalized
  gpt_oss                     softmax over the top-k of logits + bias; expert biases; clamped
                              swiglu (swiglu_limit), alpha 1.702
  llama4_text                 top-1 of the logits; the chosen expert's input x sigmoid(logit)
                              (no weight on its output); one shared expert, ungated
  ernie4_5_moe                softmax scores, top-k of score + selection bias (moe_statics),
                              always renormalized, never scaled; moe_num_shared_experts
  qwen3_vl_moe_text,          softmax top-k; Qwen3-VL always renormalized (fused experts read),
  qwen3_omni_moe_text,        the others if norm_topk_prob; MiniMax-Text-01 / M1: Mixtral's
  flex_olmo, minimax          block
  hunyuan_v1_moe              softmax top-k, always renormalized; one shared MLP as wide as an
                              expert (intermediate_size)
  granitemoe(shared|hybrid)   softmax over the top-k logits (= renormalized softmax top-k); one
                              shared MLP shared_intermediate_size wide
  dbrx                        softmax top-k / its 1-norm, or not normalized
  afmoe                       sigmoid + expert_bias over every expert, renormalized, x route_scale
  kimi_linear                 DeepSeek-V3's block (moe_router_activation_func, moe_renormalize,
                              num_experts_per_token); a latent MoE (Kimi-K3) is refused
  lfm2_moe                    sigmoid (+ expert_bias if use_expert_bias) over every expert,
                              / (sum + 1e-6) if norm_topk_prob, x routed_scaling_factor
  jamba                       softmax top-k, not renormalized; MoE every expert_layer_period-th
                              layer from expert_layer_offset
  bailing_moe(_v2)            Ling / Ring: by score_function: sigmoid + expert_bias within
                              V3's groups (2.x) or softmax (1.x); / sum if norm_topk_prob and
                              top_k > 1; x routed_scaling_factor; num_shared_experts
Refused with the reason (families.REFUSED): phimoe, longcat_flash, jetmoe, nemotron_h.
MoE layers (layers.py): `first_k_dense_replace` or `num_dense_layers` / `moe_layer_freq`
(DeepSeek, GLM, AFMoE), `decoder_sparse_step` / `mlp_only_layers` (Qwen), `mlp_layer_types` /
`num_hash_layers` (DeepSeek-V4), `moe_layers` / `interleave_moe_layer_step` (Llama 4),
`moe_layer_start_index` / `moe_layer_end_index` / `moe_layer_interval` (ERNIE 4.5), else every
layer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from epmoe.config import MoEConfig
from epmoe.hf_config.families import FAMILIES, REFUSED, Family
from epmoe.hf_config.fields import (EXPERT_WIDTH, EXPERTS, HIDDEN, SCALE, SHARED_COUNT, TOP_K,
                                    check_fields, get, language_model)
from epmoe.hf_config.layers import hash_layers, moe_layers


@dataclass(frozen=True)
class HFModel:
    """What a config.json says about a model's MoE layers."""

    cfg: MoEConfig
    naming: str | None  # epmoe.checkpoint.NAMINGS key; None: its checkpoints are not read
    moe_layers: tuple[int, ...]  # the checkpoint's layer index of MoE layer 0, 1, ...
    stored_recipe: str | None  # experts as stored: bf16 | fp8_block | w4a8_mxfp4 (None: other)
    model_type: str


def _path(path: str) -> str:
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(p):
        raise ValueError(f"{path!r}: no Hugging Face config.json there")
    return p


def read_hf_config(path: str, name: str | None = None) -> HFModel:
    """The MoE layers of the model whose config.json is `path` (or lies in folder `path`)."""
    file = _path(path)
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not a readable JSON config ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: a config.json holds one JSON object")
    name = name or os.path.basename(os.path.dirname(os.path.abspath(file))) or "model"
    return parse_hf_config(raw, name, where=file)


def _shared(d: dict, fam: Family, at: str, width: int) -> tuple[int, int, bool]:
    """(num_shared_experts, shared_intermediate_size or 0, gated) of the family's shared MLP."""
    sis = int(d.get("shared_expert_intermediate_size") or 0)
    if sis and fam.shared != "gated":
        raise ValueError(f"{at}: shared_expert_intermediate_size is a gated shared expert "
                         f"(Qwen2-MoE's), not one of {d.get('model_type')}'s")
    if fam.shared == "one":
        return 1, 0, False
    if fam.shared in ("gated", "granite"):
        w = sis if fam.shared == "gated" else \
            int(get(d, at, "shared_intermediate_size", default=fam.shared_default))
        if not w:
            return 0, 0, False
        # one MLP of width w: as n experts' widths where it tiles, else its own width
        return (w // width, 0, sis > 0) if w % width == 0 else (1, w, sis > 0)
    return int(get(d, at, *SHARED_COUNT, default=0)), 0, False


def _router(d: dict, fam: Family, at: str) -> str:
    # a family whose router selects on score + bias keeps doing so with softmax scores
    softmax = "softmax" if fam.router == "softmax" else "softmax_biased"
    router = {"sigmoid": "sigmoid_grouped", "softmax": softmax, "sqrtsoftplus": "sqrtsoftplus",
              None: fam.router}.get(d.get("scoring_func"), "?")
    if router == "?":
        raise ValueError(f"{at}: scoring_func {d['scoring_func']!r} is not one of sigmoid, "
                         f"softmax, sqrtsoftplus")
    return router


def parse_hf_config(raw: dict, name: str, where: str = "config.json") -> HFModel:
    d = language_model(raw)
    mtype = d.get("model_type")
    if mtype in REFUSED:
        raise ValueError(f"{where}: model_type {mtype!r}: epmoe does not compute "
                         f"{REFUSED[mtype]}")
    if mtype not in FAMILIES:
        raise ValueError(f"{where}: model_type {mtype!r} is not a MoE family epmoe reads; "
                         f"supported: {', '.join(FAMILIES)}")
    fam = FAMILIES[mtype]
    at = f"{where} ({mtype})"
    check_fields(d, at)
    width = int(get(d, at, *(fam.width or EXPERT_WIDTH)))
    shared, shared_width, gated = _shared(d, fam, at, width)
    router = _router(d, fam, at)
    n_group, topk_group = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
    if router == "softmax" and d.get("topk_method") != "group_limited_greedy":
        n_group = topk_group = 1  # softmax routers pick among all experts ("greedy"), but for
        #                           DeepSeek-V2's groups ranked by their best expert
    fixed = dict(fam.fixed)
    act = d.get("hidden_act", "silu")
    if "activation" not in fixed and act not in ("silu", "swish"):
        raise ValueError(f"{at}: hidden_act {act!r}: epmoe's experts compute SwiGLU (silu)")
    layers = moe_layers(d, fam, at)
    hashed = tuple(layers.index(i) for i in hash_layers(d, fam, at))
    if hashed and not d.get("vocab_size"):
        raise ValueError(f"{at}: hash-routed layers {list(hashed)} need vocab_size (their "
                         f"tables' rows)")
    f = dict(name=name, hidden=int(get(d, at, *HIDDEN)), moe_intermediate=width,
             num_experts=int(get(d, at, *EXPERTS)), top_k=int(get(d, at, *TOP_K)),
             num_shared_experts=shared, shared_intermediate_size=shared_width,
             shared_gate=gated, router=router,
             renormalize=bool(get(d, at, "norm_topk_prob", default=fam.renormalize))
             if fam.reads_norm else fam.renormalize,
             n_group=n_group, topk_group=topk_group,
             routed_scaling_factor=float(get(d, at, *SCALE, default=1.0) or 1.0)
             if fam.reads_scale else 1.0,
             swiglu_limit=float(d["swiglu_limit"]) if fam.clamps and d.get("swiglu_limit")
             else None, num_moe_layers=len(layers), hash_layers=hashed,
             vocab_size=int(d["vocab_size"]) if hashed else 0, **fixed)
    if fam.adjust is not None:
        f = fam.adjust(d, at, f)
    return HFModel(MoEConfig(**f), fam.naming, layers, _stored_recipe(d), mtype)


def _stored_recipe(d: dict) -> str | None:
    q = d.get("quantization_config") or {}
    method = q.get("quant_method")
    if "fp4" in (d.get("expert_dtype"), q.get("expert_dtype")):  # DeepSeek-V4: MXFP4 experts
        return "w4a8_mxfp4"
    if method is None:
        return "bf16"
    if method == "fp8" and list(q.get("weight_block_size") or ()) == [128, 128]:
        return "fp8_block"
    if method == "mxfp4":
        return "w4a8_mxfp4"
    return None  # a storage epmoe's checkpoint reader does not decode (AWQ, GPTQ, ...)


from epmoe.hf_config.cli import describe, main  # noqa: E402  (the CLI reads HFModel above)

__all__ = ["HFModel", "FAMILIES", "REFUSED", "read_hf_config", "parse_hf_config", "describe",
           "main"]
