"""epmoe.layout: contiguous and masked layouts as properties over random routings (hypothesis).

Routings are drawn with empty experts, single-expert batches and -1 (empty) slots; every layout
must be a bijection between valid (token, k) pairs and its non-padding rows."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epmoe.layout import (
    contiguous_rows_upper_bound, gather_masked_reduce, make_contiguous_layout,
    make_masked_layout, permute_rows, scatter_masked, unpermute_reduce,
)

ALIGNMENTS = (1, 4, 16, 128)


@st.composite
def routings(draw):
    """(topk_ids [N, K] int32/int64 in [-1, E), E): uniform, one-expert, or sparse routings."""
    n = draw(st.integers(0, 40))
    k = draw(st.integers(1, 4))
    e = draw(st.integers(1, 12))
    mode = draw(st.sampled_from(["uniform", "one_expert", "few_experts"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if mode == "one_expert":
        ids = torch.full((n, k), draw(st.integers(0, e - 1)), dtype=torch.long)
    elif mode == "few_experts":  # most experts empty
        pool = torch.randperm(e, generator=g)[:max(1, e // 4)]
        ids = pool[torch.randint(0, len(pool), (n, k), generator=g)]
    else:
        ids = torch.randint(0, e, (n, k), generator=g)
    p_empty = draw(st.sampled_from([0.0, 0.3, 1.0]))
    ids[torch.rand(n, k, generator=g) < p_empty] = -1
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return ids.to(dtype), e


def _check_contiguous(lay, ids, e, alignment):
    n, k = ids.shape
    idsl = ids.long()
    valid = idsl >= 0
    inv = lay.inv_perm_NK.long()
    assert lay.inv_perm_NK.shape == (n, k) and lay.inv_perm_NK.dtype == torch.int32
    assert lay.row_expert_M.dtype == torch.int32 and lay.alignment == alignment
    # -1 exactly on empty slots; every valid pair has a distinct row holding its expert
    assert torch.equal(inv >= 0, valid)
    rows = inv[valid]
    assert rows.unique().numel() == rows.numel(), "two pairs share a row"
    assert torch.equal(lay.row_expert_M.long()[rows], idsl[valid])
    # every non-padding row is some pair's row (bijection), padding rows are -1
    non_pad = (lay.row_expert_M >= 0).nonzero().reshape(-1)
    assert torch.equal(non_pad.sort().values, rows.sort().values)
    # counts, aligned offsets, groups contiguous and in token order
    counts = torch.bincount(idsl[valid], minlength=e)
    assert torch.equal(lay.counts_E.long(), counts)
    offs = lay.offsets_E1.long()
    assert offs[0] == 0 and bool((offs % alignment == 0).all())
    assert torch.equal(offs[1:] - offs[:-1], (counts + alignment - 1) // alignment * alignment)
    for x in range(e):
        grp = lay.row_expert_M[offs[x]:offs[x + 1]].long()
        c = int(counts[x])
        assert bool((grp[:c] == x).all()) and bool((grp[c:] == -1).all())
        flat_pairs = (inv.reshape(-1) >= offs[x]) & (inv.reshape(-1) < offs[x] + c)
        assert torch.equal(inv.reshape(-1)[flat_pairs],
                           torch.arange(int(offs[x]), int(offs[x]) + c)), "not token order"
    assert bool((lay.row_expert_M[int(offs[-1]):] == -1).all())


@settings(max_examples=40, deadline=None)
@given(routings(), st.sampled_from(ALIGNMENTS))
def test_contiguous_layout_is_a_bijection(routing, alignment):
    ids, e = routing
    lay = make_contiguous_layout(ids, e, alignment)
    assert lay.num_rows == int(lay.offsets_E1[-1]) and lay.num_experts == e
    _check_contiguous(lay, ids, e, alignment)


@settings(max_examples=40, deadline=None)
@given(routings(), st.sampled_from(ALIGNMENTS), st.integers(0, 3))
def test_contiguous_layout_upper_bound_rows(routing, alignment, extra):
    ids, e = routing
    bound = contiguous_rows_upper_bound(ids.numel(), e, alignment) + extra
    lay = make_contiguous_layout(ids, e, alignment, num_rows=bound)
    assert lay.num_rows == bound
    _check_contiguous(lay, ids, e, alignment)
    exact = make_contiguous_layout(ids, e, alignment)
    assert torch.equal(lay.inv_perm_NK, exact.inv_perm_NK)
    assert torch.equal(lay.row_expert_M[:exact.num_rows], exact.row_expert_M)
    if exact.num_rows:
        with pytest.raises(ValueError, match=rf"num_rows \({exact.num_rows - 1}\) is below the "
                                             rf"{exact.num_rows} rows this routing needs"):
            make_contiguous_layout(ids, e, alignment, num_rows=exact.num_rows - 1)


@settings(max_examples=40, deadline=None)
@given(routings(), st.sampled_from(ALIGNMENTS), st.booleans(), st.integers(0, 2**31 - 1))
def test_permute_then_unpermute_reduce_is_weighted_sum(routing, alignment, weighted, seed):
    ids, e = routing
    n, k = ids.shape
    g = torch.Generator().manual_seed(seed)
    d = 8
    x = torch.randn(n, d, generator=g)
    # "expert" e maps a row to row * (e + 1) + e; the layout must bring each row to its expert
    lay = make_contiguous_layout(ids, e, alignment)
    xp = permute_rows(x, lay)
    assert xp.shape == (lay.num_rows, d)
    pad = lay.row_expert_M < 0
    assert bool((xp[pad] == 0).all()), "padding rows must be zero"
    ex = lay.row_expert_M.float().clamp(min=0)[:, None]
    y = xp * (ex + 1) + ex
    y[pad] = float("nan")  # poison: padding rows must never be read
    w = torch.rand(n, k, generator=g) if weighted else None
    out = unpermute_reduce(y, lay, w, out_dtype=torch.float32)
    want = torch.zeros(n, d)
    for i in range(n):
        for j in range(k):
            x_e = int(ids[i, j])
            if x_e >= 0:
                want[i] += (1.0 if w is None else w[i, j]) * (x[i] * (x_e + 1) + x_e)
    torch.testing.assert_close(out, want, msg=f"{seed=}")


@settings(max_examples=40, deadline=None)
@given(routings(), st.integers(0, 2**31 - 1))
def test_masked_layout_slots_unique_and_roundtrip(routing, seed):
    ids, e = routing
    n, k = ids.shape
    idsl = ids.long()
    valid = idsl >= 0
    counts = torch.bincount(idsl[valid], minlength=e)
    cap = max(1, int(counts.max()) if counts.numel() else 1)
    lay = make_masked_layout(ids, e, cap)
    assert lay.capacity == cap and torch.equal(lay.counts_E.long(), counts)
    slot = lay.slot_NK.long()
    assert torch.equal(slot >= 0, valid)
    s = slot[valid]
    assert s.unique().numel() == s.numel(), "two pairs share a slot"
    assert torch.equal(s // cap, idsl[valid]), "slot not in its expert's block"
    assert bool((s % cap < counts[idsl[valid]]).all()), "slot past its expert's count"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    xs = scatter_masked(x, lay)
    assert xs.shape == (e, cap, 8)
    past = torch.arange(cap)[None, :] >= counts[:, None]
    assert bool((xs[past] == 0).all()), "rows past a count must be zero"
    y = xs * 2.0
    y[past] = float("nan")  # rows past a count are garbage to the combine
    w = torch.rand(n, k, generator=g)
    out = gather_masked_reduce(y, lay, w, out_dtype=torch.float32)
    want = 2.0 * x * (w * valid).sum(-1, keepdim=True)
    torch.testing.assert_close(out, want, msg=f"{seed=}")


def test_masked_capacity_overflow_raises():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"expert 0 received 3 tokens, over the masked layout's "
                                         r"capacity \(2\); raise the capacity .* to at least 3"):
        make_masked_layout(ids, 4, 2)
    make_masked_layout(ids, 4, 3)


def test_fp8_rows_permute_bytes_exactly(seed):
    ids = torch.randint(-1, 5, (24, 3), dtype=torch.int32)
    x = (torch.randn(24, 64) * 10).to(torch.float8_e4m3fn)
    lay = make_contiguous_layout(ids, 5, 16)
    xp = permute_rows(x, lay)
    assert xp.dtype == torch.float8_e4m3fn
    inv = lay.inv_perm_NK.long()
    for n, k in (inv >= 0).nonzero().tolist():
        assert torch.equal(xp[inv[n, k]].view(torch.uint8), x[n].view(torch.uint8)), f"{seed=}"
    ml = make_masked_layout(ids, 5, 24 * 3)
    xs = scatter_masked(x, ml)
    assert xs.dtype == torch.float8_e4m3fn
    slot = ml.slot_NK.long()
    for n, k in (slot >= 0).nonzero().tolist():
        assert torch.equal(xs.reshape(-1, 64)[slot[n, k]].view(torch.uint8),
                           x[n].view(torch.uint8)), f"{seed=}"


def test_zero_tokens():
    ids = torch.zeros(0, 4, dtype=torch.int32)
    lay = make_contiguous_layout(ids, 8, 16)
    assert lay.num_rows == 0 and lay.counts_E.sum() == 0
    out = unpermute_reduce(torch.zeros(0, 8), lay, torch.zeros(0, 4))
    assert out.shape == (0, 8)


def test_all_slots_empty_with_upper_bound_rows():
    """Every slot -1 (no token on this rank's experts), rows allocated by the upper bound: the
    combine must give exact zeros whatever the (garbage) rows hold."""
    ids = torch.full((6, 2), -1, dtype=torch.int32)
    lay = make_contiguous_layout(ids, 4, 16, num_rows=contiguous_rows_upper_bound(12, 4, 16))
    y = torch.full((lay.num_rows, 8), float("nan"))
    out = unpermute_reduce(y, lay, torch.rand(6, 2), out_dtype=torch.float32)
    assert torch.equal(out, torch.zeros(6, 8))
    exact = make_contiguous_layout(ids, 4, 16)
    assert exact.num_rows == 0
    assert torch.equal(unpermute_reduce(torch.zeros(0, 8), exact, None, torch.float32),
                       torch.zeros(6, 8))


def test_ids_out_of_range_raise():
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[-1, 4\) \(-1 = empty slot\), "
                                         r"got \[0, 4\]"):
        make_contiguous_layout(torch.tensor([[0, 4]], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[-1, 4\).*got \[-2, 1\]"):
        make_contiguous_layout(torch.tensor([[-2, 1]]), 4)
    with pytest.raises(ValueError, match=r"topk_ids must be a 2-D int32/int64 tensor"):
        make_contiguous_layout(torch.tensor([[0.0, 1.0]]), 4)
    with pytest.raises(ValueError, match=r"alignment \(0\) must be >= 1"):
        make_contiguous_layout(torch.tensor([[0, 1]]), 4, alignment=0)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[-1, 4\)"):
        make_masked_layout(torch.tensor([[0, 7]]), 4, 8)
