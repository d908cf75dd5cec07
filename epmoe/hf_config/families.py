"""Each MoE family's semantics as its Hugging Face modeling code computes them: one `Family` per
`model_type`, and the families refused with the reason (a router or expert epmoe does not
compute). Field names are read in `epmoe.hf_config`; what a family computes differently from
its fields' names (or refuses) is its `adjust` hook here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from epmoe.hf_config.fields import one_value

# adjust(config dict, where, MoEConfig fields read so far) -> those fields, changed; raises
# ValueError for a config the family's modeling code computes in a way epmoe does not
Adjust = Callable[[dict, str, dict], dict]


@dataclass(frozen=True)
class Family:
    naming: str | None  # epmoe.checkpoint.NAMINGS key; None: its checkpoints are not read
    router: str  # without a scoring_func field
    renormalize: bool  # without a norm_topk_prob field: the HF config class's default
    layers: str  # dense_first | sparse_step | hash_first | interleave | ernie | period | all
    reads_norm: bool = True  # False: the modeling code always renormalizes (field unread)
    reads_scale: bool = True  # False: it never scales (routed_scaling_factor unread)
    clamps: bool = False  # its routed experts clamp gate / up at swiglu_limit
    # count: n_shared_experts x moe_intermediate | gated: one MLP of
    # shared_expert_intermediate_size, x sigmoid(x . w_g) (Qwen2-MoE) | granite: one MLP of
    # shared_intermediate_size (0: none) | one: one MLP of the experts' width
    shared: str = "count"
    shared_default: int = 0  # granite: the config class's default shared_intermediate_size
    width: tuple = ()  # the per-expert width's field names, where not fields.EXPERT_WIDTH
    fixed: tuple = ()  # ((MoEConfig field, value), ...) the family always has
    adjust: Adjust | None = None


def _refuse(at: str, what: str) -> ValueError:
    return ValueError(f"{at}: {what}")


def _ernie(d: dict, at: str, f: dict) -> dict:
    if d.get("use_bias"):
        raise _refuse(at, "use_bias: its expert MLPs carry linear biases, which epmoe's experts "
                          "compute only in gpt-oss's form")
    return f


def _no_shared(d: dict, at: str, f: dict) -> dict:
    if d.get("shared_intermediate_size"):
        raise _refuse(at, f"shared_intermediate_size {d['shared_intermediate_size']}: its "
                          f"modeling code has no shared expert to compute it with")
    return f


def _deepseek_v2(d: dict, at: str, f: dict) -> dict:
    # MoEGate: renormalized if top_k > 1 and norm_topk_prob, else x routed_scaling_factor
    f["renormalize"] = f["renormalize"] and f["top_k"] > 1
    if f["renormalize"]:
        f["routed_scaling_factor"] = 1.0
    return f


def _hunyuan(d: dict, at: str, f: dict) -> dict:
    # HunYuanMoEV1Moe: every expert and the one shared MLP intermediate_size wide (moe_topk may
    # be per layer: fields.get takes its one value). A release config's own fields must agree.
    inter = one_value(d, at, "moe_intermediate_size")
    if inter is not None and int(inter) != int(d["intermediate_size"]):
        raise _refuse(at, f"moe_intermediate_size {inter} != intermediate_size "
                          f"{d['intermediate_size']}: HunYuanMoEV1's experts and shared MLP are "
                          f"intermediate_size wide")
    shared = one_value(d, at, "num_shared_expert")
    if (shared is not None and int(shared) != 1) or d.get("use_mixed_mlp_moe") is False:
        raise _refuse(at, "num_shared_expert / use_mixed_mlp_moe: HunYuanMoEV1 adds exactly one "
                          "shared MLP")
    if d.get("moe_layer_num_skipped") or d.get("use_cla"):
        raise _refuse(at, "moe_layer_num_skipped / use_cla: not HunYuanMoEV1's layer")
    return f


def _dbrx(d: dict, at: str, f: dict) -> dict:
    # DbrxRouter: the top-k softmax weights / their p-norm (moe_normalize_expert_weights)
    p = d.get("moe_normalize_expert_weights", 1.0)
    if p is not None and float(p) != 1.0:
        raise _refuse(at, f"moe_normalize_expert_weights {p}: a p-norm other than 1 (the sum) "
                          f"is not one of epmoe's renormalizations")
    f["renormalize"] = p is not None
    act = (d.get("ffn_act_fn") or {}).get("name", "silu")
    if act not in ("silu", "swish"):
        raise _refuse(at, f"ffn_act_fn {act!r}: epmoe's experts compute SwiGLU (silu)")
    return f


def _granite_hybrid(d: dict, at: str, f: dict) -> dict:
    if not d.get("num_local_experts", 8):
        raise _refuse(at, "num_local_experts 0: a dense model, no MoE layer")
    return f


def _lfm2(d: dict, at: str, f: dict) -> dict:
    # Lfm2MoeSparseMoeBlock: sigmoid; top-k of sigmoid + expert_bias if use_expert_bias (else of
    # the sigmoid); / (sum + 1e-6) if norm_topk_prob; x routed_scaling_factor; silu experts
    return dict(f, n_group=1, topk_group=1, selection_bias=bool(d.get("use_expert_bias", True)),
                renorm_eps=1e-6 if f["renormalize"] else 0.0)


def _kimi(d: dict, at: str, f: dict) -> dict:
    # KimiMoEGate (Kimi-Linear): moe_router_activation_func scores, top-k of scores +
    # e_score_correction_bias, / (sum + 1e-20) if moe_renormalize and top_k > 1, x scale
    if d.get("routed_expert_hidden_size"):
        raise _refuse(at, "routed_expert_hidden_size: a latent MoE (experts on a projected "
                          "width), which epmoe's experts do not compute")
    func = d.get("moe_router_activation_func", "sigmoid")
    if func not in ("sigmoid", "softmax"):
        raise _refuse(at, f"moe_router_activation_func {func!r} is not sigmoid or softmax")
    groups = int(d.get("num_expert_group") or 1) if d.get("use_grouped_topk") else 1
    if groups > 1:
        raise _refuse(at, f"num_expert_group {groups}: Kimi's group-limited selection is not "
                          f"checked against epmoe's")
    return dict(f, router="sigmoid_grouped" if func == "sigmoid" else "softmax_biased",
                n_group=1, topk_group=1,
                renormalize=bool(d.get("moe_renormalize", True)) and f["top_k"] > 1)


def _afmoe(d: dict, at: str, f: dict) -> dict:
    # AfmoeTokenChoiceRouter: sigmoid, top-k of sigmoid + expert_bias over every expert (its
    # config's score_func / route_norm / n_group are not read by the modeling code)
    return dict(f, router="sigmoid_grouped", n_group=1, topk_group=1, renormalize=True)


def _bailing(d: dict, at: str, f: dict) -> dict:
    # BailingMoe (Ling 1.x: softmax; Ling / Ring 2.x: sigmoid + expert_bias, V3's groups):
    # scores by score_function (or scoring_func), selected on scores + expert_bias if
    # moe_router_enable_expert_bias, within the topk_group groups of best top-2 sums; weights
    # the unbiased scores, / (sum + 1e-20) if top_k > 1 and norm_topk_prob, x
    # routed_scaling_factor (unless moe_router_enable_routed_scaling is false); shared experts
    # num_shared_experts x (moe_shared_expert_intermediate_size or moe_intermediate_size)
    func = d.get("score_function") or d.get("scoring_func") or "softmax"
    if func not in ("sigmoid", "softmax"):
        raise _refuse(at, f"score_function {func!r} is not sigmoid or softmax")
    bias = bool(d.get("moe_router_enable_expert_bias"))
    groups, topk_group = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
    if func == "softmax" and groups > 1:
        raise _refuse(at, f"n_group {groups} with softmax scores: Bailing ranks groups by their "
                          f"top-2 sums, epmoe's softmax groups by their best expert")
    router = "sigmoid_grouped" if func == "sigmoid" else "softmax_biased" if bias else "softmax"
    f = dict(f, router=router, selection_bias=bias or func != "sigmoid", n_group=groups,
             topk_group=topk_group if groups > 1 else 1,
             renormalize=bool(d.get("norm_topk_prob", True)) and f["top_k"] > 1)
    if d.get("moe_router_enable_routed_scaling") is False:
        f["routed_scaling_factor"] = 1.0
    own = d.get("moe_shared_expert_intermediate_size")
    if own and f["num_shared_experts"] and int(own) != f["moe_intermediate"]:
        f = dict(f, shared_intermediate_size=int(own) * f["num_shared_experts"],
                 num_shared_experts=1)
    return f


_DEEPSEEK = Family("deepseek", "sigmoid_grouped", True, "dense_first")
_GRANITE = Family("granite", "softmax", True, "all", reads_norm=False, reads_scale=False,
                  shared="granite")
FAMILIES = {
    "deepseek_v3": _DEEPSEEK,
    "deepseek_v32": _DEEPSEEK,  # V3.2: V3's MoE layer (its change is the attention)
    "kimi_k2": _DEEPSEEK,
    "glm4_moe": _DEEPSEEK,
    "glm4_moe_lite": _DEEPSEEK,  # GLM-4.7-Flash: GLM-4.5's MoE layer (its change is MLA)
    "solar_open": _DEEPSEEK,  # Upstage Solar-Open: GLM-4.5's MoE layer
    # GLM-4.5V's language model: GLM-4.5's block; its layers under model.language_model.
    "glm4v_moe_text": Family("deepseek", "sigmoid_grouped", True, "dense_first"),
    "dots1": Family("deepseek", "sigmoid_grouped", False, "dense_first"),  # V3's MoE layer
    "minimax_m2": Family("minimax", "sigmoid_grouped", True, "all", reads_norm=False,
                         reads_scale=False, adjust=_no_shared),
    # V4: checkpoints in its own layout or transformers' names; its first layers hash-routed
    "deepseek_v4": Family("deepseek_v4", "sqrtsoftplus", True, "hash_first", reads_norm=False,
                          clamps=True),
    "deepseek_v2": Family("deepseek", "softmax", False, "dense_first", adjust=_deepseek_v2),
    "qwen3_moe": Family("qwen3_moe", "softmax", False, "sparse_step"),
    "qwen2_moe": Family("qwen2_moe", "softmax", False, "sparse_step", shared="gated"),
    "qwen3_next": Family("qwen2_moe", "softmax", True, "sparse_step", shared="gated"),
    # Qwen3.5: Qwen3-Next's MoE block, always renormalized; its release checkpoints hold the
    # experts fused as transformers 5 does (read as such: epmoe.namings.stored)
    "qwen3_5_moe_text": Family("qwen2_moe", "softmax", True, "all", reads_norm=False,
                               shared="gated"),
    "olmoe": Family("qwen3_moe", "softmax", False, "all"),
    "flex_olmo": Family("qwen3_moe", "softmax", False, "all"),  # experts intermediate_size wide
    # Qwen3-VL-MoE's language model: always renormalized (norm_topk_prob unread)
    "qwen3_vl_moe_text": Family("qwen3_vl", "softmax", True, "sparse_step", reads_norm=False),
    # Qwen3-Omni's thinker (thinker_config.text_config)
    "qwen3_omni_moe_text": Family("qwen3_omni", "softmax", True, "sparse_step"),
    "mixtral": Family("mixtral", "softmax", True, "all"),
    # MiniMax-Text-01 / M1: Mixtral's MoE block (softmax top-k, always renormalized)
    "minimax": Family("mixtral", "softmax", True, "all", reads_norm=False, reads_scale=False,
                      adjust=_no_shared),
    "gpt_oss": Family("gpt_oss", "softmax", True, "all", clamps=True,
                      fixed=(("activation", "swigluoai"), ("router_bias", True),
                             ("expert_bias", True))),
    # Llama 4: top-1 of the logits, the expert's input x sigmoid(logit), one shared expert
    "llama4_text": Family("llama4", "sigmoid_grouped", False, "interleave", reads_norm=False,
                          reads_scale=False, shared="one",
                          fixed=(("apply_router_weight_on_input", True),
                                 ("selection_bias", False))),
    # ERNIE 4.5: softmax scores selected on score + moe_statics' bias, always renormalized
    "ernie4_5_moe": Family("ernie", "softmax_biased", True, "ernie", reads_norm=False,
                           reads_scale=False, adjust=_ernie),
    # Granite 3.x / 4.0: softmax over the top-k logits (= softmax top-k, renormalized); the
    # shared MLP shared_intermediate_size wide, ungated; fused input_linear [E, 2I, D]
    "granitemoe": _GRANITE,
    "granitemoeshared": _GRANITE,
    "granitemoehybrid": Family("granite", "softmax", True, "all", reads_norm=False,
                               reads_scale=False, shared="granite", shared_default=1024,
                               adjust=_granite_hybrid),
    # HunYuan-A13B: softmax top-k, always renormalized; one shared MLP as wide as an expert
    "hunyuan_v1_moe": Family("hunyuan", "softmax", True, "all", reads_norm=False,
                             reads_scale=False, shared="one", width=("intermediate_size",),
                             adjust=_hunyuan),
    # DBRX: softmax top-k / its 1-norm (or not normalized); experts w1 / v1 / w2 [E*I, D]
    "dbrx": Family("dbrx", "softmax", True, "all", reads_norm=False, reads_scale=False,
                   adjust=_dbrx),
    # Kimi-Linear: DeepSeek-V3's MoE block under other field names (moe_renormalize, ...)
    "kimi_linear": Family("kimi", "sigmoid_grouped", True, "dense_first", reads_norm=False,
                          adjust=_kimi),
    # LFM2-8B-A1B: sigmoid + expert_bias, renormalized (+1e-6) if norm_topk_prob, x scale
    "lfm2_moe": Family("lfm2", "sigmoid_grouped", True, "dense_first", adjust=_lfm2),
    # AI21 Jamba: softmax top-k, never renormalized; every expert_layer_period-th layer from
    # expert_layer_offset is MoE, experts intermediate_size wide
    "jamba": Family("jamba", "softmax", False, "period", reads_norm=False, reads_scale=False),
    # inclusionAI's Ling / Ring (BailingMoe 1.x / 2.x): by score_function (see _bailing)
    "bailing_moe": Family("bailing", "softmax", True, "dense_first", adjust=_bailing),
    "bailing_moe_v2": Family("bailing", "softmax", True, "dense_first", adjust=_bailing),
    # Arcee AFMoE: sigmoid + expert_bias, top-k over all, always renormalized, x route_scale
    "afmoe": Family("afmoe", "sigmoid_grouped", True, "dense_first", reads_norm=False,
                    adjust=_afmoe),
}

# model_types whose MoE layer epmoe does not compute: the reason
REFUSED = {
    "phimoe": "its sparsemixer router (top-2 by masked softmaxes, not a top-k of one score)",
    "longcat_flash": "its zero-computation experts (a pick past the routed experts adds the "
                     "weighted input itself)",
    "jetmoe": "its mixture-of-attention-heads layers",
    "nemotron_h": "its experts (squared-ReLU MLPs without a gate: up and down only; epmoe's "
                  "experts compute SwiGLU)",
}
