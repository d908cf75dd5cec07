"""ERNIE 4.5's MoE layer from its config.json, and the `softmax_biased` router it needs.

Its modeling code (transformers' Ernie4_5_MoeSparseMoeBlock): softmax over the router logits
(fp32), the top-k of softmax + moe_statics.e_score_correction_bias, the chosen experts'
unbiased softmax over their sum (clamped at moe_norm_min), no scale; moe_num_shared_experts
experts as one ungated MLP; MoE layers every moe_layer_interval-th from moe_layer_start_index
to moe_layer_end_index (-1: the last). Here: the config read, the router against that code
re-written, a checkpoint's [1, E] bias, launches against the oracle."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.hf_config import describe, parse_hf_config, read_hf_config
from epmoe.reference import reference_route
from epmoe.router import route
from tests.launch_util import config_folder, launch_in_process

# transformers' Ernie4_5_MoeConfig defaults ("ERNIE-4.5-21B-A3B style"), as a config.json
ERNIE_21B = dict(model_type="ernie4_5_moe", architectures=["Ernie4_5_MoeForCausalLM"],
                 hidden_size=2560, intermediate_size=12288, num_hidden_layers=28,
                 num_attention_heads=20, num_key_value_heads=4, hidden_act="silu",
                 use_bias=False, moe_intermediate_size=1536, moe_k=6, moe_num_experts=64,
                 moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=-1,
                 moe_layer_interval=1, moe_norm_min=1e-12, vocab_size=103424)
TINY = dict(ERNIE_21B, hidden_size=256, moe_intermediate_size=128, moe_num_experts=16,
            moe_k=4, num_hidden_layers=3)


def _ernie_gate(logits, bias, k):
    p = torch.softmax(logits.double(), dim=1)
    ids = torch.topk(p + bias.double(), k, dim=-1).indices
    w = p.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True).clamp(min=1e-12)


def test_ernie_reads_to_its_moe_layer_and_routes_as_its_modeling_code():
    hf = parse_hf_config(ERNIE_21B, "ernie")
    c = hf.cfg
    assert (c.hidden, c.moe_intermediate, c.num_experts, c.top_k, c.num_shared_experts) == \
        (2560, 1536, 64, 6, 2)
    assert (c.router, c.renormalize, c.routed_scaling_factor, c.selection_bias) == \
        ("softmax_biased", True, 1.0, True)
    assert hf.moe_layers == tuple(range(1, 28)) and hf.naming == "ernie"
    assert dict(describe(hf))["router"] == "softmax scores + selection bias, renormalized"
    g = torch.Generator().manual_seed(12)
    logits, bias = torch.randn(64, 64, generator=g) * 2, torch.randn(64, generator=g) * 0.02
    want_ids, want_w = _ernie_gate(logits, bias, 6)
    ids, w = reference_route(logits, c, bias)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-12, atol=0)
    r = route(logits, c, bias, id_dtype=torch.int64, backend="torch")  # the runtime's path
    assert torch.equal(r.topk_ids_TK.sort(-1).values, want_ids.sort(-1).values)
    odd = parse_hf_config(dict(ERNIE_21B, moe_layer_start_index=3, moe_layer_end_index=20,
                               moe_layer_interval=2), "e")
    assert odd.moe_layers == tuple(range(3, 21, 2))
    with pytest.raises(ValueError, match="use_bias: its expert MLPs carry linear biases"):
        parse_hf_config(dict(ERNIE_21B, use_bias=True), "e")
    with pytest.raises(ValueError, match="per modality"):
        parse_hf_config(dict(ERNIE_21B, moe_layer_start_index=[1, 1]), "e")


def _checkpoint(folder):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(13)
    d, i, t = 256, 128, {}
    for cl in (1, 2):
        pre = f"model.layers.{cl}.mlp."
        t[pre + "gate.weight"] = torch.randn(16, d, generator=g) * d ** -0.5
        t[pre + "moe_statics.e_score_correction_bias"] = torch.randn(1, 16, generator=g) * 0.01
        for sub, width in [(f"experts.{e}.", i) for e in range(16)] + [("shared_experts.", 2 * i)]:
            for n, shape in (("gate_proj", (width, d)), ("up_proj", (width, d)),
                             ("down_proj", (d, width))):
                t[f"{pre}{sub}{n}.weight"] = (torch.randn(*shape, generator=g)
                                              * shape[1] ** -0.5).bfloat16()
    save_file(t, str(folder / "model.safetensors"))
    return t


def test_a_checkpoints_bias_and_a_launch(tmp_path):
    from epmoe.checkpoint import load_layer

    folder = config_folder(tmp_path, "Tiny-ERNIE", TINY)
    t = _checkpoint(folder)
    cfg = read_hf_config(str(folder)).cfg
    lw = load_layer(str(folder), None, cfg, QuantConfig("bf16"), 1, [9])
    assert torch.equal(lw.bias_E, t["model.layers.2.mlp.moe_statics.e_score_correction_bias"][0])
    assert lw.shared.w13.data.shape == (1, 512, 256)
    for src in (["--model", str(folder)], ["--weights", str(folder)]):
        rc, s = launch_in_process(tmp_path, src)
        assert rc == 0 and s["correctness"]["passed"] is True, (src, s["correctness"])
        assert len(s["correctness"]["per_layer"]) == 2
