"""A model's MoE layers from its Hugging Face `config.json`: `--model path/to/config.json`.

`read_hf_config(path)` (the file, or the checkpoint folder holding it) -> `HFModel`: the
`MoEConfig` of its MoE layers, the checkpoint naming (`epmoe.checkpoint.NAMINGS`), which of the
checkpoint's layers are MoE layers, and how the checkpoint stores the experts.

Families are read by `model_type` (multimodal configs: their `text_config`). Field names differ
between families and releases (`n_routed_experts` / `num_experts` / `num_local_experts`), so
each figure is read from the first name present; a figure no name gives is an error naming
them, and so is a router or expert feature epmoe does not compute (the model is refused, not
approximated). The router's semantics follow each family's Hugging Face modeling code:
  deepseek_v3, deepseek_v32,  sigmoid scores + selection bias, group-limited top-k,
  kimi_k2, glm4_moe, dots1,   renormalized if norm_topk_prob, then x routed_scaling_factor
  glm4v_moe_text              (GLM-4.5V: checkpoints not read)
  minimax_m2                  sigmoid scores + selection bias (use_routing_bias), top-k over
                              all experts, always renormalized, no scale; no shared expert
  deepseek_v4                 sqrt(softplus) (or its scoring_func) + selection bias, top-k
                              over all experts, always renormalized, x routed_scaling_factor;
                              routed experts clamp gate / up at swiglu_limit (the shared expert
                              does not). Its first hash-routed layers (mlp_layer_types
                              "hash_moe": experts picked by token id) are not MoE layers here,
                              and its checkpoints (DeepSeek's own layout) are not read.
  deepseek_v2                 softmax top-k ("greedy"); x routed_scaling_factor only when not
                              renormalized (its modeling code)
  qwen3_moe, olmoe, mixtral   softmax top-k, renormalized if norm_topk_prob
  qwen2_moe, qwen3_next       the same, plus a gated shared expert: one SwiGLU MLP of
                              shared_expert_intermediate_size, its output x sigmoid(x . w_g)
  qwen3_5_moe_text            Qwen3-Next's block, always renormalized (checkpoints not read)
  gpt_oss                     softmax over the top-k of logits + bias; expert biases; clamped
                              swiglu (swiglu_limit), alpha 1.702
  llama4_text                 top-1 of the logits; the chosen expert's input x sigmoid(logit)
                              (no weight on its output); one shared expert, ungated
  ernie4_5_moe                softmax scores, top-k of score + selection bias (moe_statics),
                              always renormalized, never scaled; moe_num_shared_experts
MoE layers: `first_k_dense_replace` / `moe_layer_freq` (DeepSeek, GLM), `decoder_sparse_step` /
`mlp_only_layers` (Qwen), `mlp_layer_types` / `num_hash_layers` (DeepSeek-V4), `moe_layers` /
`interleave_moe_layer_step` (Llama 4), `moe_layer_start_index` / `moe_layer_end_index` /
`moe_layer_interval` (ERNIE 4.5), else every layer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from epmoe.config import MoEConfig


@dataclass(frozen=True)
class HFModel:
    """What a config.json says about a model's MoE layers."""

    cfg: MoEConfig
    naming: str | None  # epmoe.checkpoint.NAMINGS key; None: its checkpoints are not read
    moe_layers: tuple[int, ...]  # the checkpoint's layer index of MoE layer 0, 1, ...
    stored_recipe: str | None  # experts as stored: bf16 | fp8_block | w4a8_mxfp4 (None: other)
    model_type: str


@dataclass(frozen=True)
class _Family:
    naming: str | None
    router: str  # without a scoring_func field
    renormalize: bool  # without a norm_topk_prob field: the HF config class's default
    layers: str  # dense_first | sparse_step | hash_first | interleave | ernie | all
    reads_norm: bool = True  # False: the modeling code always renormalizes (field unread)
    reads_scale: bool = True  # False: it never scales (routed_scaling_factor unread)
    clamps: bool = False  # its routed experts clamp gate / up at swiglu_limit
    gated_shared: bool = False  # shared_expert_intermediate_size wide, x sigmoid(x . w_g)


