"""The W4A8 (e2m1 weights x e8m0 per 32, fp8 activations) grouped GEMM's in-kernel weight
decode, checked exactly: one-hot activations (fp8 1.0, scale 1.0) make each output one
weight, which must equal quant.dequantize_weight's value for every code at every scale whose
products stay in bf16's normal range, on the masked and the contiguous path."""

import torch

from epmoe.kernels.grouped_gemm import (triton_m_grouped_gemm_nt_contiguous,
                                        triton_m_grouped_gemm_nt_masked)
from epmoe.layout import make_contiguous_layout, permute_qtensor
from epmoe.quant import FP8_DTYPE, QTensor, QWeight, dequantize_weight

DEV = "cuda" if torch.cuda.is_available() else "cpu"
K = 128
SCALES = list(range(2, 253))  # e8m0 bytes whose products with every code stay normal in bf16


def _every_code_at_scales(scales: list[int]) -> QWeight:
    """One expert, a row per scale: row r's 4 groups of 32 hold every code (16 x 2 each),
    in a row-dependent order, all at e8m0 scale scales[r]."""
    n = len(scales)
    codes = (torch.arange(K)[None, :] + torch.arange(n)[:, None]) % 16  # [n, K]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scale = torch.tensor(scales, dtype=torch.uint8)[:, None].expand(n, K // 32).contiguous()
    return QWeight(packed[None].to(DEV), scale[None].to(DEV), "w4a8_mxfp4")


def _one_hot(m: int) -> QTensor:
    """m rows, row i = 1.0 at column i % K (fp8), activation scales 1.0."""
    x = torch.zeros(m, K)
    x[torch.arange(m), torch.arange(m) % K] = 1.0
    return QTensor(x.to(FP8_DTYPE).to(DEV), torch.ones(m, 1, device=DEV), "w4a8_mxfp4", 128,
                   "fp32")


def test_every_code_at_every_normal_scale_decodes_exactly_masked():
    w = _every_code_at_scales(SCALES)
    want = dequantize_weight(w)[0]  # fp32 [n, K]: exact, and exact in bf16
    assert torch.equal(want.bfloat16().float(), want)
    assert len(set(want.abs().unique().tolist())) > 100  # the codes times many scales
    x = _one_hot(K)
    y = triton_m_grouped_gemm_nt_masked(
        QTensor(x.data[None], x.scale, x.recipe, x.group, x.scale_fmt), w,
        torch.tensor([K], dtype=torch.int32, device=DEV))[0]
    assert torch.equal(y.float(), want.T)  # y[i, r] = w[r, i]


def test_every_code_decodes_exactly_contiguous():
    w = _every_code_at_scales(SCALES[::10])
    ids = torch.zeros(K, 1, dtype=torch.int32, device=DEV)
    lay = make_contiguous_layout(ids, 1, 32)
    y = triton_m_grouped_gemm_nt_contiguous(permute_qtensor(_one_hot(K), lay), w, lay)
    valid = lay.row_expert_M >= 0
    assert torch.equal(y[valid].float(), dequantize_weight(w)[0].T)
