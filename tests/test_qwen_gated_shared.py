"""Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE: a shared expert whose output is gated per token.

Their modeling code (Qwen2MoeSparseMoeBlock, which Qwen3-Next and Qwen3.5 reuse): one SwiGLU MLP
of shared_expert_intermediate_size, its output x sigmoid(x . shared_expert_gate), added to the
routed experts' sum (softmax top-k, renormalized if norm_topk_prob). Checked here: the configs
as published read to that layer, the oracle computes it as written there, the checkpoint's gate
is what the ranks hold, and launches (one rank, and two ranks splitting the shared MLP) pass."""

from __future__ import annotations

import json

import pytest
import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.hf_config import parse_hf_config, read_hf_config
from epmoe.reference import Oracle, reference_moe
from tests.launch_util import launch_in_process

# Qwen/Qwen3-Next-80B-A3B-Instruct, Qwen/Qwen2-57B-A14B, Qwen/Qwen1.5-MoE-A2.7B: config.json
# (MoE fields as released)
NEXT = dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], hidden_size=2048,
            intermediate_size=5120, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            num_hidden_layers=48, hidden_act="silu", full_attention_interval=4)
QWEN2_57B = dict(model_type="qwen2_moe", hidden_size=3584, intermediate_size=18944,
                 moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
                 num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                 decoder_sparse_step=1, num_hidden_layers=28, hidden_act="silu")
QWEN15_A27B = dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632,
                   moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                   num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                   decoder_sparse_step=1, num_hidden_layers=24, hidden_act="silu")
# transformers' Qwen3_5MoeTextConfig defaults (Qwen/Qwen3.5-35B-A3B), inside its VL wrapper
QWEN35 = dict(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"],
              text_config=dict(model_type="qwen3_5_moe_text", hidden_size=2048,
                               num_hidden_layers=40, num_experts=256, num_experts_per_tok=8,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512),
              vision_config=dict(depth=27, hidden_size=1152))
TINY = dict(NEXT, hidden_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=256,
            num_experts=16, num_experts_per_tok=4, num_hidden_layers=2)


@pytest.mark.parametrize("raw,want", [
    (NEXT, (2048, 512, 512, 10, 1, True, tuple(range(48)), "qwen2_moe")),
    (QWEN2_57B, (3584, 2560, 64, 8, 8, False, tuple(range(28)), "qwen2_moe")),
    (QWEN15_A27B, (2048, 1408, 60, 4, 4, False, tuple(range(24)), "qwen2_moe")),
    (QWEN35, (2048, 512, 256, 8, 1, True, tuple(range(40)), "qwen2_moe")),
])
def test_published_configs_read_to_a_gated_shared_expert(raw, want):
    hf = parse_hf_config(raw, "q")
    c = hf.cfg
    assert (c.hidden, c.moe_intermediate, c.num_experts, c.top_k, c.num_shared_experts,
            c.renormalize, hf.moe_layers, hf.naming) == want
    assert c.shared_gate and c.router == "softmax" and c.routed_scaling_factor == 1.0
    assert c.shared_intermediate == raw.get("shared_expert_intermediate_size",
                                            raw.get("text_config", {}).get(
                                                "shared_expert_intermediate_size"))
    # a width that is no multiple of an expert's: one MLP of that width, which fp8's 128-wide
    # groups do not tile (bf16 runs it)
    odd = parse_hf_config(dict(NEXT, shared_expert_intermediate_size=700), "q").cfg
    assert (odd.num_shared_experts, odd.shared_intermediate, odd.shared_gate) == (1, 700, True)
    with pytest.raises(ValueError, match=r"shared MLP's width \(700\) must be a multiple"):
        QuantConfig("fp8_block").check_shapes(odd)
    QuantConfig("bf16").check_shapes(odd)


