"""`--model path/to/config.json`: a model's MoE layers read from its Hugging Face config.

The anchors are published config.json figures (the fields as released, irrelevant ones
included): each preset's config must read back to the preset, whose numbers config.py cites
from the same files. Families without a preset are checked field by field, and those whose
router semantics differ from the field names against their gates re-written from the modeling
code (MiniMax-M2 here, DeepSeek-V2 in test_hf_deepseek_v2.py)."""

from __future__ import annotations

import json

import pytest
import torch

from epmoe.config import PRESETS, QuantConfig, get_preset
from epmoe.hf_config import parse_hf_config, read_hf_config
from epmoe.reference import reference_route
from tests.launch_util import config_folder, launch_in_process

FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}
# deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct, Qwen/Qwen3-235B-A22B, Qwen3-30B-A3B,
# mistralai/Mixtral-8x7B-v0.1, openai/gpt-oss-120b and -20b: config.json (MoE fields + a few
# others as they appear there)
PUBLISHED = {
    "deepseek-v3": dict(
        model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
        num_hidden_layers=61, first_k_dense_replace=3, moe_layer_freq=1, hidden_act="silu",
        vocab_size=129280, num_nextn_predict_layers=1, quantization_config=FP8_BLOCK),
    "kimi-k2": dict(
        model_type="kimi_k2", hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, n_routed_experts=384, num_experts_per_tok=8,
        n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
        num_hidden_layers=61, first_k_dense_replace=1, moe_layer_freq=1, hidden_act="silu",
        quantization_config=FP8_BLOCK),
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288,
        moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, num_hidden_layers=94, decoder_sparse_step=1, mlp_only_layers=[],
        hidden_act="silu", router_aux_loss_coef=0.001),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        num_hidden_layers=48, decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu"),
    "mixtral-8x7b": dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8,
        num_experts_per_tok=2, num_hidden_layers=32, hidden_act="silu"),
    "gpt-oss-120b": dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=128,
        num_experts_per_tok=4, experts_per_token=4, num_hidden_layers=36, swiglu_limit=7.0,
        hidden_act="silu", quantization_config={"quant_method": "mxfp4"}),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=32,
        num_experts_per_tok=4, experts_per_token=4, num_hidden_layers=24, swiglu_limit=7.0,
        hidden_act="silu", quantization_config={"quant_method": "mxfp4"}),
}
STORED = {"deepseek-v3": "fp8_block", "kimi-k2": "fp8_block", "gpt-oss-120b": "w4a8_mxfp4",
          "gpt-oss-20b": "w4a8_mxfp4"}
NAMING = {"deepseek_v3": "deepseek", "kimi_k2": "deepseek", "qwen3_moe": "qwen3_moe",
          "mixtral": "mixtral", "gpt_oss": "gpt_oss"}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_a_published_config_reads_back_to_its_preset(preset, tmp_path):
    folder = tmp_path / preset
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PUBLISHED[preset]))
    hf = read_hf_config(str(folder))
    assert hf.cfg == PRESETS[preset].replace(name=preset)  # the folder names the model
    assert hf.naming == NAMING[PUBLISHED[preset]["model_type"]]
    assert hf.stored_recipe == STORED.get(preset, "bf16")
    assert len(hf.moe_layers) == hf.cfg.num_moe_layers
    assert get_preset(str(folder / "config.json")) == hf.cfg  # the file or its folder


def test_moe_layers_follow_each_familys_rule():
    v3 = parse_hf_config(PUBLISHED["deepseek-v3"], "v3")
    assert v3.moe_layers == tuple(range(3, 61))
    every_other = dict(PUBLISHED["deepseek-v3"], first_k_dense_replace=1, moe_layer_freq=2)
    assert parse_hf_config(every_other, "x").moe_layers == tuple(range(2, 61, 2))
    qwen = dict(PUBLISHED["qwen3-30b-a3b"], num_hidden_layers=8, decoder_sparse_step=2,
                mlp_only_layers=[3])
    assert parse_hf_config(qwen, "q").moe_layers == (1, 5, 7)  # (i + 1) % 2 == 0, not 3
    assert parse_hf_config(PUBLISHED["mixtral-8x7b"], "m").moe_layers == tuple(range(32))


