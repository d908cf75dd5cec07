"""Where a Hugging Face checkpoint keeps one MoE layer's tensors: name templates per naming
scheme (`{l}`: the checkpoint's layer index, `{e}`: the expert), read by epmoe.checkpoint.

  gate / bias     the router's weight [E, D] and its bias (selection bias, or gpt-oss's logit
                  bias); bias None: the scheme stores none
  expert          one expert's prefix (per-expert tensors), or the experts' (fused)
  shared          the shared MLP's prefix (None: none); shared_gate: Qwen2-MoE's gate [1, D]
  proj            gate / up / down projection names (fused: gate_up, None, down)
  shared_proj     the shared MLP's, where they differ from the experts'
  fused           the experts' tensors carry an expert axis: "gpt_oss" ([E, in, out], gate / up
                  interleaved; bf16 or MXFP4 blocks), "granite" ([E, out, in], gate rows then
                  up), "bmm" ([E, in, out], gate columns then up: Llama 4, Qwen3-VL)
"""

from __future__ import annotations

GUD = ("gate_proj", "up_proj", "down_proj")
# a multimodal checkpoint keeps its language model's layers under another prefix (GLM-4.5V,
# Qwen3-VL): a scheme's "model.layers." names are looked for there too
LAYER_PREFIXES = ("model.layers.", "model.language_model.layers.",
                  "language_model.model.layers.")
W13 = ("w1", "w3", "w2")


def located(nm: dict, has, layer: int) -> dict:
    """The scheme `nm` with its layer prefix moved to where the checkpoint keeps `layer`'s
    router (`has(name)`: the checkpoint holds that tensor); `nm` itself where it is already
    there, or found nowhere (the reader then names the missing tensor)."""
    ours = next((p for p in LAYER_PREFIXES if nm["gate"].startswith(p)), None)
    if ours is None or has(nm["gate"].format(l=layer)):
        return nm
    for other in LAYER_PREFIXES:
        moved = {k: v.replace(ours, other, 1) if isinstance(v, str) else v
                 for k, v in nm.items()}
        if has(moved["gate"].format(l=layer)):
            return moved
    return nm


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
    "qwen3_omni": _scheme("thinker.model.layers.{l}.mlp.", "gate.weight"),  # Omni's thinker
    "lfm2": _scheme("model.layers.{l}.feed_forward.", "gate.weight", "expert_bias", proj=W13),
    "mixtral": _scheme(_SPARSE, "gate.weight", proj=W13),
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
    "granite": {**_scheme(_SPARSE, "router.layer.weight", expert="", fused="granite",
                          proj=("input_linear", None, "output_linear")),
                "shared": "model.layers.{l}.shared_mlp."},
    "gpt_oss": _scheme(_MLP, "router.weight", "router.bias", expert="experts.", fused="gpt_oss",
                       proj=("gate_up_proj", None, "down_proj")),
}