def test_the_oracle_gates_the_shared_output_as_the_modeling_code():
    cfg = MoEConfig("g", hidden=64, moe_intermediate=32, num_experts=4, top_k=2,
                    num_shared_experts=2, shared_gate=True)
    g = torch.Generator().manual_seed(2)
    d, s = cfg.hidden, cfg.shared_intermediate
    w13, w2 = torch.randn(2 * s, d, generator=g).double(), torch.randn(d, s, generator=g).double()
    sg = torch.randn(d, generator=g).double()
    x = torch.randn(5, d, generator=g)
    oracle = Oracle(torch.randn(4, d, generator=g).double(), None,
                    torch.randn(4, 64, d, generator=g).double(),
                    torch.randn(4, d, 32, generator=g).double(), (w13, w2), shared_gate=sg)
    none = torch.full((5, 2), -1)
    got = reference_moe(x, oracle, cfg, QuantConfig("bf16"), none, torch.zeros(5, 2),
                        fake_quant=False)
    ungated = reference_moe(x, oracle._replace(shared_gate=None), cfg, QuantConfig("bf16"),
                            none, torch.zeros(5, 2), fake_quant=False)
    for n in range(5):
        h = w13 @ x[n].double()
        mlp = w2 @ (torch.nn.functional.silu(h[:s]) * h[s:])
        torch.testing.assert_close(got[n], torch.sigmoid(x[n].double() @ sg) * mlp,
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ungated[n], mlp, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, ungated)
    with pytest.raises(ValueError, match="shared_gate scales the shared experts' output"):
        cfg.replace(num_shared_experts=0)


def _tiny_checkpoint(folder):
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    g = torch.Generator().manual_seed(6)
    d, i, s, t = 256, 128, 256, {}
    for cl in (0, 1):
        pre = f"model.layers.{cl}.mlp."
        t[pre + "gate.weight"] = torch.randn(16, d, generator=g) * d ** -0.5
        t[pre + "shared_expert_gate.weight"] = torch.randn(1, d, generator=g) * d ** -0.5
        for e, (sub, width) in enumerate([(f"experts.{e}.", i) for e in range(16)]
                                         + [("shared_expert.", s)]):
            for n, shape in (("gate_proj", (width, d)), ("up_proj", (width, d)),
                             ("down_proj", (d, width))):
                scale = shape[1] ** -0.5
                t[f"{pre}{sub}{n}.weight"] = (torch.randn(*shape, generator=g) * scale).bfloat16()
    save_file(t, str(folder / "model.safetensors"))
    return t


def test_the_checkpoints_gate_is_what_the_ranks_hold(tmp_path):
    from epmoe.checkpoint import load_layer

    folder = tmp_path / "Tiny-Qwen3-Next"
    t = _tiny_checkpoint(folder)
    cfg = read_hf_config(str(folder)).cfg
    lw = load_layer(str(folder), None, cfg, QuantConfig("bf16"), 1, [3])
    assert torch.equal(lw.shared_gate_D, t["model.layers.1.mlp.shared_expert_gate.weight"][0])
    want = torch.cat([t[f"model.layers.1.mlp.shared_expert.{n}_proj.weight"]
                      for n in ("gate", "up")])
    assert torch.equal(lw.shared.w13.data[0], want)
    half = load_layer(str(folder), None, cfg, QuantConfig("bf16"), 1, [3], shared_slice=(128, 128))
    assert torch.equal(half.shared_gate_D, lw.shared_gate_D)  # a TP share holds the whole gate
    no = load_layer(str(folder), None, cfg, QuantConfig("bf16"), 1, [3], with_shared=False)
    assert no.shared is None and no.shared_gate_D is None
    with pytest.raises(ValueError, match="naming stores no shared_expert_gate"):
        load_layer(str(folder), "deepseek", cfg, QuantConfig("bf16"), 1, [3], ckpt_layer=1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [[], ["--ep", "2", "--no-dp"]], ids=["one-rank", "ep2-split"])
def test_launches_with_the_gated_shared_expert_pass_the_oracle(tmp_path, extra):
    """Synthetic weights and the checkpoint's; two ranks split the shared MLP (form ep)."""
    folder = tmp_path / "Tiny-Qwen3-Next"
    _tiny_checkpoint(folder)
    for src in (["--model", str(folder)], ["--weights", str(folder)]):
        rc, s = launch_in_process(tmp_path, src, *extra)
        assert rc == 0 and s["correctness"]["passed"] is True, (src, s["correctness"])
