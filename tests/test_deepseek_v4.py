"""DeepSeek-V4's MoE layer from its config.json (`--model path/to/DeepSeek-V4`).

Anchors: the fields of transformers' DeepseekV4Config (the defaults it documents for
deepseek-ai/DeepSeek-V4-Flash-Base), and its router and experts re-written here from its
modeling code (modular_deepseek_v4.py): sqrt(softplus) scores, the top-k of scores + the
selection bias, the chosen scores over their sum (always) x routed_scaling_factor; routed
experts clamp gate at swiglu_limit and up to +-swiglu_limit before SiLU(gate) * up; the shared
expert is a plain SwiGLU MLP (no clamp). Its first layers route by token id (hash_moe)."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.hf_config import parse_hf_config
from epmoe.reference import reference_moe, reference_route
from tests.launch_util import config_folder, launch_in_process

V4 = dict(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], hidden_size=4096,
          moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
          num_key_value_heads=1, head_dim=512, q_lora_rank=1024, n_routed_experts=256,
          n_shared_experts=1, num_experts_per_tok=6, scoring_func="sqrtsoftplus",
          norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4,
          num_hash_layers=3, sliding_window=128, o_groups=8, index_topk=512,
          num_nextn_predict_layers=1, hidden_act="silu", vocab_size=129280)


def _v4_gate(logits, bias, k, scale):
    """DeepseekV4TopKRouter.forward, in float64."""
    s = torch.nn.functional.softplus(logits.double()).sqrt()
    ids = torch.topk(s + bias.double(), k, dim=-1).indices
    w = s.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * scale


def _swiglu(x, w13, w2, limit=None):
    """DeepseekV4Experts (limit) / DeepseekV4MLP (None) for one token, float64."""
    i = w13.shape[0] // 2
    h = w13 @ x
    g, u = h[:i], h[i:]
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return w2 @ (torch.nn.functional.silu(g) * u)


@pytest.mark.parametrize("norm", [True, False])
def test_v4_reads_to_its_moe_layer_and_routes_as_its_modeling_code(norm):
    """norm_topk_prob is unread: the router always renormalizes."""
    hf = parse_hf_config(dict(V4, norm_topk_prob=norm), "v4")
    c = hf.cfg
    assert (c.hidden, c.moe_intermediate, c.num_experts, c.top_k, c.num_shared_experts) == \
        (4096, 2048, 256, 6, 1)
    assert (c.router, c.n_group, c.renormalize, c.routed_scaling_factor, c.swiglu_limit,
            c.activation) == ("sqrtsoftplus", 1, True, 1.5, 10.0, "swiglu")
    assert hf.moe_layers == tuple(range(43)) and c.num_moe_layers == 43
    assert (c.hash_layers, c.vocab_size) == ((0, 1, 2), 129280)
    assert hf.naming == "deepseek_v4"  # its checkpoints: tests/test_deepseek_v4_checkpoint.py
    g = torch.Generator().manual_seed(4)
    logits, bias = torch.randn(64, 256, generator=g) * 3, torch.randn(256, generator=g) * 0.1
    ids, w = reference_route(logits, c, bias)
    want_ids, want_w = _v4_gate(logits, bias, 6, 1.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-12, atol=0)


def test_v4_layers_follow_mlp_layer_types_and_its_routers_are_checked():
    types = ["hash_moe", "moe", "hash_moe", "moe"]
    hf = parse_hf_config(dict(V4, num_hidden_layers=4, mlp_layer_types=types), "v4")
    assert hf.moe_layers == (0, 1, 2, 3) and hf.cfg.hash_layers == (0, 2)
    no_hash = parse_hf_config(dict(V4, num_hash_layers=0), "v4")
    assert no_hash.moe_layers == tuple(range(43)) and no_hash.cfg.hash_layers == ()
    assert parse_hf_config(dict(V4, num_hidden_layers=2), "v4").cfg.hash_layers == (0, 1)
    with pytest.raises(ValueError, match="mlp_layer_types must give moe or hash_moe"):
        parse_hf_config(dict(V4, num_hidden_layers=4, mlp_layer_types=["dense"] * 4), "v4")
    with pytest.raises(ValueError, match=r"hash-routed layers \[0, 1, 2\] need vocab_size"):
        parse_hf_config({k: v for k, v in V4.items() if k != "vocab_size"}, "v4")
    soft = parse_hf_config(dict(V4, scoring_func="softmax"), "v4").cfg  # bias on the scores
    assert (soft.router, soft.selection_bias, soft.renormalize) == ("softmax_biased", True, True)
    sig = parse_hf_config(dict(V4, scoring_func="sigmoid"), "v4").cfg
    assert (sig.router, sig.n_group, sig.renormalize) == ("sigmoid_grouped", 1, True)


def test_the_clamp_is_the_routed_experts_not_the_shared_experts():
    """The oracle: routed rows clamp, the shared MLP does not (a limit small enough to bite;
    the clamped shared MLP differs, so the check can fail)."""
    cfg = MoEConfig("v4-clamp", hidden=64, moe_intermediate=32, num_experts=4, top_k=2,
                    num_shared_experts=1, router="sqrtsoftplus", routed_scaling_factor=1.5,
                    swiglu_limit=0.25)
    g = torch.Generator().manual_seed(9)
    d, i = cfg.hidden, cfg.moe_intermediate
    w13, w2 = torch.randn(4, 2 * i, d, generator=g).double(), torch.randn(4, d, i, generator=g)
    shared = (torch.randn(2 * i, d, generator=g).double(), torch.randn(d, i, generator=g).double())
    gate = torch.randn(4, d, generator=g).double()
    x = torch.randn(3, d, generator=g)
    oracle = (gate, None, w13, w2.double(), shared)
    ids = torch.tensor([[0, 2], [1, -1], [-1, -1]])
    wts = torch.tensor([[0.7, 0.8], [1.1, 0.0], [0.0, 0.0]], dtype=torch.float64)
    got = reference_moe(x, oracle, cfg, QuantConfig("bf16"), ids, wts, fake_quant=False)
    xd = x.double()
    for n in range(3):
        want = _swiglu(xd[n], *shared)
        assert not torch.allclose(want, _swiglu(xd[n], *shared, limit=0.25))
        for j in range(2):
            e = int(ids[n, j])
            if e >= 0:
                want = want + wts[n, j] * _swiglu(xd[n], w13[e], w2[e].double(), limit=0.25)
        torch.testing.assert_close(got[n], want, rtol=1e-12, atol=1e-12)
    assert cfg.shared_mlp_cfg.swiglu_limit is None and cfg.shared_mlp_cfg.hidden == cfg.hidden


@pytest.mark.timeout(240)
def test_a_v4_config_launches_against_the_oracle(tmp_path):
    """One rank in-process, synthetic weights, a clamp that bites on routed and shared rows
    alike: the runtime's shared MLP must not clamp, as the oracle's does not."""
    folder = config_folder(tmp_path, "Tiny-V4", dict(
        V4, hidden_size=256, moe_intermediate_size=128, n_routed_experts=16,
        num_experts_per_tok=4, num_hidden_layers=5, swiglu_limit=0.25))
    rc, s = launch_in_process(tmp_path, ["--model", str(folder)])
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]
    assert len(s["correctness"]["per_layer"]) == 5  # 0-2 hash-routed, 3-4 by the router
    assert s["correctness"]["router"]["agreement"] == 1.0
