"""Checking a router against a model's modeling code re-written in float64."""

from __future__ import annotations

import torch

from epmoe.reference import reference_route
from epmoe.router import route

# The router kinds the router tests run, as MoEConfig fields
ROUTERS = {
    "softmax_renorm": dict(router="softmax", renormalize=True),
    "softmax_plain": dict(router="softmax", renormalize=False),
    "sigmoid_grouped": dict(router="sigmoid_grouped", n_group=4, topk_group=2,
                            routed_scaling_factor=2.5),
    "sigmoid_kimi": dict(router="sigmoid_grouped", n_group=1, topk_group=1,
                         routed_scaling_factor=2.827),
    "sqrtsoftplus": dict(router="sqrtsoftplus", routed_scaling_factor=1.5),
    "softmax_biased": dict(router="softmax_biased"),
}


def assert_routes_as(logits, cfg, bias, want_ids, want_w):
    """epmoe's reference router (weights to 1e-12) and the runtime's torch router (ids) give
    the modeling code's choice: ids compared as sets per token, weights matched by id."""
    ids, w = reference_route(logits, cfg, bias)
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices),
                               rtol=1e-12, atol=0)
    b = None if bias is None else bias.float()
    r = route(logits, cfg, b, id_dtype=torch.int64, backend="torch")  # the runtime's path
    assert torch.equal(r.topk_ids_TK.sort(-1).values, want_order.values)
