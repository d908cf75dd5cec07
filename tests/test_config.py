"""epmoe.config: presets construct with their published numbers; bad values raise, pinned."""

import pytest

from epmoe.config import PRESETS, MoEConfig, QuantConfig, get_preset
from epmoe.plan.forms import LayerPlan
from epmoe.plan.run import RunConfig
from epmoe.runtime import Runtime

TINY = dict(name="t", hidden=256, moe_intermediate=128, num_experts=16, top_k=4)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_constructs(name):
    cfg = get_preset(name)
    assert cfg.name == name
    assert cfg.top_k <= cfg.num_experts
    assert cfg.num_experts % cfg.n_group == 0
    assert cfg.replace() == cfg  # re-validates through __post_init__


def test_deepseek_v3_published_numbers():
    c = get_preset("deepseek-v3")
    assert (c.hidden, c.moe_intermediate, c.num_experts, c.top_k) == (7168, 2048, 256, 8)
    assert (c.n_group, c.topk_group, c.routed_scaling_factor) == (8, 4, 2.5)
    assert (c.router, c.renormalize, c.num_shared_experts) == ("sigmoid_grouped", True, 1)


def test_kimi_k2_published_numbers():
    c = get_preset("kimi-k2")
    assert (c.num_experts, c.routed_scaling_factor, c.n_group) == (384, 2.827, 1)
    assert c.router == "sigmoid_grouped"


def test_qwen3_235b_published_numbers():
    c = get_preset("qwen3-235b-a22b")
    assert (c.num_experts, c.moe_intermediate, c.top_k, c.num_shared_experts) == (128, 1536, 8, 0)


def test_gpt_oss_120b_published_numbers():
    c = get_preset("gpt-oss-120b")
    assert (c.hidden, c.num_experts, c.top_k, c.swiglu_limit) == (2880, 128, 4, 7.0)
    assert c.activation == "swigluoai" and c.router_bias and c.expert_bias
    # openai/gpt-oss-20b/config.json: the same layer, 32 experts, 24 layers
    s = get_preset("gpt-oss-20b")
    assert (s.hidden, s.moe_intermediate, s.num_experts, s.top_k, s.num_moe_layers) == \
        (2880, 2880, 32, 4, 24)
    assert s.replace(name=c.name, num_experts=128, num_moe_layers=36) == c


def test_shared_intermediate():
    assert MoEConfig(**TINY, num_shared_experts=2).shared_intermediate == 256


# ------------------------------------------------------------------------------ errors (pinned)

def test_top_k_above_num_experts_raises():
    with pytest.raises(ValueError, match=r"top_k \(9\) must be <= num_experts \(8\)"):
        MoEConfig("t", hidden=256, moe_intermediate=128, num_experts=8, top_k=9)


def test_unknown_preset_raises():
    with pytest.raises(ValueError, match=r"unknown preset 'nope'; choose one of: .*deepseek-v3"):
        get_preset("nope")
    for path in ("/no/such/config.json", "ckpt/missing", "my.json"):
        with pytest.raises(ValueError, match=r"no such file or folder .*presets: .*deepseek-v3"):
            get_preset(path)


def test_bad_recipe_raises():
    with pytest.raises(ValueError, match=r"recipe \('fp4'\) must be one of"):
        QuantConfig("fp4")


def test_bad_scale_fmt_raises():
    with pytest.raises(ValueError, match=r"scale_fmt \('e5m2'\) must be one of"):
        QuantConfig("fp8_block", "e5m2")


def test_scale_fmt_on_wrong_recipe_raises():
    with pytest.raises(ValueError, match=r"scale_fmt \('ue8m0_fp32'\) applies to fp8_block only"):
        QuantConfig("mxfp8", "ue8m0_fp32")


def test_apply_router_weight_on_input_needs_top_k_1():
    with pytest.raises(ValueError,
                       match=r"apply_router_weight_on_input needs top_k == 1 \(got 4\)"):
        MoEConfig(**TINY, apply_router_weight_on_input=True)
    MoEConfig(**{**TINY, "top_k": 1}, apply_router_weight_on_input=True)


