"""Checking a router against a model's modeling code re-written in float64."""

from __future__ import annotations

import torch

from epmoe.reference import reference_route
from epmoe.router import route


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
