"""inclusionAI's Ling / Ring MoE (model_type bailing_moe: BailingMoe 1.x and 2.x).

The routers re-written here in float64 from the modeling code shipped with the checkpoints
(BailingMoeV2_5Gate: sigmoid, selected on scores + expert_bias within the topk_group groups of
best top-2 sums, the unbiased scores / (sum + 1e-20) if top_k > 1, x routed_scaling_factor;
Ling 1.x: softmax top-k, / (sum + 1e-20) if norm_topk_prob) and compared with epmoe's
reference router and the runtime's torch router (ids equal, weights to 1e-12); the configs
read to that layer; a checkpoint under Bailing's names passes the oracle."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.hf_config import describe, parse_hf_config, read_hf_config
from tests.launch_util import config_folder, launch_in_process
from tests.route_util import assert_routes_as

# BailingMoeV2_5Config's defaults (inclusionAI/Ring-V2.5), as a config.json gives them
RING = dict(model_type="bailing_moe", architectures=["BailingMoeV2_5ForCausalLM"],
            hidden_size=2048, intermediate_size=5120, num_hidden_layers=20, hidden_act="silu",
            num_experts=256, num_shared_experts=1, num_experts_per_tok=8, n_group=8,
            topk_group=4, moe_intermediate_size=512, first_k_dense_replace=1,
            moe_router_enable_expert_bias=True, routed_scaling_factor=2.5,
            score_function="sigmoid", scoring_func="sigmoid", topk_method="noaux_tc",
            norm_topk_prob=True)
# a Ling 1.x config (softmax, no groups, two shared experts, every layer MoE)
LING1 = dict(model_type="bailing_moe", hidden_size=2048, intermediate_size=5632,
             num_hidden_layers=28, hidden_act="silu", num_experts=64, num_shared_experts=2,
             num_experts_per_tok=6, moe_intermediate_size=1408, first_k_dense_replace=0,
             norm_topk_prob=True)


def _ring_gate(logits, bias, k, groups, topk_group, scale):
    """BailingMoeV2_5Gate.forward after the gate GEMM, float64."""
    scores = torch.sigmoid(logits)
    sel = scores + bias
    t, e = sel.shape
    gs = sel.view(t, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    gi = torch.topk(gs, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(gs).scatter_(1, gi, 1)
    mask = mask.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, -1)
    _, idx = torch.topk(sel.masked_fill(~mask.bool(), float("-inf")), k=k, dim=-1)
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else w
    return idx, w * scale


def _ling1_gate(logits, k, norm):
    scores = logits.softmax(dim=-1)
    w, idx = torch.topk(scores, k=k, dim=-1, sorted=False)
    if k > 1 and norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, w


def test_configs_read_to_their_moe_layer():
    r = parse_hf_config(RING, "ring")
    c = r.cfg
    assert (c.router, c.selection_bias, c.n_group, c.topk_group, c.renormalize,
            c.routed_scaling_factor, c.num_shared_experts, c.moe_intermediate) == \
        ("sigmoid_grouped", True, 8, 4, True, 2.5, 1, 512)
    assert r.moe_layers == tuple(range(1, 20)) and r.naming == "bailing"
    assert "4 of 8 groups" in dict(describe(r))["router"]
    l1 = parse_hf_config(LING1, "ling").cfg
    assert (l1.router, l1.n_group, l1.renormalize, l1.routed_scaling_factor,
            l1.num_shared_experts, l1.moe_intermediate) == ("softmax", 1, True, 1.0, 2, 1408)
    # Ring's config without scoring_func: score_function alone decides
    alone = dict(RING)
    del alone["scoring_func"]
    assert parse_hf_config(alone, "r").cfg.router == "sigmoid_grouped"
    off = parse_hf_config(dict(RING, moe_router_enable_routed_scaling=False), "r").cfg
    assert off.routed_scaling_factor == 1.0
    own = parse_hf_config(dict(RING, moe_shared_expert_intermediate_size=1024,
                               num_shared_experts=2), "r").cfg
    assert (own.num_shared_experts, own.shared_intermediate) == (1, 2048)
    with pytest.raises(ValueError, match="n_group 4 with softmax scores"):
        parse_hf_config(dict(LING1, n_group=4, topk_group=2), "l")
    with pytest.raises(ValueError, match="score_function 'relu'"):
        parse_hf_config(dict(RING, score_function="relu"), "r")


@pytest.mark.parametrize("which", ["ring", "ring-top1", "ling1"])
def test_the_router_routes_as_its_modeling_code(which, seed):
    g = torch.Generator().manual_seed(seed)
    raw = {"ring": RING, "ring-top1": dict(RING, num_experts_per_tok=1), "ling1": LING1}[which]
    c = parse_hf_config(raw, which).cfg
    logits = torch.randn(64, c.num_experts, generator=g, dtype=torch.float64) * 2
    bias = torch.randn(c.num_experts, generator=g, dtype=torch.float64) * 0.1
    if which == "ling1":
        want_ids, want_w = _ling1_gate(logits, c.top_k, True)
        bias = None
    else:
        want_ids, want_w = _ring_gate(logits, bias, c.top_k, 8, 4, 2.5)
    assert_routes_as(logits, c, bias, want_ids, want_w)


def test_a_checkpoint_under_bailings_names_passes_the_oracle(tmp_path):
    from safetensors.torch import save_file

    from epmoe.checkpoint import load_layer

    tiny = dict(RING, hidden_size=256, num_experts=16, num_experts_per_tok=4, n_group=4,
                topk_group=2, moe_intermediate_size=128, num_hidden_layers=3)
    folder = config_folder(tmp_path, "tiny-ring", tiny)
    hf = read_hf_config(str(folder))
    g, t = torch.Generator().manual_seed(61), {}
    for cl in hf.moe_layers:
        pre = f"model.layers.{cl}.mlp."
        t[pre + "gate.weight"] = torch.randn(16, 256, generator=g) * 256 ** -0.5
        t[pre + "gate.expert_bias"] = torch.randn(16, generator=g) * 0.05
        for sub in [f"experts.{e}." for e in range(16)] + ["shared_experts."]:
            for n, shape in (("gate_proj", (128, 256)), ("up_proj", (128, 256)),
                             ("down_proj", (256, 128))):
                t[f"{pre}{sub}{n}.weight"] = (torch.randn(*shape, generator=g)
                                              * shape[1] ** -0.5).bfloat16()
    save_file(t, str(folder / "model.safetensors"))
    lw = load_layer(str(folder), None, hf.cfg, QuantConfig("bf16"), 1, [3])
    torch.testing.assert_close(lw.bias_E, t["model.layers.2.mlp.gate.expert_bias"])
    assert lw.shared is not None
    rc, s = launch_in_process(tmp_path, ["--weights", str(folder)])
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]
    assert len(s["correctness"]["per_layer"]) == 2


def test_what_the_cli_prints_fits_80_columns(tmp_path, capsys):
    from epmoe.hf_config import main

    for name, raw in (("ring", RING), ("ling1", LING1)):
        assert main([str(config_folder(tmp_path, name, raw))]) == 0
        out = capsys.readouterr().out
        assert "bailing" in out and all(len(line) <= 80 for line in out.splitlines()), out
