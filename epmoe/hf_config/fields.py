"""Where each figure sits in a family's config.json: the field names, first present wins
(families and releases name them differently), and the nested configs holding them."""

from __future__ import annotations

from epmoe.docfile import is_int

HIDDEN = ("hidden_size", "d_model")  # DBRX: d_model
LAYER_COUNT = ("num_hidden_layers", "n_layers")
EXPERTS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_topk",
         "moe_k", "moe_top_k")
# per-expert width: moe_intermediate_size where a family also has dense layers, else the
# family's one intermediate size (Mixtral, Granite, HunYuan, FlexOlmo; DBRX's ffn_hidden_size)
EXPERT_WIDTH = ("moe_intermediate_size", "ffn_hidden_size", "intermediate_size")
SHARED_COUNT = ("n_shared_experts", "moe_num_shared_experts", "num_shared_experts")
SCALE = ("routed_scaling_factor", "route_scale")
# where a multimodal or composite config keeps its language model's figures
TEXT_CONFIGS = (("text_config",), ("thinker_config", "text_config"))

# counts and widths: an int where given (a per-layer list: ints); the layer steps >= 1 (the
# families' modelling code takes each modulo the layer index)
INT_FIELDS = (HIDDEN + LAYER_COUNT + EXPERTS + TOP_K + EXPERT_WIDTH + SHARED_COUNT +
              ("n_group", "topk_group", "vocab_size", "first_k_dense_replace", "num_dense_layers",
               "expert_layer_offset", "shared_expert_intermediate_size", "num_expert_group",
               "num_hash_layers", "shared_intermediate_size"))
STEP_FIELDS = ("moe_layer_freq", "expert_layer_period", "decoder_sparse_step",
               "moe_layer_interval", "interleave_moe_layer_step")
BOOL_FIELDS = ("norm_topk_prob",)
LAYER_LISTS = ("mlp_only_layers", "moe_layers")

_REQUIRED = object()


def check_fields(d: dict, where: str) -> None:
    """The fields epmoe reads hold what their names say, or an error naming the field: a count
    that is not an integer (256.5, "x", true) is refused here, not rounded or read as 1."""
    def whole(v):  # (an exporter may write 7168.0)
        return is_int(v) or isinstance(v, float) and v.is_integer()

    for key in INT_FIELDS + STEP_FIELDS:
        v = d.get(key)
        vals = v if isinstance(v, list) else [v]
        low = 1 if key in STEP_FIELDS else None
        if v is not None and any(not whole(x) or low is not None and x < low for x in vals):
            need = "an integer >= 1" if low else "an integer"
            raise ValueError(f"{where}: {key} ({v!r}) must be {need}")
    for key in BOOL_FIELDS:
        if d.get(key) is not None and not isinstance(d[key], bool):
            raise ValueError(f"{where}: {key} ({d[key]!r}) must be true or false")
    for key in LAYER_LISTS:
        v = d.get(key)
        if v is not None and (not isinstance(v, list) or not all(map(whole, v))):
            raise ValueError(f"{where}: {key} ({v!r}) must be a list of layer indices")


def get(d: dict, where: str, *names, default=_REQUIRED):
    """The first of `names` the config gives (a per-layer list: its one value); else the
    default, or an error naming them."""
    for n in names:
        if d.get(n) is not None:
            return one_value(d, where, n)
    if default is _REQUIRED:
        raise ValueError(f"{where}: the config has none of {', '.join(names)}")
    return default


def one_value(d: dict, where: str, key: str):
    """d[key], or the one value of a per-layer list (HunYuan's moe_topk); a list whose values
    differ is refused: epmoe's MoE layers share one shape. None if absent or empty."""
    v = d.get(key)
    if isinstance(v, list):
        if len(set(map(str, v))) > 1:
            raise ValueError(f"{where}: {key} differs between layers (values "
                             f"{', '.join(sorted(set(map(str, v))))}); epmoe's MoE layers "
                             f"share one shape")
        v = v[0] if v else None
    return v


def language_model(raw: dict) -> dict:
    """The config's MoE figures in one flat dict: a multimodal config's text config over its
    top level (Llama 4, Qwen3-VL, Qwen3-Omni's thinker), DBRX's ffn_config alongside."""
    d = raw
    if not any(k in raw for k in HIDDEN):
        for path in TEXT_CONFIGS:
            sub = raw
            for key in path:
                sub = sub.get(key) if isinstance(sub, dict) else None
            if isinstance(sub, dict):
                d = {**raw, **sub}
                break
    if isinstance(d.get("ffn_config"), dict):
        d = {**d, **d["ffn_config"]}
    return d
