"""More MoE families from a config.json: Granite (3.x MoE, shared, 4.0 hybrid), HunYuan-A13B,
DBRX, Arcee AFMoE, Qwen3-VL-MoE and Qwen3-Omni's thinker, MiniMax-Text-01 / M1, FlexOlmo; and
the families refused with their reason (PhiMoE's sparsemixer, LongCat-Flash's zero experts).

Each router is re-written here from its transformers modeling code (v5.25, the `*_moe`
modeling / modular files) in float64 and compared with epmoe's reference router and the
runtime's torch router (ids equal, weights to 1e-12). Configs are the transformers config
classes' defaults written out as a config.json (fields as the classes name them), plus the
release-config fields a family's reader must check. Their checkpoints:
tests/test_more_family_checkpoints.py."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.hf_config import describe, parse_hf_config
from epmoe.router import route
from tests.launch_util import config_folder
from tests.route_util import assert_routes_as

GRANITE = dict(model_type="granitemoe", hidden_size=4096, intermediate_size=11008,
               num_hidden_layers=32, hidden_act="silu", num_local_experts=8,
               num_experts_per_tok=2, router_aux_loss_coef=0.001, residual_multiplier=1.0)
GRANITE_SHARED = dict(GRANITE, model_type="granitemoeshared", shared_intermediate_size=0)
# Granite 4.0 "-h": mamba / attention mixers (not MoE's concern), a shared MLP in every layer
GRANITE_HYBRID = dict(GRANITE, model_type="granitemoehybrid", hidden_size=1536,
                      intermediate_size=512, num_local_experts=64, num_experts_per_tok=6,
                      num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"])
# HunYuan-A13B's release config carries per-layer lists the HF class does not read
HUNYUAN = dict(model_type="hunyuan_v1_moe", hidden_size=4096, intermediate_size=3072,
               num_hidden_layers=32, hidden_act="silu", num_experts=64, moe_topk=[8] * 32,
               moe_intermediate_size=[3072] * 32, num_shared_expert=[1] * 32,
               use_mixed_mlp_moe=True)
DBRX = dict(model_type="dbrx", d_model=6144, n_heads=48, n_layers=40,
            ffn_config=dict(ffn_hidden_size=10752, moe_num_experts=16, moe_top_k=4,
                            ffn_act_fn={"name": "silu"}, moe_normalize_expert_weights=1))
AFMOE = dict(model_type="afmoe", hidden_size=2048, intermediate_size=6144,
             moe_intermediate_size=1408, num_experts=64, num_experts_per_tok=6,
             num_shared_experts=2, route_scale=1.0, num_dense_layers=1, num_hidden_layers=32,
             score_func="sigmoid", route_norm=True)
QWEN3_VL = dict(model_type="qwen3_vl_moe", text_config=dict(
    model_type="qwen3_vl_moe_text", hidden_size=2048, intermediate_size=5632,
    moe_intermediate_size=1408, num_experts=60, num_experts_per_tok=4, num_hidden_layers=24,
    hidden_act="silu", decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False))
QWEN3_OMNI = dict(model_type="qwen3_omni_moe", thinker_config=dict(
    model_type="qwen3_omni_moe_thinker", text_config=dict(
        model_type="qwen3_omni_moe_text", hidden_size=2048, intermediate_size=18944,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        num_hidden_layers=28, hidden_act="silu", norm_topk_prob=True, decoder_sparse_step=1)))
MINIMAX = dict(model_type="minimax", hidden_size=4096, intermediate_size=14336,
               num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32,
               hidden_act="silu", router_jitter_noise=0.0)
# Kimi-Linear's MoE fields (DeepSeek-V3's block under Kimi's names), as its configs give them
KIMI_LINEAR = dict(model_type="kimi_linear", hidden_size=2304, num_hidden_layers=27,
                   num_experts=256, num_experts_per_token=8, num_shared_experts=1,
                   moe_intermediate_size=1024, first_k_dense_replace=1, moe_layer_freq=1,
                   moe_router_activation_func="sigmoid", routed_scaling_factor=2.446,
                   moe_renormalize=True, use_grouped_topk=True, num_expert_group=1,
                   topk_group=1, hidden_act="silu")
# LiquidAI LFM2-8B-A1B's config class defaults (no hidden_act: silu is fixed)
LFM2 = dict(model_type="lfm2_moe", hidden_size=2048, intermediate_size=7168,
            moe_intermediate_size=1792, num_hidden_layers=32, num_dense_layers=2,
            num_experts=32, num_experts_per_tok=4, use_expert_bias=True,
            routed_scaling_factor=1.0, norm_topk_prob=True)
FLEX_OLMO = dict(model_type="flex_olmo", hidden_size=4096, intermediate_size=11008,
                 num_experts=7, num_experts_per_tok=5, num_hidden_layers=32, hidden_act="silu",
                 norm_topk_prob=False)


@pytest.mark.parametrize("raw,want", [
    (GRANITE, (4096, 11008, 8, 2, 0, 0, True, tuple(range(32)), "granite")),
    (GRANITE_SHARED, (4096, 11008, 8, 2, 0, 0, True, tuple(range(32)), "granite")),
    (dict(GRANITE_SHARED, shared_intermediate_size=1024),
     (4096, 11008, 8, 2, 1, 1024, True, tuple(range(32)), "granite")),
    (GRANITE_HYBRID, (1536, 512, 64, 6, 2, 1024, True, tuple(range(4)), "granite")),
    (HUNYUAN, (4096, 3072, 64, 8, 1, 3072, True, tuple(range(32)), "hunyuan")),
    (DBRX, (6144, 10752, 16, 4, 0, 0, True, tuple(range(40)), "dbrx")),
    (AFMOE, (2048, 1408, 64, 6, 2, 2816, True, tuple(range(1, 32)), "afmoe")),
    (QWEN3_VL, (2048, 1408, 60, 4, 0, 0, True, tuple(range(24)), "qwen3_vl")),
    (QWEN3_OMNI, (2048, 768, 128, 8, 0, 0, True, tuple(range(28)), "qwen3_omni")),
    (MINIMAX, (4096, 14336, 8, 2, 0, 0, True, tuple(range(32)), "mixtral")),
    (FLEX_OLMO, (4096, 11008, 7, 5, 0, 0, False, tuple(range(32)), "qwen3_moe")),
    (LFM2, (2048, 1792, 32, 4, 0, 0, True, tuple(range(2, 32)), "lfm2")),
    (KIMI_LINEAR, (2304, 1024, 256, 8, 1, 1024, True, tuple(range(1, 27)), "kimi")),
], ids=["granite", "granite-shared-0", "granite-shared", "granite-hybrid", "hunyuan", "dbrx",
        "afmoe", "qwen3-vl", "qwen3-omni", "minimax", "flex-olmo", "lfm2", "kimi-linear"])
def test_configs_read_to_their_moe_layer(raw, want):
    hf = parse_hf_config(raw, "m")
    c = hf.cfg
    assert (c.hidden, c.moe_intermediate, c.num_experts, c.top_k, c.num_shared_experts,
            c.shared_intermediate, c.renormalize, hf.moe_layers, hf.naming) == want
    assert c.routed_scaling_factor == (2.446 if raw is KIMI_LINEAR else 1.0)
    assert not c.shared_gate and c.swiglu_limit is None
    assert c.router == ("sigmoid_grouped" if raw in (AFMOE, LFM2, KIMI_LINEAR) else "softmax")
    assert c.renorm_eps == (1e-6 if raw is LFM2 else 0.0)
    assert dict(describe(hf))["model_type"] == hf.model_type


def test_a_shared_mlp_width_that_is_no_multiple_of_an_experts_is_one_mlp_of_that_width():
    c = parse_hf_config(dict(GRANITE_SHARED, intermediate_size=512,
                             shared_intermediate_size=640), "g").cfg
    assert (c.num_shared_experts, c.shared_intermediate) == (1, 640)
    assert dict(describe(parse_hf_config(dict(GRANITE_SHARED, intermediate_size=512,
                                              shared_intermediate_size=640), "g")))["shared"] \
        == "one MLP 640 wide"
    QuantConfig("fp8_block").check_shapes(c)  # 640 = 5 groups of 128
    odd = c.replace(shared_intermediate_size=600)
    with pytest.raises(ValueError, match=r"shared MLP's width \(600\)"):
        QuantConfig("fp8_block").check_shapes(odd)
    with pytest.raises(ValueError, match="needs num_shared_experts == 1"):
        c.replace(num_shared_experts=2)
    none = parse_hf_config(dict(GRANITE_HYBRID, shared_intermediate_size=0), "g").cfg
    assert none.num_shared_experts == 0  # a zero-width shared MLP adds nothing


@pytest.mark.parametrize("raw,match", [
    (dict(model_type="phimoe", hidden_size=4096), "sparsemixer"),
    (dict(model_type="longcat_flash", hidden_size=6144), "zero-computation experts"),
    (dict(DBRX, ffn_config=dict(DBRX["ffn_config"], moe_normalize_expert_weights=2.0)),
     "p-norm other than 1"),
    (dict(DBRX, ffn_config=dict(DBRX["ffn_config"], ffn_act_fn={"name": "gelu"})),
     "ffn_act_fn 'gelu'"),
    (dict(HUNYUAN, moe_topk=[8] * 31 + [4]), r"moe_topk differs between layers \(values 4, 8\)"),
    (dict(HUNYUAN, moe_intermediate_size=[1536] * 32), "HunYuanMoEV1's experts and shared MLP"),
    (dict(HUNYUAN, num_shared_expert=[2] * 32), "exactly one shared MLP"),
    (dict(HUNYUAN, use_mixed_mlp_moe=False), "exactly one shared MLP"),
    (dict(GRANITE_HYBRID, num_local_experts=0), "a dense model"),
    (dict(MINIMAX, shared_intermediate_size=1024), "no shared expert to compute it with"),
    (dict(KIMI_LINEAR, routed_expert_hidden_size=1152), "a latent MoE"),
    (dict(KIMI_LINEAR, num_expert_group=8, topk_group=4), "num_expert_group 8"),
    (dict(KIMI_LINEAR, moe_router_activation_func="relu"), "not sigmoid or softmax"),
], ids=["phimoe", "longcat", "dbrx-p2", "dbrx-gelu", "hunyuan-topk", "hunyuan-width",
        "hunyuan-shared", "hunyuan-mixed", "granite-dense", "minimax-shared", "kimi-latent",
        "kimi-groups", "kimi-relu"])
def test_what_epmoe_does_not_compute_is_refused_with_its_reason(raw, match):
    with pytest.raises(ValueError, match=match):
        parse_hf_config(raw, "m")


def test_moe_layer_selection():
    vl = dict(QWEN3_VL, text_config=dict(QWEN3_VL["text_config"], decoder_sparse_step=2,
                                         mlp_only_layers=[3]))
    assert parse_hf_config(vl, "q").moe_layers == tuple(i for i in range(24)
                                                        if (i + 1) % 2 == 0 and i != 3)
    assert parse_hf_config(dict(AFMOE, num_dense_layers=3), "a").moe_layers == \
        tuple(range(3, 32))
    assert parse_hf_config(dict(DBRX, n_layers=6), "d").cfg.num_moe_layers == 6


# ---------------------------------------------------------------------- routers, float64

def _softmax_topk(logits, k, renorm):
    """Mixtral / Qwen3-VL / Qwen3-Omni / FlexOlmo / HunYuan / MiniMax / DBRX (p = 1): softmax
    over every expert, top-k of the probabilities, / their sum if renormalized."""
    p = torch.softmax(logits.double(), dim=-1)
    w, ids = torch.topk(p, k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True) if renorm else w)


def _granite(logits, k):
    """JetMoeTopKGating: top-k of the logits, softmax over those k."""
    top, ids = logits.double().topk(k, dim=1)
    return ids, torch.softmax(top, dim=1)


def _lfm2(logits, bias, k, renorm, scale):
    """Lfm2MoeSparseMoeBlock: sigmoid; top-k of sigmoid + expert_bias (if any); the unbiased
    sigmoids / (their sum + 1e-6) if norm_topk_prob; x routed_scaling_factor."""
    s = torch.sigmoid(logits.double())
    ids = torch.topk(s + (0 if bias is None else bias.double()), k, dim=-1).indices
    w = s.gather(1, ids)
    return ids, (w / (w.sum(-1, keepdim=True) + 1e-6) if renorm else w) * scale


def _kimi(logits, bias, k, renorm, scale):
    """KimiMoEGate: sigmoid; top-k of sigmoid + e_score_correction_bias; the unbiased sigmoids
    / (their sum + 1e-20) if moe_renormalize and top_k > 1; x routed_scaling_factor."""
    s = torch.sigmoid(logits.double())
    ids = torch.topk(s + bias.double(), k, dim=-1).indices
    w = s.gather(1, ids)
    if k > 1 and renorm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scale


def _afmoe(logits, bias, k, scale):
    """AfmoeTokenChoiceRouter: sigmoid; top-k of sigmoid + expert_bias; the unbiased sigmoids
    / (their sum + 1e-20) x route_scale."""
    s = torch.sigmoid(logits.double())
    ids = torch.topk(s + bias.double(), k, dim=-1).indices
    w = s.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * scale


@pytest.mark.parametrize("raw", [GRANITE, HUNYUAN, DBRX, dict(DBRX, ffn_config=dict(
    DBRX["ffn_config"], moe_normalize_expert_weights=None)), AFMOE, dict(AFMOE, route_scale=2.5),
    QWEN3_VL, QWEN3_OMNI, dict(QWEN3_OMNI, thinker_config=dict(text_config=dict(
        QWEN3_OMNI["thinker_config"]["text_config"], norm_topk_prob=False))), MINIMAX,
    FLEX_OLMO, LFM2, dict(LFM2, use_expert_bias=False, norm_topk_prob=False,
                          routed_scaling_factor=2.0), dict(LFM2, routed_scaling_factor=2.5),
    KIMI_LINEAR, dict(KIMI_LINEAR, num_experts_per_token=1), dict(KIMI_LINEAR,
                                                                  moe_renormalize=False)],
    ids=["granite", "hunyuan", "dbrx", "dbrx-unnormalized", "afmoe", "afmoe-scaled",
         "qwen3-vl", "qwen3-omni", "qwen3-omni-unnormalized", "minimax", "flex-olmo", "lfm2",
         "lfm2-unbiased-unnormalized", "lfm2-scaled", "kimi", "kimi-top1", "kimi-unnormalized"])
def test_each_router_routes_as_its_modeling_code(raw, seed):
    c = parse_hf_config(raw, "m").cfg
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(48, c.num_experts, generator=g) * 2
    bias = None
    if raw.get("model_type") == "afmoe":
        bias = torch.randn(c.num_experts, generator=g) * 0.05
        want_ids, want_w = _afmoe(logits, bias, c.top_k, raw["route_scale"])
    elif raw.get("model_type") == "kimi_linear":
        bias = torch.randn(c.num_experts, generator=g) * 0.05
        want_ids, want_w = _kimi(logits, bias, raw["num_experts_per_token"],
                                 raw["moe_renormalize"], raw["routed_scaling_factor"])
    elif raw.get("model_type") == "lfm2_moe":
        bias = torch.randn(c.num_experts, generator=g) * 0.05 if raw["use_expert_bias"] else None
        want_ids, want_w = _lfm2(logits, bias, c.top_k, raw["norm_topk_prob"],
                                 raw["routed_scaling_factor"])
    elif raw.get("model_type") == "granitemoe":
        want_ids, want_w = _granite(logits, c.top_k)
    else:
        text = raw.get("text_config") or (raw.get("thinker_config") or {}).get("text_config") \
            or raw.get("ffn_config") or raw
        renorm = {"qwen3_vl_moe_text": True, "dbrx": text.get(
            "moe_normalize_expert_weights") is not None}.get(
            text.get("model_type", raw["model_type"]), text.get("norm_topk_prob", True))
        want_ids, want_w = _softmax_topk(logits, c.top_k, renorm)
    assert_routes_as(logits, c, bias, want_ids, want_w)


@pytest.mark.interpreter  # the Triton router kernel on CPU tensors
@pytest.mark.parametrize("raw", [LFM2, "v2"], ids=["lfm2", "deepseek-v2"])
def test_the_fused_router_routes_lfm2_and_v2_as_the_torch_router(raw, seed):
    """LFM2's / (sum + 1e-6) and DeepSeek-V2's group_limited_greedy (160 experts in 8 groups:
    no power of two) run in the Triton router kernel, as the torch router computes them."""
    from epmoe.kernels.gate_topk import unsupported
    from tests.test_hf_deepseek_v2 import DEEPSEEK_V2

    c = parse_hf_config(DEEPSEEK_V2 if raw == "v2" else raw, "m").cfg
    assert unsupported(c) is None
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(24, c.num_experts, generator=g) * 2
    bias = None if c.router == "softmax" else torch.randn(c.num_experts, generator=g) * 0.1
    got, want = route(logits, c, bias, backend="triton"), route(logits, c, bias, backend="torch")
    assert torch.equal(got.topk_ids_TK.sort(-1).values, want.topk_ids_TK.sort(-1).values)
    order = lambda r: r.topk_weights_TK.gather(1, r.topk_ids_TK.long().argsort(-1))  # noqa
    torch.testing.assert_close(order(got), order(want), rtol=1e-5, atol=1e-6)


def test_what_the_cli_prints_fits_80_columns(capsys, tmp_path):
    """`python -m epmoe.hf_config PATH` for every family here, with the longest storage note."""
    from epmoe.hf_config import main

    for n, raw in enumerate([GRANITE, GRANITE_HYBRID, HUNYUAN, DBRX, AFMOE, QWEN3_VL,
                             QWEN3_OMNI, MINIMAX, FLEX_OLMO, LFM2, KIMI_LINEAR]):
        folder = config_folder(tmp_path, f"a-rather-long-model-folder-name-{n}",
                               dict(raw, quantization_config={"quant_method": "awq"}))
        assert main([str(folder / "config.json")]) == 0
        out = capsys.readouterr().out.splitlines()[1:]  # the first line is the path
        assert out and max(map(len, out)) <= 80, out
