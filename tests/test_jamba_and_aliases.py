"""AI21 Jamba's MoE layers (JambaSparseMoeBlock: softmax over the router logits, top-k, never
renormalized; every expert_layer_period-th layer from expert_layer_offset is MoE), GLM-4.7-Flash
(glm4_moe_lite) and Solar-Open (solar_open) as GLM-4.5's MoE layer, and Nemotron-H refused with
its reason. The Jamba router is re-written here in float64 from its modeling code and compared
with epmoe's reference and torch routers; a checkpoint under AI21's names passes the oracle."""

from __future__ import annotations

import pytest
import torch

from epmoe.hf_config import parse_hf_config, read_hf_config
from tests.launch_util import config_folder, launch_in_process
from tests.route_util import assert_routes_as

# JambaConfig's defaults (ai21labs/Jamba-v0.1's MoE fields), as a config.json gives them
JAMBA = dict(model_type="jamba", hidden_size=4096, intermediate_size=14336,
             num_hidden_layers=32, hidden_act="silu", num_experts=16, num_experts_per_tok=2,
             expert_layer_period=2, expert_layer_offset=1, attn_layer_period=8,
             attn_layer_offset=4)
# GLM-4.7-Flash-like and Solar-Open-like configs: DeepSeek-V3's MoE fields
GLM_LITE = dict(model_type="glm4_moe_lite", hidden_size=2048, intermediate_size=10240,
                moe_intermediate_size=1536, num_hidden_layers=47, n_routed_experts=64,
                n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1,
                norm_topk_prob=True, routed_scaling_factor=1.8, n_group=1, topk_group=1,
                hidden_act="silu")
SOLAR = dict(GLM_LITE, model_type="solar_open", hidden_size=4096, moe_intermediate_size=1280,
             num_hidden_layers=48, n_routed_experts=128, num_experts_per_tok=8,
             first_k_dense_replace=0, routed_scaling_factor=1.0)


def test_jamba_reads_to_its_moe_layers():
    hf = parse_hf_config(JAMBA, "jamba")
    c = hf.cfg
    assert hf.moe_layers == tuple(range(1, 32, 2)) and hf.naming == "jamba"
    assert (c.router, c.renormalize, c.routed_scaling_factor, c.num_experts, c.top_k,
            c.moe_intermediate, c.num_shared_experts) == ("softmax", False, 1.0, 16, 2,
                                                          14336, 0)
    # a release config's norm_topk_prob / scale fields are not read by its modeling code
    same = parse_hf_config(dict(JAMBA, norm_topk_prob=True, routed_scaling_factor=2.0), "j").cfg
    assert (same.renormalize, same.routed_scaling_factor) == (False, 1.0)
    assert parse_hf_config(dict(JAMBA, expert_layer_period=4, expert_layer_offset=3),
                           "j").moe_layers == (3, 7, 11, 15, 19, 23, 27, 31)


def test_jamba_routes_as_its_modeling_code(seed):
    c = parse_hf_config(JAMBA, "jamba").cfg
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64) * 2
    want_w, want_ids = torch.topk(torch.softmax(logits, dim=1), 2, dim=-1)
    assert_routes_as(logits, c, None, want_ids, want_w)


@pytest.mark.parametrize("raw", [GLM_LITE, SOLAR], ids=["glm4_moe_lite", "solar_open"])
def test_glm_lite_and_solar_open_are_glm45s_moe_layer(raw):
    hf = parse_hf_config(raw, "m")
    c = hf.cfg
    glm = parse_hf_config(dict(raw, model_type="glm4_moe"), "m")
    assert c.replace(name="x") == glm.cfg.replace(name="x")
    assert (hf.naming, hf.moe_layers) == ("deepseek", glm.moe_layers)
    assert c.router == "sigmoid_grouped" and c.selection_bias


def test_nemotron_h_is_refused_with_its_reason():
    with pytest.raises(ValueError, match="squared-ReLU MLPs without a gate"):
        parse_hf_config(dict(model_type="nemotron_h", hidden_size=2688, n_routed_experts=128,
                             num_experts_per_tok=6, num_hidden_layers=52), "n")


def test_a_jamba_checkpoint_passes_the_oracle(tmp_path):
    from safetensors.torch import save_file

    tiny = dict(JAMBA, hidden_size=256, intermediate_size=128, num_experts=8,
                num_hidden_layers=4)
    folder = config_folder(tmp_path, "tiny-jamba", tiny)
    hf = read_hf_config(str(folder))
    assert hf.moe_layers == (1, 3)
    g, t = torch.Generator().manual_seed(71), {}
    for cl in hf.moe_layers:
        pre = f"model.layers.{cl}.feed_forward."
        t[pre + "router.weight"] = torch.randn(8, 256, generator=g) * 256 ** -0.5
        for e in range(8):
            for n, shape in (("gate_proj", (128, 256)), ("up_proj", (128, 256)),
                             ("down_proj", (256, 128))):
                t[f"{pre}experts.{e}.{n}.weight"] = (torch.randn(*shape, generator=g)
                                                     * shape[1] ** -0.5).bfloat16()
    save_file(t, str(folder / "model.safetensors"))
    rc, s = launch_in_process(tmp_path, ["--weights", str(folder)])
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]
    assert len(s["correctness"]["per_layer"]) == 2
