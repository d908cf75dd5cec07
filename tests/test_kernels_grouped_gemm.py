"""Triton grouped GEMM (contiguous and masked layouts, every recipe) against a torch fp32
reference built from the dequantized operands (quant.dequantize_act / dequantize_weight).

Tolerance: the reference sees the same quantized operands, so the only differences are fp32
summation order and the final bf16 cast: max |err| <= 1e-2 * max |ref| per test case."""

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.kernels.grouped_gemm import (GemmConfig, triton_m_grouped_gemm_nt_contiguous,
                                        triton_m_grouped_gemm_nt_masked)
from epmoe.layout import contiguous_rows_upper_bound, make_contiguous_layout, permute_qtensor
from epmoe.quant import dequantize_act, dequantize_weight, quantize_act, quantize_weight

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [("bf16", "fp32"), ("fp8_block", "fp32"), ("fp8_block", "ue8m0_fp32"),
         ("fp8_block", "ue8m0_packed"), ("mxfp8", "fp32"), ("w4a8_mxfp4", "fp32")]


def _weights(e, n, k, quant):
    return quantize_weight(torch.randn(e, n, k, device=DEV) / k ** 0.5, quant)


def _rows(x, idx):
    """x's rows idx (any shape) with their scales, copied (packed UE8M0 scales row-major)."""
    idx = idx.long()
    return x.__class__(x.data[idx], None if x.scale is None else x.scale[idx], x.recipe,
                       x.group, x.scale_fmt)


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


TMA_CONFIGS = [GemmConfig(32, 128, 4, 3), GemmConfig(32, 256, 8, 3, group_m=2),
               GemmConfig(16, 128, 4, 3, persistent=False, tma_store=True)]


@pytest.mark.parametrize("cfg", TMA_CONFIGS, ids=["bn128", "bn256_split", "plain_tma_store"])
@pytest.mark.parametrize("recipe,fmt", [("bf16", "fp32"), ("fp8_block", "fp32"),
                                        ("fp8_block", "ue8m0_packed")])
