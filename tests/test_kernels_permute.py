"""triton_permute (ep_scatter) against epmoe.layout's plain-torch layout: same counts and
offsets, every valid (token, slot) lands on a row of its expert holding its token and scales."""

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.kernels.permute import (PermuteWorkspace, _count_and_offsets,
                                   triton_layout_tokens, triton_make_contiguous_layout,
                                   triton_permute, triton_permute_rows)
from epmoe.layout import contiguous_rows_upper_bound, make_contiguous_layout, permute_qtensor
from epmoe.quant import QTensor, quantize_act, unpack_ue8m0

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(n, k, e, empty_frac=0.15, gen=None):
    ids = torch.randint(0, e, (n, k), generator=gen, dtype=torch.int32)
    ids[torch.rand(n, k, generator=gen) < empty_frac] = -1
    return ids.to(DEV)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _check_layout(lay, ref, x, out, local_ids):
    assert torch.equal(lay.counts_E.cpu(), ref.counts_E.cpu())
    assert torch.equal(lay.offsets_E1.cpu(), ref.offsets_E1.cpu())
    assert lay.alignment == ref.alignment
    a = lay.alignment
    assert all(int(o) % a == 0 for o in lay.offsets_E1)
    inv, ids, rexp = lay.inv_perm_NK.long().cpu(), local_ids.long().cpu(), lay.row_expert_M.cpu()
    assert torch.equal(inv < 0, ids < 0), "-1 slots (and non-local experts) must be skipped"
    valid = inv >= 0
    rows = inv[valid]
    assert rows.unique().numel() == rows.numel(), "two pairs share a row"
    assert torch.equal(rexp[rows].long(), ids[valid])
    # padding rows: -1 everywhere but the valid rows
    mask = torch.ones(lay.num_rows, dtype=torch.bool)
    mask[rows] = False
    assert bool((rexp[mask] == -1).all())
    # each group's valid rows are its first counts[e] rows
    for e in range(lay.num_experts):
        s, c = int(lay.offsets_E1[e]), int(lay.counts_E[e])
        assert bool((rexp[s:s + c] == e).all())
    if x is not None:
        tok = torch.arange(ids.shape[0]).repeat_interleave(ids.shape[1]).view_as(ids)[valid]
        assert torch.equal(_bits(out.data).cpu()[rows], _bits(x.data).cpu()[tok])
        if x.scale is not None:
            if x.scale_fmt == "ue8m0_packed":
                g = x.data.shape[1] // x.group
                sp, sx = unpack_ue8m0(out.scale.cpu(), g), unpack_ue8m0(x.scale.cpu(), g)
                assert out.scale.stride() == (1, (lay.num_rows + 3) // 4 * 4)
            else:
                sp, sx = _bits(out.scale).cpu(), _bits(x.scale).cpu()
            assert torch.equal(sp[rows], sx[tok])


@pytest.mark.parametrize("recipe,fmt", [("bf16", "fp32"), ("fp8_block", "fp32"),
                                        ("fp8_block", "ue8m0_packed"), ("mxfp8", "fp32")])
@pytest.mark.parametrize("alignment", [128, 16])
def test_permute_matches_layout(recipe, fmt, alignment, seed):
    n, k, e, d = 48, 4, 6, 256
    x = quantize_act(torch.randn(n, d, device=DEV) * 3, QuantConfig(recipe, fmt))
    ids = _ids(n, k, e)
    out, lay = triton_permute(x, ids, e, alignment=alignment)
    ref = make_contiguous_layout(ids, e, alignment)
    assert lay.num_rows == ref.num_rows
    _check_layout(lay, ref, x, out, ids)
    print(f"{recipe=} {fmt=} {alignment=} {n=} {k=} {e=} M={lay.num_rows}")


def test_permute_fp32_mn_major_scales_keep_layout(seed):
    n, k, e, d = 40, 2, 4, 384
    x = quantize_act(torch.randn(n, d, device=DEV), QuantConfig("fp8_block"))
    ld = (n + 3) // 4 * 4
    col = torch.empty_strided((n, d // 128), (1, ld), dtype=torch.float32, device=DEV)
    col.copy_(x.scale)
    xc = type(x)(x.data, col, x.recipe, x.group, x.scale_fmt)
    ids = _ids(n, k, e)
    out, lay = triton_permute(xc, ids, e, alignment=32)
    assert out.scale.stride() == (1, (lay.num_rows + 3) // 4 * 4)
    _check_layout(lay, make_contiguous_layout(ids, e, 32), xc, out, ids)


def test_permute_upper_bound_rows_no_sync_size(seed):
    n, k, e = 32, 8, 8
    x = quantize_act(torch.randn(n, 128, device=DEV), QuantConfig("fp8_block"))
    ids = _ids(n, k, e, empty_frac=0.0)
    bound = contiguous_rows_upper_bound(n * k, e, 16)
    out, lay = triton_permute(x, ids, e, alignment=16, num_rows=bound)
    assert lay.num_rows == bound and out.data.shape[0] == bound
    _check_layout(lay, make_contiguous_layout(ids, e, 16, num_rows=bound), x, out, ids)
    with pytest.raises(ValueError, match=r"num_rows \(16\) is below the worst case"):
        triton_permute(x, ids, e, alignment=16, num_rows=16)


def test_permute_expert_map_skips_remote_experts(seed):
    n, k, e_global = 40, 4, 16
    local = torch.tensor([3, 7, 8, 12, 15], dtype=torch.int64)  # experts on this rank
    emap = torch.full((e_global,), -1, dtype=torch.int32)
    emap[local] = torch.arange(local.numel(), dtype=torch.int32)
    gids = _ids(n, k, e_global)
    x = quantize_act(torch.randn(n, 256, device=DEV), QuantConfig("w4a8_mxfp4"))
    out, lay = triton_permute(x, gids, local.numel(), alignment=16, expert_map=emap.to(DEV))
    lids = torch.where(gids >= 0, emap.to(DEV)[gids.long().clamp(min=0)], -1)
    ref = make_contiguous_layout(lids, local.numel(), 16)
    _check_layout(lay, ref, x, out, lids)


@pytest.mark.parametrize("mapped", [False, True], ids=["local-ids", "expert-map"])
def test_layout_tokens_index_every_row(mapped, seed):
    """triton_layout_tokens: the layout triton_permute builds and, per layout row, the token
    it holds (-1 on padding), written over a poisoned index on one workspace at two sizes (a
    stale entry must not survive); the workspace holds no rows at all."""
    k, e_global, cap = 4, 16, 40
    local = torch.tensor([3, 7, 8, 12, 15]) if mapped else torch.arange(e_global)
    e = local.numel()
    emap = torch.full((e_global,), -1, dtype=torch.int32)
    emap[local] = torch.arange(e, dtype=torch.int32)
    ws = PermuteWorkspace.create(cap, k, e, 16, 256, QuantConfig("bf16"), DEV,
                                 copies_rows=False)
    assert ws.data_flat.numel() == 0 and ws.scale_flat is None
    with pytest.raises(ValueError, match="holds no rows"):
        ws.rows(4)
    for n in (cap, 9):
        ws.token_R.fill_(12345)
        gids = _ids(n, k, e_global)
        lay, tok = triton_layout_tokens(gids, e, 16, emap.to(DEV) if mapped else None,
                                        workspace=ws)
        lids = torch.where(gids >= 0, emap.to(DEV)[gids.long().clamp(min=0)], -1)
        _check_layout(lay, make_contiguous_layout(lids, e, 16), None, None, lids)
        inv = lay.inv_perm_NK.long().cpu()
        valid = inv >= 0
        want = torch.full((lay.num_rows,), -1, dtype=torch.int32)
        want[inv[valid]] = torch.arange(n).repeat_interleave(k).view(n, k)[valid].int()
        assert tok.dtype == torch.int32 and tok.data_ptr() == ws.token_R.data_ptr()
        assert torch.equal(tok.cpu(), want)
    lay, tok = triton_layout_tokens(gids[:0], e, 16, emap.to(DEV) if mapped else None)
    assert lay.num_rows == 0 and tok.shape == (0,)


def test_permute_rows_by_existing_layout_equals_reference(seed):
    n, k, e = 32, 4, 5
    x = quantize_act(torch.randn(n, 256, device=DEV), QuantConfig("fp8_block", "ue8m0_fp32"))
    ids = _ids(n, k, e)
    lay = triton_make_contiguous_layout(ids, e, alignment=16)
    _check_layout(lay, make_contiguous_layout(ids, e, 16), None, None, ids)
    out = triton_permute_rows(x, lay)
    ref = permute_qtensor(x, lay)  # the torch permute on the same layout
    valid = lay.row_expert_M >= 0
    assert torch.equal(out.data.view(torch.uint8)[valid], ref.data.view(torch.uint8)[valid])
    assert torch.equal(out.scale[valid], ref.scale[valid])


def test_permute_rejects_bad_inputs():
    x = quantize_act(torch.randn(4, 128, device=DEV), QuantConfig("bf16"))
    with pytest.raises(ValueError, match=r"topk_ids_NK dtype \(torch.float32\)"):
        triton_permute(x, torch.zeros(4, 2, device=DEV), 4)
    with pytest.raises(ValueError, match=r"x.data must be \[N, D\] with N"):
        triton_permute(x, torch.zeros(5, 2, dtype=torch.int32, device=DEV), 4)
    with pytest.raises(ValueError, match=r"alignment \(0\) must be a positive int"):
        triton_permute(x, torch.zeros(4, 2, dtype=torch.int32, device=DEV), 4, alignment=0)


@pytest.mark.parametrize("recipe,fmt,mn_major", [("fp8_block", "fp32", True),
                                                 ("fp8_block", "ue8m0_packed", False),
                                                 ("bf16", "fp32", False)])
def test_permute_workspace_reused_without_sync(recipe, fmt, mn_major, seed):
    """One workspace, three calls of different sizes: no allocation, the counting accumulator
    resets itself (a stale count would shift every offset), outputs are views into it."""
    e, d, k = 5, 128, 4
    quant = QuantConfig(recipe, fmt)
    ws = PermuteWorkspace.create(max_tokens=24, top_k=k, num_experts=e, alignment=16,
                                 hidden=d, quant=quant, device=DEV, mn_major=mn_major)
    ws.data_flat.view(torch.uint8).fill_(0xFF)  # poison
    for n in (24, 5):
        x = quantize_act(torch.randn(n, d, device=DEV), quant)
        if mn_major:
            col = torch.empty_strided(x.scale.shape, (1, (n + 3) // 4 * 4), device=DEV)
            x = type(x)(x.data, col.copy_(x.scale), x.recipe, x.group, x.scale_fmt)
        ids = _ids(n, k, e)
        out, lay = triton_permute(x, ids, e, alignment=16, workspace=ws)
        assert lay.num_rows == contiguous_rows_upper_bound(n * k, e, 16)
        assert out.data.data_ptr() == ws.data_flat.data_ptr()
        assert lay.counts_E.data_ptr() == ws.counts_E.data_ptr()
        _check_layout(lay, make_contiguous_layout(ids, e, 16), x, out, ids)
        assert int(ws.hist_B.abs().sum()) == 0 and int(ws.ticket_1) == 0


def test_permute_counts_over_many_histogram_programs(seed):
    """Counting split over 5 programs that meet through the atomic ticket, twice on one
    workspace (the last program must leave the accumulator and the ticket at zero)."""
    n, k, e = 40, 8, 7
    ids = _ids(n, k, e)
    ws = PermuteWorkspace.create(n, k, e, 16, 128, QuantConfig("bf16"), DEV)
    bufs = (ws.hist_B, ws.ticket_1, ws.counts_E, ws.offsets_E1, ws.cursor_E)
    ref = make_contiguous_layout(ids, e, 16)
    for _ in range(2):
        ws.counts_E.fill_(-7)
        _count_and_offsets(ids, e, 16, None, bufs, chunk=64)
        assert torch.equal(ws.counts_E.cpu(), ref.counts_E.cpu())
        assert torch.equal(ws.offsets_E1.cpu(), ref.offsets_E1.cpu())
        assert torch.equal(ws.cursor_E.cpu(), ref.offsets_E1[:-1].cpu())
        assert int(ws.hist_B.abs().sum()) == 0 and int(ws.ticket_1) == 0


def test_permute_workspace_rejects_mismatches():
    ws = PermuteWorkspace.create(8, 2, 4, 16, 256, QuantConfig("fp8_block"), DEV)
    x = quantize_act(torch.randn(8, 256, device=DEV), QuantConfig("fp8_block", "ue8m0_packed"))
    ids = torch.zeros(8, 2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"does not match the workspace \(fp8_block/fp32"):
        triton_permute(x, ids, 4, alignment=16, workspace=ws)
    x8 = quantize_act(torch.randn(8, 256, device=DEV), QuantConfig("fp8_block"))
    x = quantize_act(torch.randn(9, 256, device=DEV), QuantConfig("fp8_block"))
    with pytest.raises(ValueError, match=r"18 \(token, slot\) pairs exceed the workspace's "):
        triton_permute(x, torch.zeros(9, 2, dtype=torch.int32, device=DEV), 4, alignment=16,
                       workspace=ws)
    with pytest.raises(ValueError, match=r"workspace was made for 4 experts at alignment 16"):
        triton_permute(x8, ids, 4, alignment=32, workspace=ws)


@pytest.mark.gpu
def test_permute_workspace_at_deepseek_shape(seed):
    t, k, e, d = 4096, 8, 32, 7168
    quant = QuantConfig("fp8_block")
    ws = PermuteWorkspace.create(t, k, e, 128, d, quant, DEV)
    x = quantize_act(torch.randn(t, d, device=DEV), quant)
    for n in (t, 1000):
        ids = _ids(n, k, e, empty_frac=0.05)
        out, lay = triton_permute(QTensor(x.data[:n], x.scale[:n], x.recipe, x.group),
                                  ids, e, alignment=128, workspace=ws)
        _check_layout(lay, make_contiguous_layout(ids, e, 128),
                      QTensor(x.data[:n], x.scale[:n], x.recipe, x.group), out, ids)
