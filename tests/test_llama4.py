"""Llama 4's MoE layer from its config.json (Scout, Maverick).

Its modeling code (transformers' Llama4TextMoe): router logits; the top-1 expert by logit;
the token scaled by sigmoid(that logit) is the expert's input (no weight on its output; every
other expert sees a zero input, whose SwiGLU output is zero); plus one shared expert of the
experts' intermediate size, ungated. MoE layers: `moe_layers`, else every
interleave_moe_layer_step-th layer. Here: the configs as published, the oracle against that
forward re-written literally, and a launch."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.hf_config import parse_hf_config
from epmoe.reference import Oracle, reference_moe
from epmoe.weights import synthetic_router
from tests.launch_util import config_folder, launch_in_process

# meta-llama/Llama-4-Scout-17B-16E and Llama-4-Maverick-17B-128E: config.json text_config
# (MoE fields as released) inside the multimodal wrapper
SCOUT_TEXT = dict(model_type="llama4_text", hidden_size=5120, intermediate_size=8192,
                  intermediate_size_mlp=16384, num_local_experts=16, num_experts_per_tok=1,
                  interleave_moe_layer_step=1, num_hidden_layers=48, hidden_act="silu",
                  num_attention_heads=40, num_key_value_heads=8, vocab_size=202048)
SCOUT = dict(model_type="llama4", architectures=["Llama4ForConditionalGeneration"],
             text_config=SCOUT_TEXT, vision_config=dict(model_type="llama4_vision_model"))
MAVERICK = dict(SCOUT, text_config=dict(SCOUT_TEXT, num_local_experts=128,
                                        interleave_moe_layer_step=2))


def test_scout_and_maverick_read_to_their_moe_layers():
    for raw, experts, layers in ((SCOUT, 16, tuple(range(48))),
                                 (MAVERICK, 128, tuple(range(1, 48, 2)))):
        hf = parse_hf_config(raw, "llama4")
        c = hf.cfg
        assert (c.hidden, c.moe_intermediate, c.num_experts, c.top_k, c.num_shared_experts) == \
            (5120, 8192, experts, 1, 1)
        assert c.apply_router_weight_on_input and not c.selection_bias and not c.shared_gate
        assert (c.router, c.renormalize, c.routed_scaling_factor) == ("sigmoid_grouped", False,
                                                                       1.0)
        assert hf.moe_layers == layers and hf.naming == "llama4"
    assert synthetic_router(parse_hf_config(SCOUT, "s").cfg, 0, 0)[1] is None
    given = parse_hf_config(dict(SCOUT, text_config=dict(SCOUT_TEXT, moe_layers=[3, 7])), "s")
    assert given.moe_layers == (3, 7)
    with pytest.raises(ValueError, match="apply_router_weight_on_input needs top_k == 1"):
        parse_hf_config(dict(SCOUT, text_config=dict(SCOUT_TEXT, num_experts_per_tok=2)), "s")


def _llama4_moe(x, gate, w13, w2, shared):
    """Llama4TextMoe.forward for [T, D] float64, as written there: every expert runs on every
    token, its input scaled by sigmoid of the scattered top-1 logit (-inf elsewhere)."""
    def mlp(h_in, a, b):
        i = a.shape[0] // 2
        h = h_in @ a.T
        return (torch.nn.functional.silu(h[:, :i]) * h[:, i:]) @ b.T

    logits = x @ gate.T
    top_v, top_i = torch.topk(logits, 1, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, top_i, top_v)
    scores = torch.sigmoid(scores)
    out = mlp(x, *shared)
    for e in range(gate.shape[0]):
        out = out + mlp(x * scores[:, e:e + 1], w13[e], w2[e])
    return out


def test_the_oracle_is_llama4s_forward():
    cfg = parse_hf_config(dict(SCOUT, text_config=dict(SCOUT_TEXT, hidden_size=64,
                                                        intermediate_size=32)), "s").cfg
    g = torch.Generator().manual_seed(8)
    e, d, i = cfg.num_experts, cfg.hidden, cfg.moe_intermediate

    def rnd(*shape):
        return torch.randn(*shape, generator=g).double() * shape[-1] ** -0.5
    gate, w13, w2 = rnd(e, d) * 4, rnd(e, 2 * i, d), rnd(e, d, i)
    shared = (rnd(2 * i, d), rnd(d, i))
    x = torch.randn(12, d, generator=g)
    got = reference_moe(x, Oracle(gate, None, w13, w2, shared), cfg, QuantConfig("bf16"),
                        fake_quant=False)
    want = _llama4_moe(x.double(), gate, w13, w2, shared)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(240)
def test_a_llama4_config_launches_against_the_oracle(tmp_path):
    folder = config_folder(tmp_path, "Tiny-Llama-4", dict(MAVERICK, text_config=dict(
        MAVERICK["text_config"], hidden_size=256, intermediate_size=128, num_local_experts=16,
        num_hidden_layers=4)))
    rc, s = launch_in_process(tmp_path, ["--model", str(folder)])
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]
    assert len(s["correctness"]["per_layer"]) == 2  # layers 1 and 3 of 4


def test_moe_layers_outside_the_model_are_refused():
    bad = dict(SCOUT, text_config=dict(SCOUT_TEXT, moe_layers=[1, 48]))
    with pytest.raises(ValueError, match=r"moe_layers \[1, 48\] name layers outside its 48"):
        parse_hf_config(bad, "s")