_DEEPSEEK = _Family("deepseek", "sigmoid_grouped", True, "dense_first")
FAMILIES = {
    "deepseek_v3": _DEEPSEEK,
    "deepseek_v32": _DEEPSEEK,  # V3.2: V3's MoE layer (its change is the attention)
    "kimi_k2": _DEEPSEEK,
    "glm4_moe": _DEEPSEEK,
    "glm4v_moe_text": _Family(None, "sigmoid_grouped", True, "dense_first"),  # GLM-4.5V's LM
    "dots1": _Family("deepseek", "sigmoid_grouped", False, "dense_first"),  # V3's MoE layer
    "minimax_m2": _Family("minimax", "sigmoid_grouped", True, "all", reads_norm=False,
                          reads_scale=False),
    # V4: checkpoints in DeepSeek's own layout, not read; hash-routed layers not run
    "deepseek_v4": _Family(None, "sqrtsoftplus", True, "hash_first", reads_norm=False,
                           clamps=True),
    "deepseek_v2": _Family("deepseek", "softmax", False, "dense_first"),
    "qwen3_moe": _Family("qwen3_moe", "softmax", False, "sparse_step"),
    "qwen2_moe": _Family("qwen2_moe", "softmax", False, "sparse_step", gated_shared=True),
    "qwen3_next": _Family("qwen2_moe", "softmax", True, "sparse_step", gated_shared=True),
    # Qwen3.5: Qwen3-Next's MoE block, always renormalized; its checkpoints are not read
    "qwen3_5_moe_text": _Family(None, "softmax", True, "all", reads_norm=False,
                                gated_shared=True),
    "olmoe": _Family("qwen3_moe", "softmax", False, "all"),
    "mixtral": _Family("mixtral", "softmax", True, "all"),
    "gpt_oss": _Family("gpt_oss", "softmax", True, "all", clamps=True),
    # Llama 4: top-1 of the logits, the expert's input x sigmoid(logit), one shared expert;
    # its fused checkpoints are not read
    "llama4_text": _Family(None, "sigmoid_grouped", False, "interleave", reads_norm=False,
                           reads_scale=False),
    # ERNIE 4.5: softmax scores selected on score + moe_statics' bias, always renormalized
    "ernie4_5_moe": _Family("ernie", "softmax_biased", True, "ernie", reads_norm=False,
                            reads_scale=False),
}


def _path(path: str) -> str:
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(p):
        raise ValueError(f"{path!r}: no Hugging Face config.json there")
    return p


_REQUIRED = object()


def _get(d: dict, where: str, *names, default=_REQUIRED):
    """The first of `names` the config gives; else the default, or an error naming them."""
    for n in names:
        if d.get(n) is not None:
            return d[n]
    if default is _REQUIRED:
        raise ValueError(f"{where}: the config has none of {', '.join(names)}")
    return default


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


