"""The comm contract's types: the three batch kinds through `Experts.run`, and `CommContext`.

Each batch type has one meaning (comm/base.py): a TokenBatch comes back as the weighted sum per
token, a LayoutBatch / MaskedBatch as unweighted rows. Checked against the float64 oracle's
expert MLP on fresh random inputs, with outputs poisoned where the contract says "any value".
"""

from __future__ import annotations

import pytest
import torch

from epmoe.comm import CommContext, LayoutBatch, MaskedBatch, TokenBatch
from epmoe.config import QuantConfig, get_preset
from epmoe.experts.torch_experts import TorchExperts
from epmoe.layout import make_contiguous_layout, make_masked_layout, scatter_masked
from epmoe.quant import dequantize_act, dequantize_weight, quantize_act
from epmoe.reference import TOLERANCE, expert_mlp_ref
from epmoe.weights import synthetic_layer

CFG = get_preset("deepseek-v3-tiny")
QUANT = QuantConfig("fp8_block")
E_LOCAL = 4


def _setup(seed: int):
    lw = synthetic_layer(CFG, QUANT, 0, seed, list(range(E_LOCAL)))
    experts = TorchExperts(lw.experts, CFG, QUANT)
    g = torch.Generator().manual_seed(seed)
    n, k = 9, CFG.top_k
    x = torch.randn(n, CFG.hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, E_LOCAL, (n, k), generator=g, dtype=torch.int32)
    w = torch.rand(n, k, generator=g)
    return lw, experts, quantize_act(x, QUANT), ids, w


def _oracle_rows(lw, xq, e: int) -> torch.Tensor:
    """float64 expert e applied to every row of xq."""
    w13 = dequantize_weight(lw.experts.w13)[e].double()
    w2 = dequantize_weight(lw.experts.w2)[e].double()
    return expert_mlp_ref(dequantize_act(xq).double(), w13, w2, CFG, QUANT)


def _poison_rows(xq, rows_mask):
    """fp8 NaN codes and NaN scales in the rows the contract says may hold any value."""
    data, scale = xq.data.clone(), xq.scale.clone()
    data.view(torch.uint8)[rows_mask] = 0x7F
    scale[rows_mask] = float("nan")
    return type(xq)(data, scale, xq.recipe, xq.group, xq.scale_fmt)


def _rel(a, b) -> float:
    return float((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("seed", [0, 1])
def test_token_batch_returns_the_weighted_sum_per_token(seed):
    lw, experts, xq, ids, w = _setup(seed)
    out = experts.run(TokenBatch(xq, ids, w))
    want = torch.zeros(ids.shape[0], CFG.hidden, dtype=torch.float64)
    for e in range(E_LOCAL):
        y = _oracle_rows(lw, xq, e)
        want += ((ids == e).double() * w.double()).sum(1)[:, None] * y
    assert out.shape == want.shape
    assert _rel(out, want) <= TOLERANCE[QUANT.recipe]


@pytest.mark.parametrize("seed", [0, 1])
def test_layout_batch_returns_unweighted_rows_in_layout_order(seed):
    lw, experts, xq, ids, w = _setup(seed)
    layout = make_contiguous_layout(ids, E_LOCAL, experts.alignment)
    xp = _poison_rows(experts.permute(xq, layout), layout.row_expert_M < 0)
    y = experts.run(LayoutBatch(xp, layout))
    assert y.shape == (layout.num_rows, CFG.hidden) and y.dtype == torch.bfloat16
    token_of_row = torch.full((layout.num_rows,), -1, dtype=torch.long)
    for (n, k), row in zip(ids.new_ones(ids.shape).nonzero().tolist(),
                           layout.inv_perm_NK.flatten().tolist()):
        if row >= 0:
            token_of_row[row] = n
    for e in range(E_LOCAL):
        rows = (layout.row_expert_M == e).nonzero().flatten()
        assert rows.numel() and (token_of_row[rows] >= 0).all(), e
        want = _oracle_rows(lw, xq.index_select(token_of_row[rows]), e)
        assert _rel(y[rows], want) <= TOLERANCE[QUANT.recipe], e


def test_masked_batch_returns_unweighted_rows_per_expert():
    lw, experts, xq, ids, w = _setup(2)
    cap = ids.numel()  # an expert may take a token twice (duplicate slots)
    lay = make_masked_layout(ids, E_LOCAL, cap)
    scale = scatter_masked(xq.scale, lay)
    x_ecd = type(xq)(scatter_masked(xq.data, lay), scale, xq.recipe, xq.group, xq.scale_fmt)
    past = torch.arange(cap)[None, :] >= lay.counts_E.long()[:, None]
    x_ecd = _poison_rows(x_ecd, past)
    y = experts.run(MaskedBatch(x_ecd, lay.counts_E))
    assert y.shape == (E_LOCAL, cap, CFG.hidden)
    for e in range(E_LOCAL):
        n = int(lay.counts_E[e])
        toks = [t for t in range(ids.shape[0]) for k in range(ids.shape[1])
                if int(ids[t, k]) == e]  # the masked layout keeps (token, k) order
        assert n == len(toks) > 0, e
        want = _oracle_rows(lw, xq.index_select(torch.tensor(toks, dtype=torch.long)), e)
        assert _rel(y[e, :n], want) <= TOLERANCE[QUANT.recipe], e


def test_experts_run_refuses_other_types_and_foreign_layouts():
    _, experts, xq, ids, w = _setup(3)
    with pytest.raises(TypeError, match="TokenBatch, LayoutBatch or MaskedBatch, got tuple"):
        experts.run((xq, ids, w))
    layout = make_contiguous_layout(ids.clamp(max=2), 3, experts.alignment)
    with pytest.raises(ValueError, match=r"layout has 3 experts, these experts hold 4"):
        experts.run(LayoutBatch(xq, layout))


class _Res:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def close(self):
        self.log.append(self.name)


def test_comm_context_makes_each_resource_once_and_closes_in_reverse():
    log, made = [], []
    ctx = CommContext(max_tokens_per_rank=8)

    def make(name):
        made.append(name)
        return _Res(log, name)

    a = ctx.resource("a", lambda: make("a"))
    assert ctx.resource("a", lambda: make("a-again")) is a
    ctx.resource("b", lambda: make("b"))
    assert made == ["a", "b"] and ctx.has("a")
    ctx.close()
    assert log == ["b", "a"] and not ctx.has("a")


def test_comm_context_validates():
    with pytest.raises(ValueError, match=r"rank \(2\) must lie in \[0, world=2\)"):
        CommContext(rank=2, world=2)
    with pytest.raises(ValueError, match=r"max_tokens_per_rank \(-1\) must be >= 0"):
        CommContext(max_tokens_per_rank=-1)


def test_every_experts_backend_is_concrete():
    """A backend whose methods slid out of its class body (e.g. under a module-level function)
    imports fine on CPU but cannot be built on the GPU: catch it here."""
    from epmoe.experts.deepgemm_experts import DeepGemmExperts
    from epmoe.experts.triton_experts import TritonExperts

    for cls in (TorchExperts, TritonExperts, DeepGemmExperts):
        assert not cls.__abstractmethods__, (cls.__name__, sorted(cls.__abstractmethods__))
        for name in ("run_contiguous", "run_masked", "apply", "run"):
            assert callable(getattr(cls, name)), (cls.__name__, name)
