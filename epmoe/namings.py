"""Where a Hugging Face checkpoint keeps one MoE layer's tensors: name templates per naming
scheme (`{l}`: the checkpoint's layer index, `{e}`: the expert), read by epmoe.checkpoint.

  gate / bias     the router's weight [E, D] and its bias (selection bias, or gpt-oss's logit
                  bias); bias None: the scheme stores none
  expert          one expert's prefix (per-expert tensors), or the experts' (fused)
  shared          the shared MLP's prefix (None: none); shared_gate: Qwen2-MoE's gate [1, D]
  proj            gate / up / down projection names (fused: gate_up, None, down)
  shared_proj     the shared MLP's, where they differ from the experts'
  alt             the scheme a checkpoint of this family may hold instead (DeepSeek-V4's
                  hub layout, or transformers' names for it: "deepseek")
  fused           the experts' tensors carry an expert axis: "gpt_oss" ([E, in, out], gate / up
                  interleaved; bf16 or MXFP4 blocks), "out_in" ([E, out, in], gate rows then
                  up: Granite, transformers 5), "bmm" ([E, in, out], gate columns then up:
                  Llama 4, Qwen3-VL), "dbrx" (w1 / v1 / w2 [E*I, D]: an expert's I rows each)

A checkpoint may hold a scheme's tensors another common way, and is read as it holds them:
  - one MLP's gate and up as one [2I, D] tensor (`mlp_names`): gate_up_proj (gate rows first)
    or gate_and_up_proj (up rows first: HunYuan's release checkpoints);
  - per-expert experts saved as transformers 5 holds them (`stored`): experts.gate_up_proj
    [E, 2I, D] (gate rows, then up) and experts.down_proj [E, D, I] (Qwen3.5-MoE's release).
"""

from __future__ import annotations

GUD = ("gate_proj", "up_proj", "down_proj")
# a multimodal checkpoint keeps its language model's layers under another prefix (GLM-4.5V,
# Qwen3-VL): a scheme's "model.layers." names are looked for there too
LAYER_PREFIXES = ("model.layers.", "model.language_model.layers.",
                  "language_model.model.layers.")
W13 = ("w1", "w3", "w2")
TF5 = ("gate_up_proj", None, "down_proj")  # transformers 5's fused experts, [E, out, in]
# one MLP's gate and up stored as one [2I, D] tensor: its name, and whether up's rows come first
W13_ONE = (("gate_up_proj", False), ("gate_and_up_proj", True))


def located(nm: dict, has, layer: int) -> dict:
    """The scheme `nm` with its layer prefix moved to where the checkpoint keeps `layer`'s
    router (`has(name)`: the checkpoint holds that tensor), or its `alt` scheme where the
    checkpoint holds that one's router instead; `nm` itself where it is already there, or
    found nowhere (the reader then names the missing tensor)."""
    if has(nm["gate"].format(l=layer)):
        return nm
    if nm.get("alt"):
        alt = located(NAMINGS[nm["alt"]], has, layer)
        if has(alt["gate"].format(l=layer)):
            return alt
    ours = next((p for p in LAYER_PREFIXES if nm["gate"].startswith(p)), None)
    if ours is None:
        return nm
    for other in LAYER_PREFIXES:
        moved = {k: v.replace(ours, other, 1) if isinstance(v, str) else v
                 for k, v in nm.items()}
        if has(moved["gate"].format(l=layer)):
            return moved
    return nm


def mlp_names(has, pre: str, proj: tuple) -> tuple[tuple, bool]:
    """One MLP's (gate, up, down) names under prefix `pre`, and whether up's rows come first:
    the scheme's `proj`, or where the checkpoint holds no separate gate but one fused [2I, D]
    gate/up tensor (W13_ONE), that one as (name, None, down)."""
    g, u, d = proj
    if u is None or has(pre + g + ".weight"):
        return proj, False
    for name, up_first in W13_ONE:
        if has(pre + name + ".weight"):
            return (name, None, d), up_first
    return proj, False