def parse_hf_config(raw: dict, name: str, where: str = "config.json") -> HFModel:
    d, text = raw, raw.get("text_config")
    if "hidden_size" not in raw and isinstance(text, dict):
        d = {**raw, **text}  # a multimodal config: its language model's figures
    mtype = d.get("model_type")
    if mtype not in FAMILIES:
        raise ValueError(f"{where}: model_type {mtype!r} is not a MoE family epmoe reads; "
                         f"supported: {', '.join(FAMILIES)}")
    fam = FAMILIES[mtype]
    at = f"{where} ({mtype})"
    experts = _get(d, at, "n_routed_experts", "num_experts", "num_local_experts",
                   "moe_num_experts")
    shared, moe_inter = int(_get(d, at, "n_shared_experts", "moe_num_shared_experts",
                                 default=0)), \
        int(_get(d, at, "moe_intermediate_size", "intermediate_size"))
    sis = int(d.get("shared_expert_intermediate_size") or 0)
    if sis and not fam.gated_shared:
        raise ValueError(f"{at}: shared_expert_intermediate_size is a gated shared expert "
                         f"(Qwen2-MoE's), not one of {mtype}'s")
    if sis:  # one MLP of that width: epmoe's shared MLP is num_shared x moe_intermediate wide
        if sis % moe_inter:
            raise ValueError(f"{at}: shared_expert_intermediate_size ({sis}) is not a multiple "
                             f"of moe_intermediate_size ({moe_inter})")
        shared = sis // moe_inter
    if mtype == "ernie4_5_moe" and d.get("use_bias"):
        raise ValueError(f"{at}: use_bias: its expert MLPs carry linear biases, which epmoe's "
                         f"experts compute only in gpt-oss's form")
    if mtype == "minimax_m2" and d.get("shared_intermediate_size"):
        raise ValueError(f"{at}: shared_intermediate_size {d['shared_intermediate_size']}: "
                         f"MiniMax-M2's modeling code has no shared expert to compute it with")
    # a family whose router selects on score + bias keeps doing so with softmax scores
    softmax = "softmax" if fam.router == "softmax" else "softmax_biased"
    router = {"sigmoid": "sigmoid_grouped", "softmax": softmax, "sqrtsoftplus": "sqrtsoftplus",
              None: fam.router}.get(d.get("scoring_func"), "?")
    if router == "?":
        raise ValueError(f"{at}: scoring_func {d['scoring_func']!r} is not one of sigmoid, "
                         f"softmax, sqrtsoftplus")
    n_group, topk_group = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
    method = d.get("topk_method")
    if method == "group_limited_greedy" and n_group > 1:
        raise ValueError(f"{at}: topk_method 'group_limited_greedy' (softmax, groups ranked by "
                         f"their best expert) is not one of epmoe's routers")
    if router == "softmax":
        n_group = topk_group = 1  # softmax routers here pick among all experts ("greedy")
    renorm = fam.renormalize if not fam.reads_norm else \
        bool(_get(d, at, "norm_topk_prob", default=fam.renormalize))
    scale = float(d.get("routed_scaling_factor") or 1.0) if fam.reads_scale else 1.0
    if mtype == "deepseek_v2" and renorm:
        scale = 1.0  # V2 scales the weights only when it does not renormalize them
    act = d.get("hidden_act", "silu")
    if mtype != "gpt_oss" and act not in ("silu", "swish"):
        raise ValueError(f"{at}: hidden_act {act!r}: epmoe's experts compute SwiGLU (silu)")
    moe_layers = _moe_layers(d, fam, at)
    oss, llama4 = mtype == "gpt_oss", mtype == "llama4_text"
    if llama4:
        shared = 1  # Llama4TextMoe's shared_expert: one MLP of the experts' intermediate size
    cfg = MoEConfig(
        name=name, hidden=int(_get(d, at, "hidden_size")),
        moe_intermediate=moe_inter, num_experts=int(experts),
        top_k=int(_get(d, at, "num_experts_per_tok", "experts_per_token", "moe_topk", "moe_k")),
        num_shared_experts=shared, shared_gate=bool(sis), router=router,
        renormalize=renorm, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=scale, activation="swigluoai" if oss else "swiglu",
        swiglu_limit=float(d["swiglu_limit"]) if fam.clamps and d.get("swiglu_limit") else None,
        num_moe_layers=len(moe_layers), router_bias=oss, expert_bias=oss,
        apply_router_weight_on_input=llama4, selection_bias=not llama4)
    return HFModel(cfg, fam.naming, moe_layers, _stored_recipe(d), mtype)


def _moe_layers(d: dict, fam: _Family, at: str) -> tuple[int, ...]:
    n = int(_get(d, at, "num_hidden_layers"))
    if fam.layers == "dense_first":
        first = int(d.get("first_k_dense_replace") or 0)
        freq = int(d.get("moe_layer_freq") or 1)
        layers = [i for i in range(n) if i >= first and i % freq == 0]
    elif fam.layers == "sparse_step":
        step = int(d.get("decoder_sparse_step") or 1)
        dense = set(d.get("mlp_only_layers") or ())
        layers = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    elif fam.layers == "ernie":  # every interval-th layer from start to end (-1: the last)
        start, end = d.get("moe_layer_start_index", 1), d.get("moe_layer_end_index", -1)
        if not isinstance(start, int) or not isinstance(end, int):
            raise ValueError(f"{at}: moe_layer_start_index / moe_layer_end_index per modality "
                             f"(a vision-language model) are not read")
        end = n - 1 if end == -1 else end
        step = int(d.get("moe_layer_interval") or 1)
        layers = [i for i in range(n) if (i + 1) % step == 0 and start <= i <= end]
    elif fam.layers == "interleave":  # Llama 4: moe_layers, else every step-th layer
        step = int(d.get("interleave_moe_layer_step") or 1)
        layers = [int(i) for i in d.get("moe_layers") or range(step - 1, n, step)]
        if any(not 0 <= i < n for i in layers):
            raise ValueError(f"{at}: moe_layers {layers} name layers outside its {n}")
    elif fam.layers == "hash_first":  # DeepSeek-V4: "hash_moe" layers pick experts by token id
        types = d.get("mlp_layer_types")
        if types is None:
            hashed = int(d.get("num_hash_layers", 3))
            types = ["hash_moe"] * hashed + ["moe"] * (n - hashed)
        if len(types) != n or set(types) - {"moe", "hash_moe"}:
            raise ValueError(f"{at}: mlp_layer_types must give moe or hash_moe for each of its "
                             f"{n} layers")
        layers = [i for i, t in enumerate(types) if t == "moe"]
    else:
        layers = list(range(n))
    if not layers:
        raise ValueError(f"{at}: none of its {n} layers is a MoE layer")
    return tuple(layers)