def test_glm_olmoe_and_a_multimodal_wrapper():
    # zai-org/GLM-4.5/config.json (MoE fields)
    glm = parse_hf_config(dict(
        model_type="glm4_moe", hidden_size=5120, intermediate_size=12288,
        moe_intermediate_size=1536, n_routed_experts=160, num_experts_per_tok=8,
        n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_hidden_layers=92, first_k_dense_replace=3,
        hidden_act="silu"), "glm-4.5")
    c = glm.cfg
    assert (c.hidden, c.moe_intermediate, c.num_experts, c.top_k, c.num_shared_experts) == \
        (5120, 1536, 160, 8, 1)
    assert (c.router, c.renormalize, c.routed_scaling_factor, c.num_moe_layers) == \
        ("sigmoid_grouped", True, 2.5, 89)
    assert glm.naming == "deepseek" and glm.moe_layers[0] == 3
    # allenai/OLMoE-1B-7B-0924/config.json
    olmoe = parse_hf_config(dict(
        model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_experts=64,
        num_experts_per_tok=8, norm_topk_prob=False, num_hidden_layers=16,
        hidden_act="silu"), "olmoe").cfg
    assert (olmoe.moe_intermediate, olmoe.num_experts, olmoe.router, olmoe.renormalize) == \
        (1024, 64, "softmax", False)
    v32 = dict(PUBLISHED["deepseek-v3"], model_type="deepseek_v32", index_topk=2048)
    assert parse_hf_config(v32, "v").cfg == parse_hf_config(PUBLISHED["deepseek-v3"], "v").cfg
    wrapped = {"model_type": "kimi_vl", "vision_config": {"hidden_size": 1152},
               "text_config": PUBLISHED["deepseek-v3"]}
    assert parse_hf_config(wrapped, "v").cfg == parse_hf_config(PUBLISHED["deepseek-v3"],
                                                                "v").cfg
    # zai-org/GLM-4.5V: the language model is GLM-4.5-Air's MoE layer under its own type
    glm_v = parse_hf_config({"model_type": "glm4v_moe", "vision_config": {"depth": 24},
                             "text_config": dict(
                                 model_type="glm4v_moe_text", hidden_size=4096,
                                 intermediate_size=10944, moe_intermediate_size=1408,
                                 n_routed_experts=128, num_experts_per_tok=8,
                                 n_shared_experts=1, routed_scaling_factor=1.0,
                                 norm_topk_prob=True, num_hidden_layers=46,
                                 first_k_dense_replace=1)}, "glm-4.5v")
    c = glm_v.cfg
    assert (c.hidden, c.moe_intermediate, c.num_experts, c.top_k, c.router, c.renormalize) == \
        (4096, 1408, 128, 8, "sigmoid_grouped", True)
    assert glm_v.moe_layers == tuple(range(1, 46)) and glm_v.naming == "deepseek"


# MiniMaxAI/MiniMax-M2 and rednote-hilab/dots.llm1.inst: config.json (MoE fields as released)
MINIMAX_M2 = dict(architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2",
                  hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
                  num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                  num_local_experts=256, num_experts_per_tok=8, shared_intermediate_size=0,
                  scoring_func="sigmoid", use_routing_bias=True, use_mtp=True,
                  num_mtp_modules=3, rotary_dim=64, hidden_act="silu",
                  quantization_config=FP8_BLOCK)
DOTS1 = dict(model_type="dots1", hidden_size=4096, num_hidden_layers=62,
             intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128,
             n_shared_experts=2, num_experts_per_tok=6, norm_topk_prob=True,
             routed_scaling_factor=2.5, first_k_dense_replace=1, n_group=None, topk_group=None,
             scoring_func="sigmoid", hidden_act="silu")


def _minimax_m2_gate(logits, bias, k):
    """MiniMax-M2's router as its modeling code defines it: sigmoid scores; the top-k of
    scores + e_score_correction_bias; the chosen experts' unbiased scores over their sum."""
    s = torch.sigmoid(logits.double())
    ids = torch.topk(s + bias.double(), k, dim=-1).indices
    w = s.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("extra", [{}, dict(norm_topk_prob=False, routed_scaling_factor=2.5)])
def test_minimax_m2_routes_as_its_modeling_code(extra):
    """Its modeling code renormalizes and never scales: fields saying otherwise are unread."""
    hf = parse_hf_config(dict(MINIMAX_M2, **extra), "m2")
    c = hf.cfg
    assert (c.hidden, c.moe_intermediate, c.num_experts, c.top_k, c.num_shared_experts) == \
        (3072, 1536, 256, 8, 0)
    assert (c.router, c.n_group, c.topk_group, c.renormalize, c.routed_scaling_factor) == \
        ("sigmoid_grouped", 1, 1, True, 1.0)
    assert hf.naming == "minimax" and hf.moe_layers == tuple(range(62))
    assert hf.stored_recipe == "fp8_block" and c.num_moe_layers == 62
    g = torch.Generator().manual_seed(11)
    logits, bias = torch.randn(48, 256, generator=g), torch.randn(256, generator=g)
    ids, w = reference_route(logits, c, bias)
    want_ids, want_w = _minimax_m2_gate(logits, bias, 8)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="shared_intermediate_size 1024: its modeling code"):
        parse_hf_config(dict(MINIMAX_M2, shared_intermediate_size=1024), "m2")