@pytest.mark.parametrize("router", ["sigmoid_grouped", "sqrtsoftplus"])
def test_grouped_routers_need_top_k_experts_in_kept_groups(router):
    # 16 experts in 4 groups of 4, keep 1 group: only 4 experts can be chosen, top_k 8 cannot.
    with pytest.raises(ValueError, match=r"top_k \(8\) must be <= topk_group\*experts_per_group"):
        MoEConfig("t", 256, 128, 16, 8, router=router, n_group=4, topk_group=1)


def test_misc_field_errors():
    with pytest.raises(ValueError, match=r"hidden \(0\) must be a positive int"):
        MoEConfig(**{**TINY, "hidden": 0})
    with pytest.raises(ValueError, match=r"num_experts \(16\) must be divisible by n_group \(3\)"):
        MoEConfig(**TINY, n_group=3)
    with pytest.raises(ValueError, match=r"topk_group \(5\) must be <= n_group \(4\)"):
        MoEConfig(**TINY, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match=r"router \('relu'\) must be one of"):
        MoEConfig(**TINY, router="relu")
    with pytest.raises(ValueError, match=r"routed_scaling_factor \(0.0\) must be > 0"):
        MoEConfig(**TINY, routed_scaling_factor=0.0)
    with pytest.raises(ValueError, match=r"swiglu_limit \(-1.0\) must be > 0 or None"):
        MoEConfig(**TINY, swiglu_limit=-1.0)


@pytest.mark.parametrize("recipe,group", [("fp8_block", 128), ("mxfp8", 32), ("w4a8_mxfp4", 128)])
def test_hidden_not_multiple_of_quant_group_check_shapes(recipe, group):
    cfg = MoEConfig(**{**TINY, "hidden": 200})
    with pytest.raises(ValueError, match=rf"hidden \(200\) must be a multiple of {recipe}'s "
                                         rf"quant group \({group}\)"):
        QuantConfig(recipe).check_shapes(cfg)
    QuantConfig("bf16").check_shapes(cfg)  # bf16 has no group


def test_intermediate_not_multiple_of_quant_group_check_shapes():
    cfg = MoEConfig(**{**TINY, "moe_intermediate": 96})
    with pytest.raises(ValueError, match=r"moe intermediate per partition \(96\) must be a "
                                         r"multiple of fp8_block's quant group \(128\)"):
        QuantConfig("fp8_block").check_shapes(cfg)


def test_hidden_not_multiple_of_quant_group_runtime():
    run = RunConfig(model="qwen3-moe-tiny", quant=QuantConfig("fp8_block"), experts="torch",
                    tokens=8, layers=1, steps=1, model_overrides=(("hidden", 200),))
    with pytest.raises(ValueError, match=r"hidden \(200\) must be a multiple of fp8_block's"):
        Runtime(run)


def test_experts_not_divisible_by_ep():
    cfg = get_preset("qwen3-moe-tiny")  # 16 experts
    with pytest.raises(ValueError, match=r"experts \(16\) must be divisible by ep \(3\)"):
        LayerPlan(form="ep_dp", world=3, backend="all2all").validate(cfg, QuantConfig())
    LayerPlan(form="ep_dp", world=4, backend="all2all").validate(cfg, QuantConfig())


def test_tp_not_dividing_intermediate():
    cfg = get_preset("qwen3-moe-tiny")  # intermediate 128
    with pytest.raises(ValueError, match=r"moe intermediate \(128\) must be divisible by tp \(3\)"):
        LayerPlan(form="tp", world=3).validate(cfg, QuantConfig())
    # divides, but the slice (64) no longer tiles fp8_block's 128 group
    with pytest.raises(ValueError, match=r"moe intermediate per partition \(64\)"):
        LayerPlan(form="tp", world=2).validate(cfg, QuantConfig("fp8_block"))
    LayerPlan(form="tp", world=2).validate(cfg, QuantConfig("bf16"))
