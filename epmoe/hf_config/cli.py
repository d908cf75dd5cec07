"""`python -m epmoe.hf_config PATH [--json]`: what epmoe reads from a config.json."""

from __future__ import annotations

import json

from epmoe.hf_config import HFModel, read_hf_config


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
    shared = "none" if not c.num_shared_experts else (
        f"one MLP {c.shared_intermediate_size} wide" if c.shared_intermediate_size else
        f"{c.num_shared_experts} x {c.moe_intermediate} wide") + (", gated" if c.shared_gate
                                                                 else "")
    route = {"softmax": "softmax", "sigmoid_grouped": "sigmoid",
             "sqrtsoftplus": "sqrt(softplus)", "softmax_biased": "softmax scores"}[c.router]
    if c.router != "softmax":
        route += " + selection bias" if c.selection_bias else ""
    elif c.router_bias:
        route += " of logits + bias"
    route += f", {c.topk_group} of {c.n_group} groups" if c.n_group > 1 else ""
    route += (f", renormalized (sum + {c.renorm_eps:g})" if c.renormalize and c.renorm_eps
              else ", renormalized" if c.renormalize else "") + \
        (f", x {c.routed_scaling_factor:g}" if c.routed_scaling_factor != 1 else "")
    act = c.activation + (f", clamp {c.swiglu_limit:g}" if c.swiglu_limit else "") + \
        (", expert biases" if c.expert_bias else "") + \
        (", input x weight" if c.apply_router_weight_on_input else "")
    ckpt = "not read (--weights refuses it)" if hf.naming is None else \
        f"naming {hf.naming}, experts stored " \
        f"{hf.stored_recipe or 'in a format not decoded here'}"
    hashed = [hf.moe_layers[h] for h in c.hash_layers]
    layers = f"{len(hf.moe_layers)}: checkpoint layers {_spans(hf.moe_layers)}" + (
        f"; {_spans(tuple(hashed))} by token id" if hashed else "")
    return [("model_type", hf.model_type), ("MoE layers", layers),
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