def test_dots1_is_deepseek_v3s_moe_layer():
    hf = parse_hf_config(DOTS1, "dots")
    c = hf.cfg
    assert (c.hidden, c.moe_intermediate, c.num_experts, c.top_k, c.num_shared_experts) == \
        (4096, 1408, 128, 6, 2)
    assert (c.router, c.n_group, c.topk_group, c.renormalize, c.routed_scaling_factor) == \
        ("sigmoid_grouped", 1, 1, True, 2.5)
    assert hf.naming == "deepseek" and hf.moe_layers == tuple(range(1, 62))
    # the HF config class's default: not renormalized when the field is absent
    raw = {k: v for k, v in DOTS1.items() if k != "norm_topk_prob"}
    assert parse_hf_config(raw, "dots").cfg.renormalize is False


def test_a_minimax_checkpoint_folder_loads_with_its_selection_bias(tmp_path):
    """Mixtral's names (w1 / w3 / w2 under block_sparse_moe) and the bias beside the gate."""
    from safetensors.torch import save_file

    from epmoe.checkpoint import load_layer

    raw = dict(MINIMAX_M2, hidden_size=256, intermediate_size=128, num_local_experts=8,
               num_experts_per_tok=2, num_hidden_layers=2)
    raw.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = read_hf_config(str(tmp_path)).cfg
    g = torch.Generator().manual_seed(5)
    t = {}
    for cl in (0, 1):
        pre = f"model.layers.{cl}.block_sparse_moe."
        t[pre + "gate.weight"] = torch.randn(8, 256, generator=g)
        t[pre + "e_score_correction_bias"] = torch.randn(8, generator=g)
        for e in range(8):
            for n, shape in (("w1", (128, 256)), ("w3", (128, 256)), ("w2", (256, 128))):
                t[f"{pre}experts.{e}.{n}.weight"] = torch.randn(*shape, generator=g).bfloat16()
    save_file(t, str(tmp_path / "model.safetensors"))
    lw = load_layer(str(tmp_path), None, cfg, QuantConfig("bf16"), 1, [6, 3])
    pre = "model.layers.1.block_sparse_moe."
    assert torch.equal(lw.gate_ED, t[pre + "gate.weight"])
    assert torch.equal(lw.bias_E, t[pre + "e_score_correction_bias"])
    assert torch.equal(lw.experts.w13.data[1], torch.cat([t[pre + "experts.3.w1.weight"],
                                                          t[pre + "experts.3.w3.weight"]]))
    assert torch.equal(lw.experts.w2.data[0], t[pre + "experts.6.w2.weight"])


