"""triton_unpermute_reduce / triton_gather_masked_reduce (ep_gather) against epmoe.layout.

Tolerance: bf16 output of an fp32 sum of O(1) values: atol 1e-2, rtol 1e-2 (about 1 bf16 ulp);
and the cast is a rounding to nearest: the output is the bf16 nearest the fp32 sum taken in
slot order, bit for bit on CPU (the interpreter, no FMA), all but 0.1% of elements on a GPU
(whose compiler may fuse the multiply-add)."""

import pytest
import torch

from epmoe.kernels.gather import triton_gather_masked_reduce, triton_unpermute_reduce
from epmoe.layout import (gather_masked_reduce, make_contiguous_layout, make_masked_layout,
                          unpermute_reduce)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(n, k, e):
    ids = torch.randint(0, e, (n, k), dtype=torch.int32)
    ids[torch.rand(n, k) < 0.2] = -1
    return ids.to(DEV)


@pytest.mark.parametrize("weighted", [True, False])
def test_unpermute_reduce_matches_reference(weighted, seed):
    n, k, e, d = 50, 4, 6, 320
    ids = _ids(n, k, e)
    lay = make_contiguous_layout(ids, e, alignment=16)
    y = torch.randn(lay.num_rows, d, device=DEV).to(torch.bfloat16)
    y[lay.row_expert_M < 0] = float("nan")  # poisoned padding rows must never be read
    w = torch.rand(n, k, device=DEV) if weighted else None
    out = triton_unpermute_reduce(y, lay, w)
    ref = unpermute_reduce(y, lay, w)
    assert out.dtype == torch.bfloat16 and out.shape == (n, d)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    print(f"{n=} {k=} {e=} {d=} {weighted=} max err {(out.float() - ref.float()).abs().max():.2e}")
    _check_rounded(out, y, lay.inv_perm_NK, w)


def _check_rounded(out, y_RD, rows_NK, w_NK):
    """out == the bf16 nearest the fp32 sum of w_k * y_k in slot order (valid slots only)."""
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for k in range(rows_NK.shape[1]):
        r = rows_NK[:, k].long()
        v = torch.where((r >= 0)[:, None], y_RD[r.clamp(min=0)].float(), 0.0)
        acc = acc + (v if w_NK is None else v * w_NK[:, k, None].float())
    same = out == acc.to(torch.bfloat16)
    if DEV == "cpu":
        assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} not rounded to nearest"
    else:
        assert float((~same).float().mean()) <= 1e-3


def test_gather_masked_reduce_matches_reference(seed):
    n, k, e, d, cap = 40, 4, 5, 256, 64
    ids = _ids(n, k, e)
    lay = make_masked_layout(ids, e, cap)
    y = torch.randn(e, cap, d, device=DEV).to(torch.bfloat16)
    for j, c in enumerate(lay.counts_E.tolist()):
        y[j, c:] = float("nan")  # rows past each count must never be read
    w = torch.rand(n, k, device=DEV)
    out = triton_gather_masked_reduce(y, lay, w)
    ref = gather_masked_reduce(y, lay, w)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    _check_rounded(out, y.view(e * cap, d), lay.slot_NK, w)


def test_unpermute_rejects_mismatched_weights():
    ids = _ids(8, 2, 3)
    lay = make_contiguous_layout(ids, 3, alignment=16)
    y = torch.randn(lay.num_rows, 64, device=DEV).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"topk_weights_NK shape \(8, 3\) must match"):
        triton_unpermute_reduce(y, lay, torch.rand(8, 3, device=DEV))
    with pytest.raises(ValueError, match=r"y_MD shape .* must be \[M, D\]"):
        triton_unpermute_reduce(y[:-1], lay, None)
