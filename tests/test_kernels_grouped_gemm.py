"""Triton grouped GEMM (contiguous and masked layouts, every recipe) against a torch fp32
reference built from the dequantized operands (quant.dequantize_act / dequantize_weight).

Tolerance: the reference sees the same quantized operands, so the only differences are fp32
summation order and the final bf16 cast: max |err| <= 1e-2 * max |ref| per test case."""

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.kernels.grouped_gemm import (triton_m_grouped_gemm_nt_contiguous,
                                        triton_m_grouped_gemm_nt_masked)
from epmoe.layout import make_contiguous_layout, permute_qtensor
from epmoe.quant import dequantize_act, dequantize_weight, quantize_act, quantize_weight

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [("bf16", "fp32"), ("fp8_block", "fp32"), ("fp8_block", "ue8m0_fp32"),
         ("fp8_block", "ue8m0_packed"), ("mxfp8", "fp32"), ("w4a8_mxfp4", "fp32")]


def _weights(e, n, k, quant):
    return quantize_weight(torch.randn(e, n, k, device=DEV) / k ** 0.5, quant)


def _rel_err(y, ref):
    return float((y.float() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("recipe,fmt", CASES)
def test_contiguous_matches_dequantized_reference(recipe, fmt, seed):
    n_tok, top_k, e, n, k, align = 40, 2, 4, 256, 256, 32
    quant = QuantConfig(recipe, fmt)
    w = _weights(e, n, k, quant)
    ids = torch.randint(0, e, (n_tok, top_k), dtype=torch.int32, device=DEV)
    ids[0, 0] = -1
    lay = make_contiguous_layout(ids, e, align)
    x = quantize_act(torch.randn(n_tok, k, device=DEV), QuantConfig(recipe))
    xq = permute_qtensor(x, lay)
    if fmt != "fp32":  # quantize the permuted rows in the scale format under test
        xq = quantize_act(dequantize_act(xq), quant)
    y = triton_m_grouped_gemm_nt_contiguous(xq, w, lay)
    wf, xf = dequantize_weight(w), dequantize_act(xq)
    valid = lay.row_expert_M >= 0
    re = lay.row_expert_M.long()
    ref = torch.einsum("mk,mnk->mn", xf[valid], wf[re[valid]])
    err = _rel_err(y[valid], ref)
    print(f"{recipe=} {fmt=} M={lay.num_rows} {n=} {k=} {e=} rel err {err:.2e}")
    assert y.dtype == torch.bfloat16 and y.shape == (lay.num_rows, n)
    assert err <= 1e-2


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block", "mxfp8", "w4a8_mxfp4"])
def test_masked_matches_dequantized_reference(recipe, seed):
    e, cap, n, k = 3, 48, 256, 384
    quant = QuantConfig(recipe)
    w = _weights(e, n, k, quant)
    counts = torch.tensor([48, 0, 17], dtype=torch.int32, device=DEV)
    x = quantize_act(torch.randn(e, cap, k, device=DEV), quant)
    y = triton_m_grouped_gemm_nt_masked(x, w, counts, block_m=16)
    ref = torch.einsum("eck,enk->ecn", dequantize_act(x), dequantize_weight(w))
    for j, c in enumerate(counts.tolist()):
        if c:
            assert _rel_err(y[j, :c], ref[j, :c]) <= 1e-2


def test_contiguous_rejects_block_m_straddling_experts():
    quant = QuantConfig("bf16")
    w = _weights(2, 64, 64, quant)
    lay = make_contiguous_layout(torch.tensor([[0], [1]], dtype=torch.int32, device=DEV), 2, 16)
    x = quantize_act(torch.randn(lay.num_rows, 64, device=DEV), quant)
    with pytest.raises(ValueError, match=r"BLOCK_M \(64\) must divide the layout's alignment"):
        triton_m_grouped_gemm_nt_contiguous(x, w, lay, block_m=64)
    with pytest.raises(ValueError, match=r"activation recipe \('fp8_block'\) must match"):
        xq = quantize_act(torch.randn(lay.num_rows, 128, device=DEV), QuantConfig("fp8_block"))
        triton_m_grouped_gemm_nt_contiguous(xq, w, lay)
