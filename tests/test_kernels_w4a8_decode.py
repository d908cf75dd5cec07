"""The W4A8 (e2m1 weights x e8m0 per 32, fp8 activations) grouped GEMM's in-kernel weight
decode, checked exactly: one-hot activations (fp8 1.0, scale 1.0) make each output one
weight, which must equal quant.dequantize_weight's value for every code at every scale whose
products stay in bf16's normal range, on the masked and the contiguous path, for both kernels
(`kernel='auto'`: `epmoe.kernels.gemm_w4a8`, at decode BLOCK_Ms and at 128, where it sums a
block's groups before the activation scale, and the bf16-decode `'pointer'` one)."""

import pytest
import torch

from epmoe.kernels.grouped_gemm import (triton_m_grouped_gemm_nt_contiguous,
                                        triton_m_grouped_gemm_nt_masked)
from epmoe.layout import make_contiguous_layout, permute_qtensor
from epmoe.quant import FP8_DTYPE, QTensor, QWeight, dequantize_weight

DEV = "cuda" if torch.cuda.is_available() else "cpu"
K = 128
SCALES = list(range(2, 253))  # e8m0 bytes whose products with every code stay normal in bf16
ROUTES = [("auto", 16), ("auto", 64), ("auto", 128), ("pointer", 64)]


def _every_code_at(scale_EnG: torch.Tensor) -> QWeight:
    """Row r of expert e: each group of 32 holds every code (16 x 2), in a row-dependent
    order, at e8m0 scale scale_EnG[e, r, group]."""
    e, n, g = scale_EnG.shape
    codes = (torch.arange(32 * g)[None, :] + torch.arange(n)[:, None]) % 16  # [n, K]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return QWeight(packed[None].expand(e, n, 16 * g).contiguous().to(DEV),
                   scale_EnG.to(torch.uint8).contiguous().to(DEV), "w4a8_mxfp4")