def test_tma_kernel_configs_on_a_worst_case_layout(cfg, recipe, fmt, seed):
    """The TMA kernel in each tiling (128-wide, two 128-wide halves, non-persistent with a TMA
    store) on a layout sized for the worst case (rows past offsets[E] are never computed)
    against the dequantized reference; the output is poisoned first."""
    n_tok, top_k, e, n, k, align = 24, 2, 3, 256, 384, 32
    quant = QuantConfig(recipe, fmt)
    w = _weights(e, n, k, quant)
    ids = torch.randint(0, e, (n_tok, top_k), dtype=torch.int32, device=DEV)
    bound = contiguous_rows_upper_bound(n_tok * top_k, e, align)
    lay = make_contiguous_layout(ids, e, align, num_rows=bound)
    xq = quantize_act(torch.randn(lay.num_rows, k, device=DEV), quant)
    out = torch.full((lay.num_rows, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = triton_m_grouped_gemm_nt_contiguous(xq, w, lay, config=cfg, out=out, kernel="tma")
    assert y is out
    valid = lay.row_expert_M >= 0
    ref = torch.einsum("mk,mnk->mn", dequantize_act(xq)[valid],
                       dequantize_weight(w)[lay.row_expert_M.long()[valid]])
    assert _rel_err(y[valid], ref) <= 1e-2
    tail = int(lay.offsets_E1[-1])
    assert tail < lay.num_rows and bool(y[tail:].isnan().all()), "padding tiles were computed"


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_masked_tma_equals_pointer_kernel(recipe, seed):
    e, cap, n, k = 3, 40, 256, 256  # capacity not a multiple of BLOCK_M: 3-D TMA clips rows
    quant = QuantConfig(recipe)
    w = _weights(e, n, k, quant)
    counts = torch.tensor([40, 0, 23], dtype=torch.int32, device=DEV)
    x = quantize_act(torch.randn(e, cap, k, device=DEV), quant)
    cfg = GemmConfig(32, 256, 8, 3, tma_store=True)
    y_t = triton_m_grouped_gemm_nt_masked(x, w, counts, block_m=32, config=cfg, kernel="tma")
    y_p = triton_m_grouped_gemm_nt_masked(x, w, counts, block_m=32, kernel="pointer")
    for j, c in enumerate(counts.tolist()):
        if c:
            assert _rel_err(y_t[j, :c], y_p[j, :c].float()) <= 1e-2


def test_tma_kernel_refuses_mx_recipes():
    w = _weights(2, 128, 128, QuantConfig("mxfp8"))
    lay = make_contiguous_layout(torch.tensor([[0], [1]], dtype=torch.int32, device=DEV), 2, 16)
    x = quantize_act(torch.randn(lay.num_rows, 128, device=DEV), QuantConfig("mxfp8"))
    with pytest.raises(ValueError, match=r"the TMA kernel takes recipes bf16 / fp8_block"):
        triton_m_grouped_gemm_nt_contiguous(x, w, lay, kernel="tma")


def _per_expert_ref(x2d, w, row_expert):
    """fp32 reference from the dequantized operands, one matmul per expert (GPU-sized)."""
    xf, ref = dequantize_act(x2d), None
    ref = torch.zeros(x2d.data.shape[0], w.shape[1], device=DEV)
    for e in range(w.shape[0]):
        rows = (row_expert == e).nonzero().flatten()
        if rows.numel():
            ref[rows] = xf[rows] @ dequantize_weight(w.select([e]))[0].T
    return ref


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_block", "bf16"])
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048)], ids=["gemm1", "gemm2"])
def test_tma_kernel_at_deepseek_shapes(recipe, n, k, seed):
    """The tuned TMA kernel at DeepSeek-V3 GEMM shapes (32 experts, 1024 tokens x top-8) on a
    worst-case (no-sync) layout, output poisoned, against the dequantized fp32 reference."""
    e, t = 32, 1024
    quant = QuantConfig(recipe)
    w = _weights(e, n, k, quant)
    ids = torch.rand(t, e, device=DEV).argsort(1)[:, :8].to(torch.int32)
    lay = make_contiguous_layout(ids, e, 128, num_rows=contiguous_rows_upper_bound(t * 8, e,
                                                                                  128))
    x = quantize_act(torch.randn(lay.num_rows, k, device=DEV), quant)
    out = torch.full((lay.num_rows, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = triton_m_grouped_gemm_nt_contiguous(x, w, lay, out=out)
    valid = lay.row_expert_M >= 0
    ref = _per_expert_ref(x, w, lay.row_expert_M)
    assert _rel_err(y[valid], ref[valid]) <= 1e-2, f"{seed=}"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_block", "bf16"])
def test_masked_tma_store_at_deepseek_shape(recipe, seed):
    """Masked layout on CUDA (3-D descriptors clip each expert's rows at the capacity; the
    tuned configs store through TMA) against the dequantized fp32 reference."""
    e, cap, n, k = 8, 200, 4096, 7168
    quant = QuantConfig(recipe)
    w = _weights(e, n, k, quant)
    counts = torch.tensor([200, 0, 1, 129, 64, 77, 200, 5], dtype=torch.int32, device=DEV)
    x = quantize_act(torch.randn(e, cap, k, device=DEV), quant)
    y = triton_m_grouped_gemm_nt_masked(x, w, counts)
    flat = type(x)(x.data.view(e * cap, k), None if x.scale is None else
                   x.scale.reshape(e * cap, -1), x.recipe, x.group, x.scale_fmt)
    row_expert = torch.arange(e, device=DEV).repeat_interleave(cap)
    ref = _per_expert_ref(flat, w, row_expert).view(e, cap, n)
    for j, c in enumerate(counts.tolist()):
        if c:
            assert _rel_err(y[j, :c], ref[j, :c]) <= 1e-2, f"expert {j} ({seed=})"


@pytest.mark.parametrize("k", [160, 192, 2880 // 9], ids=["k160-step32", "k192-step64",
                                                          "k320-step64"])
def test_mxfp8_k_not_a_multiple_of_128(k, seed):
    """mxfp8 needs K in groups of 32 only (gpt-oss: hidden 2880 = 90 x 32): the pointer kernel
    steps K by the largest of 128 / 64 / 32 that divides it; contiguous and masked."""
    quant = QuantConfig("mxfp8")
    e, n = 3, 96
    w = _weights(e, n, k, quant)
    ids = torch.randint(0, e, (24, 2), dtype=torch.int32, device=DEV)
    lay = make_contiguous_layout(ids, e, 32)
    xq = permute_qtensor(quantize_act(torch.randn(24, k, device=DEV), quant), lay)
    y = triton_m_grouped_gemm_nt_contiguous(xq, w, lay)
    valid = lay.row_expert_M >= 0
    wf, xf = dequantize_weight(w), dequantize_act(xq)
    ref = torch.einsum("mk,mnk->mn", xf[valid], wf[lay.row_expert_M.long()[valid]])
    assert _rel_err(y[valid], ref) <= 1e-2
    counts = torch.tensor([5, 0, 16], dtype=torch.int32, device=DEV)
    x = quantize_act(torch.randn(e, 16, k, device=DEV), quant)
    ym = triton_m_grouped_gemm_nt_masked(x, w, counts, block_m=16)
    refm = torch.einsum("eck,enk->ecn", dequantize_act(x), dequantize_weight(w))
    for j, c in enumerate(counts.tolist()):
        if c:
            assert _rel_err(ym[j, :c], refm[j, :c]) <= 1e-2


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block", "mxfp8", "w4a8_mxfp4"])
@pytest.mark.parametrize("kernel", ["auto", "pointer"])
def test_bias_in_the_epilogue(recipe, kernel, seed):
    """bias [E, N] fp32 (gpt-oss's down bias): each row gets its expert's row before the bf16
    cast, in both layouts and both kernels (auto = TMA for bf16 / fp8_block, gemm_w4a8 for
    w4a8_mxfp4)."""
    quant = QuantConfig(recipe)
    e, n, k = 3, 256, 256
    w = _weights(e, n, k, quant)
    bias = torch.randn(e, n, device=DEV) * 3
    ids = torch.randint(0, e, (24, 2), dtype=torch.int32, device=DEV)
    lay = make_contiguous_layout(ids, e, 32)
    xq = permute_qtensor(quantize_act(torch.randn(24, k, device=DEV), quant), lay)
    y = triton_m_grouped_gemm_nt_contiguous(xq, w, lay, kernel=kernel, bias=bias)
    valid = lay.row_expert_M >= 0
    re = lay.row_expert_M.long()[valid]
    ref = torch.einsum("mk,mnk->mn", dequantize_act(xq)[valid], dequantize_weight(w)[re])
    assert _rel_err(y[valid], ref + bias[re]) <= 1e-2
    assert _rel_err(y[valid], ref) > 0.1  # the bias is there
    counts = torch.tensor([7, 0, 16], dtype=torch.int32, device=DEV)
    x = quantize_act(torch.randn(e, 16, k, device=DEV), quant)
    ym = triton_m_grouped_gemm_nt_masked(x, w, counts, block_m=16, kernel=kernel, bias=bias)
    refm = torch.einsum("eck,enk->ecn", dequantize_act(x), dequantize_weight(w))
    for j, c in enumerate(counts.tolist()):
        if c:
            assert _rel_err(ym[j, :c], refm[j, :c] + bias[j]) <= 1e-2
    with pytest.raises(ValueError, match=r"bias must be a contiguous fp32 \[E, N\]"):
        triton_m_grouped_gemm_nt_contiguous(xq, w, lay, bias=bias[:, :8])


GATHER_WAYS = [(GemmConfig(32, 128, 4, 3), "auto"), (GemmConfig(16, 256, 8, 3), "auto"),
               (GemmConfig(32, 128, 4, 3), "pointer")]


@pytest.mark.parametrize("cfg,kernel", GATHER_WAYS, ids=["bn128", "bn256_split", "pointer"])
@pytest.mark.parametrize("recipe,fmt", CASES)
def test_masked_gathered_rows_equal_the_rows_copied_first(cfg, kernel, recipe, fmt, seed):
    """rows_EC: masked row (e, c) read from x's row rows_EC[e, c] (a token once, its experts'
    slots pointing at it, as symm-ll's staged receive leaves them) gives the same output as
    the rows copied into [E, C, K] first, on every kernel (auto: TMA for bf16 / fp8_block
    with fp32 scales, gemm_w4a8, the pointer kernel for the rest); rows past a count (stale
    indices, out of range) are not read. Outputs poisoned; the reference is the dequantized
    operands."""
    e, cap, n, k, r = 3, 40, 256, 256, 29
    quant = QuantConfig(recipe, fmt)
    w = _weights(e, n, k, quant)
    counts = torch.tensor([40, 0, 23], dtype=torch.int32, device=DEV)
    x = quantize_act(torch.randn(r, k, device=DEV), quant)
    rows = torch.randint(0, r, (e, cap), dtype=torch.int32, device=DEV)
    for j, c in enumerate(counts.tolist()):
        rows[j, c:] = 10 ** 6  # never read
    out = torch.full((e, cap, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = triton_m_grouped_gemm_nt_masked(x, w, counts, block_m=cfg.block_m, config=cfg,
                                        out=out, kernel=kernel, rows_EC=rows)
    assert y is out
    ref = torch.einsum("eck,enk->ecn", dequantize_act(x)[rows.clamp(max=r - 1).long()],
                       dequantize_weight(w))
    copied = _rows(x, rows.clamp(max=r - 1))
    y_c = triton_m_grouped_gemm_nt_masked(copied, w, counts, block_m=cfg.block_m, config=cfg,
                                          kernel=kernel)
    for j, c in enumerate(counts.tolist()):
        if c:
            assert _rel_err(y[j, :c], ref[j, :c]) <= 1e-2
            assert torch.equal(y[j, :c], y_c[j, :c])
    with pytest.raises(ValueError, match=r"rows_EC must be a contiguous int32"):
        triton_m_grouped_gemm_nt_masked(x, w, counts, rows_EC=rows.long())


@pytest.mark.parametrize("kernel", ["auto", "pointer"])
@pytest.mark.parametrize("recipe,fmt", CASES)
def test_contiguous_gathered_rows_equal_the_permuted_rows(recipe, fmt, kernel, seed):
    """rows_M: layout row m read from the token x[rows_M[m]] (-1 on padding: not read) gives
    the permuted rows' output bit for bit on every kernel (the route a receive that writes
    only the index, or the Triton experts' in-place permute, takes); the padding rows'
    index (-1) is never read."""
    n_tok, top_k, e, n, k, align = 30, 2, 3, 256, 256, 32
    quant = QuantConfig(recipe, fmt)
    w = _weights(e, n, k, quant)
    ids = torch.randint(0, e, (n_tok, top_k), dtype=torch.int32, device=DEV)
    lay = make_contiguous_layout(ids, e, align)
    x = quantize_act(torch.randn(n_tok, k, device=DEV), quant)
    rows = torch.full((lay.num_rows,), -1, dtype=torch.int32, device=DEV)
    inv = lay.inv_perm_NK.long()
    tok = torch.arange(n_tok, device=DEV)[:, None].expand_as(inv)
    rows[inv[inv >= 0]] = tok[inv >= 0].to(torch.int32)
    cfg = GemmConfig(32, 128, 4, 3)
    out = torch.full((lay.num_rows, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    y_g = triton_m_grouped_gemm_nt_contiguous(x, w, lay, config=cfg, out=out, kernel=kernel,
                                              rows_M=rows)
    y_p = triton_m_grouped_gemm_nt_contiguous(_rows(x, rows.clamp(min=0)), w, lay, config=cfg,
                                              kernel=kernel)
    valid = lay.row_expert_M >= 0
    assert int(valid.sum()) == n_tok * top_k
    assert torch.equal(y_g[valid], y_p[valid])
    ref = dequantize_act(x)[rows.clamp(min=0).long()] @ dequantize_weight(w)[0].T
    first = valid & (lay.row_expert_M == 0)
    assert _rel_err(y_g[first], ref[first]) <= 1e-2
    if fmt == "ue8m0_packed":  # gathered rows with packed scales: the pointer kernel only
        with pytest.raises(ValueError, match=r"gathered rows without packed UE8M0"):
            triton_m_grouped_gemm_nt_contiguous(x, w, lay, kernel="tma", rows_M=rows)
