"""Typed, validated configuration: the MoE architecture and the quantization recipe.

Every config is a frozen dataclass checked at construction; a bad value raises `ValueError`
naming the value, the rule and the fix. Model presets copy the numbers of each model's
published Hugging Face `config.json` (source cited beside each preset).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

# softmax: top-k of softmax(logits) (+ router_bias on the logits); the score routers select on
# score + a selection bias (e_score_correction_bias) and weight by the score: sigmoid_grouped
# (group-limited when n_group > 1), sqrtsoftplus, and softmax_biased (softmax scores: ERNIE 4.5)
RouterKind = Literal["softmax", "sigmoid_grouped", "sqrtsoftplus", "softmax_biased"]
ActivationKind = Literal["swiglu", "swigluoai"]
Recipe = Literal["bf16", "fp8_block", "mxfp8", "w4a8_mxfp4"]
ScaleFmt = Literal["fp32", "ue8m0_fp32", "ue8m0_packed"]

ROUTER_KINDS = ("softmax", "sigmoid_grouped", "sqrtsoftplus", "softmax_biased")
ACTIVATION_KINDS = ("swiglu", "swigluoai")
RECIPES = ("bf16", "fp8_block", "mxfp8", "w4a8_mxfp4")
SCALE_FMTS = ("fp32", "ue8m0_fp32", "ue8m0_packed")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's architecture (identical for every MoE layer of a model).

    hidden (D), moe_intermediate (I, per expert), num_experts (E, routed), top_k (K).
    """

    name: str
    hidden: int
    moe_intermediate: int
    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    router: RouterKind = "softmax"
    renormalize: bool = True  # norm_topk_prob
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    activation: ActivationKind = "swiglu"
    activation_alpha: float = 1.702  # swigluoai only
    swiglu_limit: float | None = None  # the routed experts' gate/up clamp (gpt-oss 7.0,
    #                                    DeepSeek-V4 10.0); None = no clamp; never the shared
    num_moe_layers: int = 1
    apply_router_weight_on_input: bool = False
    router_bias: bool = False  # softmax router: a learned bias added to the logits (gpt-oss)
    selection_bias: bool = True  # score routers: select on scores + a learned bias
    #                              (e_score_correction_bias); False: on the scores (Llama 4)
    expert_bias: bool = False  # expert MLPs: gate/up and down projection biases (gpt-oss)
    shared_gate: bool = False  # the shared MLP's output x sigmoid(x . w_g), w_g [D] learned
    #                            (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE)
    renorm_eps: float = 0.0  # renormalized weights / (their sum + renorm_eps) (LFM2-MoE: 1e-6)
    shared_intermediate_size: int = 0  # one shared MLP this wide, where the model's width is
    #                                    no multiple of moe_intermediate (Granite, Qwen2-MoE);
    #                                    0: num_shared_experts x moe_intermediate
    hash_layers: tuple[int, ...] = ()  # MoE layers (0-based) that pick experts by token id
    #                                    from a [vocab_size, top_k] table (DeepSeek-V4's first
    #                                    layers); their weights are the router's scores there
    vocab_size: int = 0  # the token ids hash layers take (0: no hash layers)

    def __post_init__(self) -> None:
        for f in ("hidden", "moe_intermediate", "num_experts", "top_k", "n_group", "topk_group",
                  "num_moe_layers"):
            v = getattr(self, f)
            _check(isinstance(v, int) and v >= 1, f"{f} ({v!r}) must be a positive int")
        _check(self.num_shared_experts >= 0,
               f"num_shared_experts ({self.num_shared_experts}) must be >= 0")
        _check(self.router in ROUTER_KINDS,
               f"router ({self.router!r}) must be one of {ROUTER_KINDS}")
        _check(self.activation in ACTIVATION_KINDS,
               f"activation ({self.activation!r}) must be one of {ACTIVATION_KINDS}")
        _check(self.top_k <= self.num_experts,
               f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts}): "
               f"a token cannot pick more experts than exist")
        _check(self.num_experts % self.n_group == 0,
               f"num_experts ({self.num_experts}) must be divisible by n_group ({self.n_group})")
        _check(self.topk_group <= self.n_group,
               f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        if self.n_group > 1:  # group-limited selection (softmax: DeepSeek-V2's greedy kind)
            per_group = self.num_experts // self.n_group
            _check(self.top_k <= self.topk_group * per_group,
                   f"top_k ({self.top_k}) must be <= topk_group*experts_per_group "
                   f"({self.topk_group}*{per_group}): the kept groups must hold top_k experts")
        _check(self.routed_scaling_factor > 0,
               f"routed_scaling_factor ({self.routed_scaling_factor}) must be > 0")
        _check(not self.apply_router_weight_on_input or self.top_k == 1,
               f"apply_router_weight_on_input needs top_k == 1 (got {self.top_k}): the expert "
               f"MLP is not linear, so per-slot input weights are ill-defined for top_k > 1")
        _check(self.swiglu_limit is None or self.swiglu_limit > 0,
               f"swiglu_limit ({self.swiglu_limit}) must be > 0 or None")
        _check(self.renorm_eps >= 0, f"renorm_eps ({self.renorm_eps}) must be >= 0")
        _check(self.shared_intermediate_size >= 0 and (
            not self.shared_intermediate_size or self.num_shared_experts == 1),
               f"shared_intermediate_size ({self.shared_intermediate_size}) is one shared MLP's "
               f"width: it needs num_shared_experts == 1 (got {self.num_shared_experts})")
        _check(not self.shared_gate or self.num_shared_experts >= 1,
               "shared_gate scales the shared experts' output: it needs num_shared_experts >= 1")
        _check(isinstance(self.hash_layers, tuple) and len(set(self.hash_layers)) ==
               len(self.hash_layers) and all(isinstance(h, int) and 0 <= h <
                                             self.num_moe_layers for h in self.hash_layers),
               f"hash_layers ({self.hash_layers!r}) must be a tuple of distinct MoE layer "
               f"indices below num_moe_layers ({self.num_moe_layers})")
        _check(not self.hash_layers or self.vocab_size >= 1,
               f"hash_layers route by token id: vocab_size ({self.vocab_size}) must be >= 1")
        _check(not self.hash_layers or self.n_group == 1,
               "hash layers take their experts from a table: n_group must be 1")
        _check(not self.router_bias or self.router == "softmax",
               f"router_bias applies to the softmax router; router {self.router!r} always "
               f"carries its selection bias (e_score_correction_bias)")

    @property
    def shared_intermediate(self) -> int:
        """The shared experts run as one MLP of width num_shared_experts * moe_intermediate
        (or shared_intermediate_size, where given)."""
        return self.shared_intermediate_size or self.num_shared_experts * self.moe_intermediate

    @property
    def shared_mlp_cfg(self) -> "MoEConfig":
        """The config the shared experts' MLP computes with: the routed experts' SwiGLU clamp
        (swiglu_limit) does not apply to it (DeepSeek-V4's shared expert is a plain SwiGLU
        MLP; gpt-oss, the other clamped model, has none)."""
        return self if self.swiglu_limit is None else self.replace(swiglu_limit=None)

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class QuantConfig:
    """A quantization recipe and the format its scales are stored in.

    - bf16: no quantization.
    - fp8_block: e4m3 activations per 1x128 token group (dynamic), weights per 128x128 block.
    - mxfp8: e4m3 activations and weights per 1x32 group with e8m0 (power-of-two) scales.
    - w4a8_mxfp4: weights e2m1 (two per byte) with e8m0 scales per 32; activations fp8 per 128.
    scale_fmt (fp8_block only): fp32, fp32 rounded up to a power of two (`ue8m0_fp32`), or
    UE8M0 exponents packed four per int32 (`ue8m0_packed`, what SM100 DeepGEMM reads).
    """

    recipe: Recipe = "bf16"
    scale_fmt: ScaleFmt = "fp32"

    def __post_init__(self) -> None:
        _check(self.recipe in RECIPES, f"recipe ({self.recipe!r}) must be one of {RECIPES}")
        _check(self.scale_fmt in SCALE_FMTS,
               f"scale_fmt ({self.scale_fmt!r}) must be one of {SCALE_FMTS}")
        _check(self.recipe == "fp8_block" or self.scale_fmt == "fp32",
               f"scale_fmt ({self.scale_fmt!r}) applies to fp8_block only; recipe "
               f"{self.recipe!r} has fixed scales: leave scale_fmt='fp32'")

    @property
    def act_group(self) -> int:
        """Columns per activation scale (0 = unquantized)."""
        return {"bf16": 0, "fp8_block": 128, "mxfp8": 32, "w4a8_mxfp4": 128}[self.recipe]

    @property
    def weight_group(self) -> tuple[int, int]:
        """(rows, cols) per weight scale ((0, 0) = unquantized)."""
        return {"bf16": (0, 0), "fp8_block": (128, 128), "mxfp8": (1, 32),
                "w4a8_mxfp4": (1, 32)}[self.recipe]

    def check_shapes(self, cfg: MoEConfig, moe_intermediate: int | None = None) -> None:
        """Raise if the layer's dims do not tile into this recipe's groups."""
        inter = cfg.moe_intermediate if moe_intermediate is None else moe_intermediate
        g = max(self.act_group, self.weight_group[1])
        if g == 0:
            return
        _check(cfg.hidden % g == 0,
               f"hidden ({cfg.hidden}) must be a multiple of {self.recipe}'s quant group ({g}); "
               f"pick recipe bf16 or a model whose hidden size is a multiple of {g}")
        _check(inter % g == 0,
               f"moe intermediate per partition ({inter}) must be a multiple of {self.recipe}'s "
               f"quant group ({g}); lower tp or pick recipe bf16")
        _check(cfg.shared_intermediate % g == 0,
               f"the shared MLP's width ({cfg.shared_intermediate}) must be a multiple of "
               f"{self.recipe}'s quant group ({g}); pick recipe bf16")
        rows = self.weight_group[0]
        if rows > 1:
            _check(cfg.hidden % rows == 0 and (2 * inter) % rows == 0,
                   f"weight rows (hidden {cfg.hidden}, 2*intermediate {2 * inter}) must be "
                   f"multiples of the {rows}-row weight block of {self.recipe}")


def default_scale_fmt(recipe: str, sm_arch: int) -> str:
    """The scale format a recipe is planned / calibrated with on a GPU of compute capability
    sm_arch x 10: UE8M0 for fp8_block on SM100 (DeepGEMM reads it there), else fp32."""
    return "ue8m0_fp32" if recipe == "fp8_block" and sm_arch >= 100 else "fp32"


# A planner's default recipe: the first of these whose quant groups tile the model's widths.
DEFAULT_RECIPES = ("fp8_block", "mxfp8", "bf16")


def fitting_recipe(cfg: MoEConfig) -> tuple[str, str | None]:
    """The first of DEFAULT_RECIPES whose groups tile cfg's widths, and why the first does not
    (None when it does)."""
    why = None
    for r in DEFAULT_RECIPES:
        try:
            QuantConfig(r).check_shapes(cfg)
            return r, why
        except ValueError as exc:
            why = why or f"{r} does not fit ({str(exc).split(';')[0]})"
    raise AssertionError("bf16 has no groups: it fits every model")


# --------------------------------------------------------------------------------------------
# Presets. Numbers from each model's config.json on the Hugging Face hub.

PRESETS: dict[str, MoEConfig] = {}


def _preset(cfg: MoEConfig) -> MoEConfig:
    PRESETS[cfg.name] = cfg
    return cfg


# deepseek-ai/DeepSeek-V3/config.json: hidden_size 7168, moe_intermediate_size 2048,
# n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, n_group 8, topk_group 4,
# routed_scaling_factor 2.5, norm_topk_prob true, scoring_func sigmoid, topk_method noaux_tc,
# num_hidden_layers 61, first_k_dense_replace 3 (-> 58 MoE layers).
_preset(MoEConfig("deepseek-v3", hidden=7168, moe_intermediate=2048, num_experts=256, top_k=8,
                  num_shared_experts=1, router="sigmoid_grouped", renormalize=True, n_group=8,
                  topk_group=4, routed_scaling_factor=2.5, num_moe_layers=58))
# moonshotai/Kimi-K2-Instruct/config.json: hidden_size 7168, moe_intermediate_size 2048,
# n_routed_experts 384, num_experts_per_tok 8, n_shared_experts 1, n_group 1, topk_group 1,
# routed_scaling_factor 2.827, norm_topk_prob true, scoring_func sigmoid,
# num_hidden_layers 61, first_k_dense_replace 1 (-> 60 MoE layers).
_preset(MoEConfig("kimi-k2", hidden=7168, moe_intermediate=2048, num_experts=384, top_k=8,
                  num_shared_experts=1, router="sigmoid_grouped", renormalize=True, n_group=1,
                  topk_group=1, routed_scaling_factor=2.827, num_moe_layers=60))
# Qwen/Qwen3-235B-A22B/config.json: hidden_size 4096, moe_intermediate_size 1536,
# num_experts 128, num_experts_per_tok 8, norm_topk_prob true, num_hidden_layers 94,
# decoder_sparse_step 1, mlp_only_layers [] (-> 94 MoE layers), no shared experts.
_preset(MoEConfig("qwen3-235b-a22b", hidden=4096, moe_intermediate=1536, num_experts=128,
                  top_k=8, router="softmax", renormalize=True, num_moe_layers=94))
# Qwen/Qwen3-30B-A3B/config.json: hidden_size 2048, moe_intermediate_size 768, num_experts 128,
# num_experts_per_tok 8, norm_topk_prob true, num_hidden_layers 48 (all MoE).
_preset(MoEConfig("qwen3-30b-a3b", hidden=2048, moe_intermediate=768, num_experts=128, top_k=8,
                  router="softmax", renormalize=True, num_moe_layers=48))
# mistralai/Mixtral-8x7B-v0.1/config.json: hidden_size 4096, intermediate_size 14336,
# num_local_experts 8, num_experts_per_tok 2, num_hidden_layers 32 (softmax over the top-2
# logits == renormalized softmax top-k).
_preset(MoEConfig("mixtral-8x7b", hidden=4096, moe_intermediate=14336, num_experts=8, top_k=2,
                  router="softmax", renormalize=True, num_moe_layers=32))
# openai/gpt-oss-120b/config.json: hidden_size 2880, intermediate_size 2880,
# num_local_experts 128, num_experts_per_tok 4, num_hidden_layers 36, swiglu_limit 7.0;
# activation alpha 1.702 (modeling code); router: softmax over the top-4 of logits x W^T + b;
# experts carry gate_up_proj_bias and down_proj_bias.
_preset(MoEConfig("gpt-oss-120b", hidden=2880, moe_intermediate=2880, num_experts=128, top_k=4,
                  router="softmax", renormalize=True, activation="swigluoai",
                  activation_alpha=1.702, swiglu_limit=7.0, num_moe_layers=36,
                  router_bias=True, expert_bias=True))
# openai/gpt-oss-20b/config.json: the same layer as 120b with num_local_experts 32 and
# num_hidden_layers 24.
_preset(PRESETS["gpt-oss-120b"].replace(name="gpt-oss-20b", num_experts=32, num_moe_layers=24))

# Scaled-down variants: the same architecture (router, grouping, activation), small dims, so the
# CPU demo and tests run in seconds. Dims stay multiples of 128 so every recipe applies.
_preset(MoEConfig("deepseek-v3-tiny", hidden=256, moe_intermediate=128, num_experts=16,
                  top_k=4, num_shared_experts=1, router="sigmoid_grouped", renormalize=True,
                  n_group=4, topk_group=2, routed_scaling_factor=2.5, num_moe_layers=2))
_preset(MoEConfig("kimi-k2-tiny", hidden=256, moe_intermediate=128, num_experts=24, top_k=4,
                  num_shared_experts=1, router="sigmoid_grouped", renormalize=True,
                  routed_scaling_factor=2.827, num_moe_layers=2))
_preset(MoEConfig("qwen3-moe-tiny", hidden=256, moe_intermediate=128, num_experts=16, top_k=4,
                  router="softmax", renormalize=True, num_moe_layers=2))
_preset(MoEConfig("mixtral-tiny", hidden=256, moe_intermediate=256, num_experts=8, top_k=2,
                  router="softmax", renormalize=True, num_moe_layers=2))
_preset(MoEConfig("gpt-oss-tiny", hidden=256, moe_intermediate=256, num_experts=16, top_k=4,
                  router="softmax", renormalize=True, activation="swigluoai",
                  activation_alpha=1.702, swiglu_limit=7.0, num_moe_layers=2,
                  router_bias=True, expert_bias=True))
_preset(MoEConfig("deepseek-v4-tiny", hidden=256, moe_intermediate=128, num_experts=16,
                  top_k=4, num_shared_experts=1, router="sqrtsoftplus", renormalize=True,
                  routed_scaling_factor=1.5, num_moe_layers=2))

DEFAULT_PRESET = "deepseek-v3-tiny"


def get_preset(name: str) -> MoEConfig:
    """A preset by name, or the MoE layers of a Hugging Face config.json (the file, or the
    checkpoint folder holding it: epmoe.hf_config)."""
    if name in PRESETS:
        return PRESETS[name]
    if os.path.exists(name):
        from epmoe.hf_config import read_hf_config

        return read_hf_config(name).cfg
    if os.sep in name or name.endswith(".json"):  # meant as a path
        raise ValueError(f"model {name!r}: no such file or folder (a Hugging Face config.json, "
                         f"or the checkpoint folder holding it; presets: "
                         f"{', '.join(sorted(PRESETS))})")
    raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}, "
                     f"or give a Hugging Face config.json (or the folder holding it)")
