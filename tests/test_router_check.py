"""The report's router check: the layer's top-k sets and weights against the float64 router.

The MoE output is compared with the oracle on the routing the layer used; `check_router`
separately measures how often the layer's router picked the oracle's top-k set."""

from __future__ import annotations

import torch

from epmoe.config import QuantConfig, get_preset
from epmoe.launch.oracle import ROUTER_MIN_AGREEMENT, check_router
from epmoe.router import route_tokens
from epmoe.weights import layer_to_oracle, synthetic_layer

CFG = get_preset("deepseek-v3-tiny")


def _layer(seed):
    lw = synthetic_layer(CFG, QuantConfig("bf16"), 0, seed, [], with_shared=False)
    oracle = layer_to_oracle(lw)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, CFG.hidden, generator=g).to(torch.bfloat16)
    return lw, oracle, x


def test_the_layer_router_agrees_with_the_oracle_router():
    lw, oracle, x = _layer(1)
    r = route_tokens(x, lw.gate_ED, CFG, lw.bias_E)
    res = check_router(x, r.topk_ids_TK, r.topk_weights_TK, oracle, CFG)
    assert res["agreement"] >= ROUTER_MIN_AGREEMENT, res
    assert res["weight_rel_err"] <= 1e-5, res  # the fp32 torch router on CPU


def test_a_wrong_router_is_caught():
    lw, oracle, x = _layer(2)
    r = route_tokens(x, lw.gate_ED, CFG, lw.bias_E)
    ids = r.topk_ids_TK.clone()
    ids[::2, 0] = (ids[::2, 0] + 1) % CFG.num_experts  # every other token: another top-k set
    res = check_router(x, ids, r.topk_weights_TK, oracle, CFG)
    assert res["agreement"] <= 0.5, res
    w = r.topk_weights_TK * 1.1
    assert check_router(x, r.topk_ids_TK, w, oracle, CFG)["weight_rel_err"] > 0.05