@pytest.mark.parametrize("change,msg", [
    (dict(shared_expert_intermediate_size=5632), "a gated shared expert (Qwen2-MoE's), not one "
                                                 "of deepseek_v3's"),
    (dict(model_type="bert"), "not a MoE family epmoe reads; supported: deepseek_v3"),
    (dict(model_type=None), "model_type None"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(scoring_func="tanh"), "scoring_func 'tanh'"),
    (dict(num_experts_per_tok=None),
     "none of num_experts_per_tok, num_experts_per_token, experts_per_token"),
    (dict(num_experts_per_tok=160), "top_k (160) must be <= topk_group"),
    (dict(first_k_dense_replace=61), "none of its 61 layers is a MoE layer"),
    (dict(num_experts_per_tok=300), "top_k (300) must be <= num_experts (256)"),
    # a count that is not an integer is refused, never rounded or read as a default
    (dict(hidden_size=7168.5), "hidden_size (7168.5) must be an integer"),
    (dict(n_routed_experts="256"), "n_routed_experts ('256') must be an integer"),
    (dict(moe_intermediate_size=True), "moe_intermediate_size (True) must be an integer"),
    (dict(moe_layer_freq=0), "moe_layer_freq (0) must be an integer >= 1"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob ('yes') must be true or false"),
])
def test_a_config_epmoe_cannot_compute_is_refused_by_name(change, msg):
    raw = {k: v for k, v in dict(PUBLISHED["deepseek-v3"], **change).items() if v is not None}
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        parse_hf_config(raw, "x")


def test_paths_that_are_not_configs(tmp_path):
    with pytest.raises(ValueError, match="no Hugging Face config.json there"):
        read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON config"):
        read_hf_config(str(tmp_path))
    with pytest.raises(ValueError, match="or give a Hugging Face config.json"):
        get_preset("no-such-model-or-path")


def test_other_storage_is_named_unknown_not_guessed():
    raw = dict(PUBLISHED["qwen3-30b-a3b"], quantization_config={"quant_method": "awq"})
    assert parse_hf_config(raw, "q").stored_recipe is None


TINY_QWEN = dict(model_type="qwen3_moe", hidden_size=256, moe_intermediate_size=128,
                 intermediate_size=512, num_experts=16, num_experts_per_tok=4,
                 norm_topk_prob=True, num_hidden_layers=4, decoder_sparse_step=2,
                 hidden_act="silu")


def test_a_checkpoint_folder_gives_its_naming_and_moe_layer_index(tmp_path):
    """MoE layer 1 of a decoder_sparse_step 2 model is the checkpoint's layer 3; the folder's
    config.json gives that and the naming, so load_layer needs neither."""
    from safetensors.torch import save_file

    from epmoe.checkpoint import load_layer

    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN))
    cfg = read_hf_config(str(tmp_path)).cfg
    d, i = cfg.hidden, cfg.moe_intermediate
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for cl in (1, 3):
        tensors[f"model.layers.{cl}.mlp.gate.weight"] = torch.randn(16, d, generator=g)
        for e in range(16):
            pre = f"model.layers.{cl}.mlp.experts.{e}."
            for n, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
                tensors[pre + n + ".weight"] = torch.randn(*shape, generator=g).bfloat16()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    lw = load_layer(str(tmp_path), None, cfg, QuantConfig("bf16"), 1, [5, 2])
    assert torch.equal(lw.gate_ED, tensors["model.layers.3.mlp.gate.weight"])
    want = torch.cat([tensors[f"model.layers.3.mlp.experts.5.{n}_proj.weight"]
                      for n in ("gate", "up")])
    assert torch.equal(lw.experts.w13.data[0], want)
    with pytest.raises(ValueError, match="has 2 MoE layers"):
        load_layer(str(tmp_path), None, cfg, QuantConfig("bf16"), 2, [0])
    (tmp_path / "config.json").unlink()  # without it: the caller names the naming and layer
    with pytest.raises(ValueError, match="has no config.json: name the checkpoint's naming"):
        load_layer(str(tmp_path), None, cfg, QuantConfig("bf16"), 1, [0])
    lw = load_layer(str(tmp_path), "qwen3_moe", cfg, QuantConfig("bf16"), 3, [5])
    assert torch.equal(lw.gate_ED, tensors["model.layers.3.mlp.gate.weight"])


@pytest.mark.timeout(240)
def test_launch_and_plan_take_a_config_json(tmp_path, capsys):
    """One rank in-process against the oracle; the ranks get the MoEConfig, not the path."""
    import pickle

    from epmoe.launch.checks import build_run
    from epmoe.launch.cli import parser
    from epmoe.plan.__main__ import main as plan

    folder = config_folder(tmp_path, "Tiny-Qwen3-MoE", TINY_QWEN)
    rc, s = launch_in_process(tmp_path, ["--model", str(folder)])
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]
    assert s["config"]["model"] == str(folder) and len(s["correctness"]["per_layer"]) == 2
    assert plan(["--model", str(folder / "config.json"), "--topology", "1x8", "--tokens",
                 "64"]) == 0
    assert "beats" in capsys.readouterr().out
    run = build_run(parser().parse_args(["--model", str(folder), "--ep", "4"]))
    want = read_hf_config(str(folder)).cfg
    (folder / "config.json").unlink()  # a rank on another node has no such file
    shipped = pickle.loads(pickle.dumps(run))
    assert shipped.cfg == want and shipped.num_layers == 2


def test_the_cli_prints_what_launch_will_run(tmp_path, capsys):
    from epmoe.hf_config import main

    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED["deepseek-v3"]))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "58: checkpoint layers 3-60" in out
    assert "naming deepseek, experts stored fp8_block" in out
    assert "sigmoid + selection bias, 4 of 8 groups, renormalized, x 2.5" in out
    assert max(len(line) for line in out.splitlines()[1:]) <= 80  # the rows; line 1: the path
    assert main([str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["cfg"]["num_experts"] == 256 and d["moe_layers"][0] == 3 and d["naming"] == "deepseek"
    assert main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