def _every_code_at_scales(scales: list[int]) -> QWeight:
    """One expert, a row per scale, all 4 groups of a row at scales[r]."""
    return _every_code_at(torch.tensor(scales)[None, :, None].expand(1, len(scales), K // 32))


def _one_hot(m: int, k: int = K) -> QTensor:
    """m rows, row i = 1.0 at column i % k (fp8), activation scales 1.0."""
    x = torch.zeros(m, k)
    x[torch.arange(m), torch.arange(m) % k] = 1.0
    return QTensor(x.to(FP8_DTYPE).to(DEV), torch.ones(m, k // 128, device=DEV), "w4a8_mxfp4",
                   128, "fp32")


def _masked(x: QTensor, w: QWeight, kernel: str, block_m: int) -> torch.Tensor:
    """x's rows to every expert of w (each expert's counts = all rows), y [E, m, N]."""
    e = w.shape[0]
    xe = QTensor(x.data[None].expand(e, *x.data.shape).contiguous(),
                 x.scale.repeat(e, 1), x.recipe, x.group, x.scale_fmt)
    y = torch.full((e, x.data.shape[0], w.shape[1]), float("nan"), dtype=torch.bfloat16,
                   device=DEV)
    counts = torch.full((e,), x.data.shape[0], dtype=torch.int32, device=DEV)
    return triton_m_grouped_gemm_nt_masked(xe, w, counts, block_m=block_m, out=y,
                                           kernel=kernel)


@pytest.mark.parametrize("kernel,block_m", ROUTES)
def test_every_code_at_every_normal_scale_decodes_exactly_masked(kernel, block_m):
    w = _every_code_at_scales(SCALES)
    want = dequantize_weight(w)[0]  # fp32 [n, K]: exact, and exact in bf16
    assert torch.equal(want.bfloat16().float(), want)
    assert len(set(want.abs().unique().tolist())) > 100  # the codes times many scales
    y = _masked(_one_hot(K), w, kernel, block_m)[0]
    assert torch.equal(y.float(), want.T)  # y[i, r] = w[r, i]


@pytest.mark.parametrize("kernel,block_m", ROUTES)
def test_groups_at_different_scales_decode_exactly(kernel, block_m):
    """A row's groups at scales up to 40 binades apart (each group is scaled on its own):
    offsets from the row's top scale per 128-column block, rows at tops 60..250."""
    k, n = 256, 48
    top = torch.linspace(60, 250, n).round()[:, None]
    near = top - torch.tensor([0, 3, 11, 7])
    scale = torch.stack([torch.cat([near, top - torch.tensor(d)], 1)
                         for d in ([0, 3, 11, 7], [12, 0, 5, 3], [5, 0, 40, 2])])
    w = _every_code_at(scale)
    want = dequantize_weight(w)  # [3, n, k]
    assert torch.equal(want.bfloat16().float(), want)
    y = _masked(_one_hot(k, k), w, kernel, block_m)
    for e in range(3):
        assert torch.equal(y[e].float(), want[e].T), e


@pytest.mark.parametrize("kernel,block_m", ROUTES)
def test_every_code_decodes_exactly_contiguous(kernel, block_m):
    w = _every_code_at_scales(SCALES[::10])
    ids = torch.zeros(K, 1, dtype=torch.int32, device=DEV)
    lay = make_contiguous_layout(ids, 1, 128)
    y = triton_m_grouped_gemm_nt_contiguous(permute_qtensor(_one_hot(K), lay), w, lay,
                                            block_m=block_m, kernel=kernel)
    valid = lay.row_expert_M >= 0
    assert torch.equal(y[valid].float(), dequantize_weight(w)[0].T)


@pytest.mark.parametrize("block_m", [16, 128])
def test_random_codes_at_random_scales(block_m, seed):
    """K = 640 (five 128-column blocks, two experts, one partly filled): random codes at
    random scales over 5 binades and activations of uneven magnitude, both kernels against
    the dequantized operands (1e-2 of the largest output: fp32 sums, one bf16 rounding)."""
    from epmoe.config import QuantConfig
    from epmoe.quant import dequantize_act, quantize_act
    k, n, m = 640, 96, 48
    packed = torch.randint(0, 256, (2, n, k // 2), dtype=torch.uint8)
    scale = torch.randint(120, 125, (2, n, k // 32), dtype=torch.uint8)
    w = QWeight(packed.to(DEV), scale.to(DEV), "w4a8_mxfp4")
    x = quantize_act(torch.randn(2, m, k, device=DEV) * torch.rand(1, 1, k, device=DEV) * 4,
                     QuantConfig("w4a8_mxfp4"))
    counts = torch.tensor([m, 29], dtype=torch.int32, device=DEV)
    ref = torch.einsum("eck,enk->ecn", dequantize_act(x).float(), dequantize_weight(w))
    for kernel in ("auto", "pointer"):
        y = torch.full((2, m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        triton_m_grouped_gemm_nt_masked(x, w, counts, block_m=block_m, out=y, kernel=kernel)
        for j, c in enumerate(counts.tolist()):
            err = float((y[j, :c].float() - ref[j, :c]).abs().max() / ref[j, :c].abs().max())
            assert err <= 1e-2, (kernel, j, err)


def test_block_m_follows_the_rows_an_expert_gets():
    from epmoe.kernels.gemm_w4a8 import w4a8_block_m
    assert [w4a8_block_m(r, 128) for r in (0, 3, 16, 17, 40, 96, 500)] == \
        [16, 16, 16, 32, 64, 128, 128]
    assert w4a8_block_m(96, 64) == 64 and w4a8_block_m(3, 32) == 16


@pytest.mark.gpu
def test_the_benchmark_runs_small(tmp_path):
    """bench.w4a8_gemm --small: every row timed, the masked rows for decode sizes."""
    import json

    from epmoe.bench.w4a8_gemm import main
    out = tmp_path / "w4.json"
    assert main(["--small", "--tokens", "32,512", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["layout"] for r in rows} == {"contiguous", "masked"}
    assert len(rows) == 2 * 3  # per GEMM: two contiguous, one masked (32 x 6 / 16 <= 64)
    assert all(r["auto_us"] > 0 and r["pointer_us"] > 0 and r["rel_diff"] <= 1e-2 for r in rows)