def _stored_recipe(d: dict) -> str | None:
    q = d.get("quantization_config") or {}
    method = q.get("quant_method")
    if method is None:
        return "bf16"
    if method == "fp8" and list(q.get("weight_block_size") or ()) == [128, 128]:
        return "fp8_block"
    if method == "mxfp4":
        return "w4a8_mxfp4"
    return None  # a storage epmoe's checkpoint reader does not decode (AWQ, GPTQ, ...)


# --------------------------------------------------------------------------------------------
# python -m epmoe.hf_config PATH: what epmoe reads from a config.json

def _spans(idx) -> str:
    """(0, 1, 2, 5, 7, 9) -> "0-2, 5-9/2": runs of a constant step."""
    out, i = [], 0
    while i < len(idx):
        j, step = i, (idx[i + 1] - idx[i]) if i + 1 < len(idx) else 1
        while j + 1 < len(idx) and idx[j + 1] - idx[j] == step:
            j += 1
        if j == i:
            out.append(str(idx[i]))
        else:
            out.append(f"{idx[i]}-{idx[j]}" + (f"/{step}" if step != 1 else ""))
        i = j + 1
    return ", ".join(out)


def describe(hf: HFModel) -> list[tuple[str, str]]:
    """(field, what epmoe computes) rows for a person to check against the model card."""
    c = hf.cfg
    shared = "none" if not c.num_shared_experts else \
        f"{c.num_shared_experts} x {c.moe_intermediate} wide" + (", gated" if c.shared_gate else "")
    route = {"softmax": "softmax", "sigmoid_grouped": "sigmoid",
             "sqrtsoftplus": "sqrt(softplus)", "softmax_biased": "softmax scores"}[c.router]
    if c.router != "softmax":
        route += " + selection bias" if c.selection_bias else ""
        route += f", {c.topk_group} of {c.n_group} groups" if c.n_group > 1 else ""
    elif c.router_bias:
        route += " of logits + bias"
    route += (", renormalized" if c.renormalize else "") + \
        (f", x {c.routed_scaling_factor:g}" if c.routed_scaling_factor != 1 else "")
    act = c.activation + (f", clamp {c.swiglu_limit:g}" if c.swiglu_limit else "") + \
        (", expert biases" if c.expert_bias else "") + \
        (", input x weight" if c.apply_router_weight_on_input else "")
    ckpt = "not read (--weights refuses it)" if hf.naming is None else \
        f"naming {hf.naming}, experts stored {hf.stored_recipe or 'in a format epmoe does not decode'}"
    return [("model_type", hf.model_type),
            ("MoE layers", f"{len(hf.moe_layers)}: checkpoint layers {_spans(hf.moe_layers)}"),
            ("experts", f"{c.num_experts} routed, top-{c.top_k}, hidden {c.hidden}, "
                        f"intermediate {c.moe_intermediate}"),
            ("shared", shared), ("router", route), ("activation", act), ("checkpoint", ckpt)]


def main(argv=None) -> int:
    import argparse
    import dataclasses
    import sys

    p = argparse.ArgumentParser(prog="python -m epmoe.hf_config", description=(
        "Print the MoE layer epmoe reads from a Hugging Face config.json (the file or its "
        "folder): what --model PATH will run."))
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="the MoEConfig and layers as JSON")
    a = p.parse_args(argv)
    try:
        hf = read_hf_config(a.path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(dict(dataclasses.asdict(hf), cfg=dataclasses.asdict(hf.cfg)), indent=1))
        return 0
    print(f"{a.path}: {hf.cfg.name}")
    for k, v in describe(hf):
        print(f"  {k:<11} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