def stored(nm: dict, has, layer: int) -> dict:
    """The per-expert scheme `nm` switched to transformers 5's fused experts (TF5 under the
    experts' prefix) where the checkpoint holds `layer`'s experts that way and not one by one;
    `nm` itself otherwise (a fused scheme, or the per-expert tensors are there)."""
    if nm.get("fused") or "{e}" not in nm["expert"]:
        return nm
    first = nm["expert"].format(l=layer, e=0)
    if has(first + mlp_names(has, first, nm["proj"])[0][0] + ".weight"):
        return nm
    fused = nm["expert"].replace("{e}.", "")
    if not has(fused.format(l=layer) + TF5[0]):
        return nm
    return dict(nm, expert=fused, fused="out_in", proj=TF5,
                shared_proj=nm.get("shared_proj", nm["proj"]))


def _scheme(pre: str, gate: str, bias: str | None = None, shared: str | None = None,
            expert: str = "experts.{e}.", proj=GUD, **extra) -> dict:
    """Templates under one layer prefix `pre` (every name but the extras' is relative to it)."""
    return dict(gate=pre + gate, bias=bias and pre + bias, expert=pre + expert,
                shared=shared and pre + shared, proj=proj, **extra)


_MLP = "model.layers.{l}.mlp."
_SPARSE = "model.layers.{l}.block_sparse_moe."

NAMINGS = {
    "deepseek": _scheme(_MLP, "gate.weight", "gate.e_score_correction_bias", "shared_experts."),
    "qwen3_moe": _scheme(_MLP, "gate.weight"),
    "qwen2_moe": _scheme(_MLP, "gate.weight", shared="shared_expert.",
                         shared_gate=_MLP + "shared_expert_gate.weight"),
    "ernie": _scheme(_MLP, "gate.weight", "moe_statics.e_score_correction_bias",  # bias [1, E]
                     "shared_experts."),
    "hunyuan": _scheme(_MLP, "gate.wg.weight", shared="shared_mlp."),  # gate kept fp32
    "afmoe": _scheme(_MLP, "router.gate.weight", "expert_bias", "shared_experts."),
    "bailing": _scheme(_MLP, "gate.weight", "gate.expert_bias", "shared_experts."),
    "qwen3_omni": _scheme("thinker.model.layers.{l}.mlp.", "gate.weight"),  # Omni's thinker
    "lfm2": _scheme("model.layers.{l}.feed_forward.", "gate.weight", "expert_bias", proj=W13),
    "jamba": _scheme("model.layers.{l}.feed_forward.", "router.weight"),
    "mixtral": _scheme(_SPARSE, "gate.weight", proj=W13),
    # DeepSeek's own layout (DeepSeek-V4's hub checkpoints): no "model." prefix, w1 / w3 / w2
    # with a `scale` beside each quantized weight (experts MXFP4, the shared MLP fp8)
    "deepseek_v4": _scheme("layers.{l}.ffn.", "gate.weight", "gate.bias", "shared_experts.",
                           proj=W13, alt="deepseek"),
    "kimi": _scheme(_SPARSE, "gate.weight", "gate.e_score_correction_bias", "shared_experts.",
                    proj=W13, shared_proj=GUD),  # Kimi-Linear
    "minimax": _scheme(_SPARSE, "gate.weight", "e_score_correction_bias", proj=W13),
    # fused [E, ...] expert tensors
    "llama4": _scheme("language_model.model.layers.{l}.feed_forward.", "router.weight",
                      shared="shared_expert.", expert="experts.", fused="bmm",
                      proj=("gate_up_proj", None, "down_proj"), shared_proj=GUD),
    "qwen3_vl": _scheme("model.language_model.layers.{l}.mlp.", "gate.weight",
                        expert="experts.", fused="bmm",
                        proj=("gate_up_proj", None, "down_proj")),
    "granite": {**_scheme(_SPARSE, "router.layer.weight", expert="", fused="out_in",
                          proj=("input_linear.weight", None, "output_linear.weight"),
                          shared_proj=("input_linear", None, "output_linear")),
                "shared": "model.layers.{l}.shared_mlp."},
    "dbrx": _scheme("transformer.blocks.{l}.ffn.", "router.layer.weight", expert="experts.mlp.",
                    fused="dbrx", proj=("w1", "v1", "w2")),
    "gpt_oss": _scheme(_MLP, "router.weight", "router.bias", expert="experts.", fused="gpt_oss",
                       proj=("gate_up_proj", None, "down_proj")),
}
