"""DeepSeek-V2's MoEGate read from its config.json: greedy and group_limited_greedy routed
as its modeling code (re-written here in float64) routes them."""

import pytest
import torch

from epmoe.hf_config import parse_hf_config
from epmoe.reference import reference_route
from tests.route_util import assert_routes_as


def _deepseek_v2_gate(logits, k, norm, scale, n_group=1, topk_group=1):
    """DeepSeek-V2's MoEGate, as its modeling code defines it: softmax over the experts; top-k
    ("greedy"), or with n_group > 1 ("group_limited_greedy") each group scored by its best
    expert, the topk_group best kept, the others' scores set to 0, then top-k; renormalized
    when norm_topk_prob and top_k > 1, else x the scale."""
    p = torch.softmax(logits.double(), dim=-1)
    if n_group > 1:
        t = p.shape[0]
        group_scores = p.view(t, n_group, -1).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(t, n_group, p.shape[1] // n_group) \
            .reshape(t, -1)
        p = p.masked_fill(~score_mask.bool(), 0.0)
    w, ids = torch.topk(p, k, dim=-1)
    return ids, (w / (w.sum(-1, keepdim=True) + 1e-20) if norm and k > 1 else w * scale)


@pytest.mark.parametrize("norm", [False, True])
def test_deepseek_v2_routes_as_its_modeling_code(norm):
    # deepseek-ai/DeepSeek-V2-Lite/config.json, the scale raised so that it shows
    raw = dict(model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
               moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6,
               n_shared_experts=2, n_group=1, topk_group=1, routed_scaling_factor=2.0,
               norm_topk_prob=norm, scoring_func="softmax", topk_method="greedy",
               num_hidden_layers=27, first_k_dense_replace=1, moe_layer_freq=1,
               hidden_act="silu")
    hf = parse_hf_config(raw, "v2-lite")
    assert hf.cfg.num_moe_layers == 26 and hf.cfg.shared_intermediate == 2 * 1408
    logits = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    ids, w = reference_route(logits, hf.cfg)
    want_ids, want_w = _deepseek_v2_gate(logits, 6, norm, 2.0)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-12, atol=0)


# deepseek-ai/DeepSeek-V2 (236B): config.json MoE fields as released
DEEPSEEK_V2 = dict(model_type="deepseek_v2", hidden_size=5120, intermediate_size=12288,
                   moe_intermediate_size=1536, n_routed_experts=160, num_experts_per_tok=6,
                   n_shared_experts=2, n_group=8, topk_group=3, routed_scaling_factor=16.0,
                   norm_topk_prob=False, scoring_func="softmax",
                   topk_method="group_limited_greedy", num_hidden_layers=60,
                   first_k_dense_replace=1, moe_layer_freq=1, hidden_act="silu")


@pytest.mark.parametrize("norm,k", [(False, 6), (True, 6), (True, 1)])
def test_deepseek_v2_group_limited_greedy_routes_as_its_modeling_code(norm, k, seed):
    """DeepSeek-V2 (236B): the topk_group groups with the best expert, then top-k among them;
    the runtime's torch router and the reference alike (the Triton router kernel too:
    tests/test_more_families.py)."""
    from epmoe.hf_config import describe
    from epmoe.kernels.gate_topk import unsupported

    hf = parse_hf_config(dict(DEEPSEEK_V2, norm_topk_prob=norm, num_experts_per_tok=k), "v2")
    c = hf.cfg
    assert (c.router, c.n_group, c.topk_group, c.num_moe_layers) == ("softmax", 8, 3, 59)
    assert (c.renormalize, c.routed_scaling_factor) == \
        ((True, 1.0) if norm and k > 1 else (False, 16.0))
    assert "3 of 8 groups" in dict(describe(hf))["router"]
    assert unsupported(c) is None
    logits = torch.randn(64, 160, generator=torch.Generator().manual_seed(seed)) * 3
    want_ids, want_w = _deepseek_v2_gate(logits, k, norm, 16.0, 8, 3)
    assert_routes_as(logits, c, None, want_ids, want_w)
    if k > 1:  # the groups bind (top-1 is always in the best group): without them some token
        free = reference_route(logits, c.replace(n_group=1, topk_group=1))[0]  # picks others
        assert not torch.equal(free.sort(-1).values, want_ids.sort(-1).values)
