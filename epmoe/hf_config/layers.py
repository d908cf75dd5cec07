"""Which of a checkpoint's layers are MoE layers, from the fields each family uses."""

from __future__ import annotations

from epmoe.hf_config.families import Family
from epmoe.hf_config.fields import LAYER_COUNT, get


def moe_layers(d: dict, fam: Family, at: str) -> tuple[int, ...]:
    n = int(get(d, at, *LAYER_COUNT))
    if fam.layers == "dense_first":
        first = int(d.get("first_k_dense_replace") or d.get("num_dense_layers") or 0)
        freq = int(d.get("moe_layer_freq") or 1)
        layers = [i for i in range(n) if i >= first and i % freq == 0]
    elif fam.layers == "period":  # Jamba: every period-th layer from the offset
        period = int(d.get("expert_layer_period") or 1)
        offset = int(d.get("expert_layer_offset") or 0)
        layers = [i for i in range(n) if i % period == offset]
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
    elif fam.layers == "hash_first":  # DeepSeek-V4: every layer, its first ones hash-routed
        _v4_types(d, n, at)  # (checked here: hash_layers reads them)
        layers = list(range(n))
    else:
        layers = list(range(n))
    if not layers:
        raise ValueError(f"{at}: none of its {n} layers is a MoE layer")
    return tuple(layers)


def hash_layers(d: dict, fam: Family, at: str) -> tuple[int, ...]:
    """The checkpoint layers that pick their experts by token id (DeepSeek-V4's "hash_moe"
    layers: mlp_layer_types, else the first num_hash_layers)."""
    if fam.layers != "hash_first":
        return ()
    types = _v4_types(d, int(get(d, at, *LAYER_COUNT)), at)
    return tuple(i for i, t in enumerate(types) if t == "hash_moe")


def _v4_types(d: dict, n: int, at: str) -> list[str]:
    types = d.get("mlp_layer_types")
    if types is None:
        hashed = min(int(d.get("num_hash_layers", 3)), n)
        types = ["hash_moe"] * hashed + ["moe"] * (n - hashed)
    if len(types) != n or set(types) - {"moe", "hash_moe"}:
        raise ValueError(f"{at}: mlp_layer_types must give moe or hash_moe for each of its "
                         f"{n} layers")
    return list(types)
