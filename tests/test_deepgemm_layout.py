"""DeepGEMM scale layouts (SM90 fp32 MN-major TMA-aligned, SM100 UE8M0 packed) and the
alignment-by-construction rule, on CPU (no deep_gemm needed: its module is stubbed)."""

import pytest
import torch

import epmoe.experts.deepgemm_experts as dgx
from epmoe.config import QuantConfig, get_preset
from epmoe.quant import quantize_act, quantize_weight, round_scale_pow2, unpack_ue8m0
from epmoe.weights import build_expert_weights


def _pow2(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return round_scale_pow2(torch.rand(shape, generator=g) * 4 + 1e-3)


@pytest.mark.parametrize("m,g", [(1, 3), (5, 3), (8, 56), (130, 16)])
def test_sm90_act_scale_is_mn_major_tma_aligned(m, g):
    s = torch.rand(m, g) + 0.1
    t = dgx.sm90_act_scale(s)
    pad = (m + 3) // 4 * 4
    assert t.shape == (m, g) and t.stride() == (1, pad) and torch.equal(t, s)
    assert dgx.is_tma_mn_major(t) and dgx.sm90_act_scale(t) is t  # no second copy


def test_sm90_act_scale_batched_per_expert():
    s = torch.rand(3, 6, 4) + 0.1  # [E, C, G]
    t = dgx.sm90_act_scale(s)
    assert t.stride() == (4 * 8, 1, 8) and torch.equal(t, s)


def test_sm90_act_scale_rejects_non_fp32():
    with pytest.raises(ValueError, match="must be fp32"):
        dgx.sm90_act_scale(torch.ones(4, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("e,n,k", [(2, 256, 512), (1, 384, 2048), (3, 128, 7168)])
def test_sm100_weight_scale_packs_one_row_per_n(e, n, k):
    s = _pow2((e, n // 128, k // 128), seed=n + k)
    p = dgx.sm100_weight_scale(s, n)
    words = (k // 128 + 3) // 4
    assert p.dtype == torch.int32 and p.shape == (e, n, words)
    pad = (n + 3) // 4 * 4
    assert p.stride() == (words * pad, 1, pad)  # MN-major, TMA-aligned
    back = unpack_ue8m0(p, k // 128)
    assert torch.equal(back, s.repeat_interleave(128, dim=1))


def test_sm100_weight_scale_needs_powers_of_two():
    with pytest.raises(ValueError, match="power of two"):
        dgx.sm100_weight_scale(torch.full((1, 1, 1), 0.3), 128)


def test_sm100_act_scale_matches_packed_quantizer():
    x = torch.randn(37, 1024)
    pow2 = quantize_act(x, QuantConfig("fp8_block", "ue8m0_fp32"))
    packed = quantize_act(x, QuantConfig("fp8_block", "ue8m0_packed"))
    a, b = dgx.sm100_act_scale(pow2), dgx.sm100_act_scale(packed)
    assert torch.equal(a, b) and a.stride() == b.stride()
    assert torch.equal(pow2.data.view(torch.uint8), packed.data.view(torch.uint8))


class _StubDeepGemm:
    @staticmethod
    def get_mk_alignment_for_contiguous_layout():
        return 128


@pytest.fixture
def stub_experts(monkeypatch):
    """A DeepGemmExperts on CPU: deep_gemm stubbed, arch SM90, capability check bypassed."""
    monkeypatch.setattr(dgx, "_deep_gemm", lambda: _StubDeepGemm)
    monkeypatch.setattr(dgx, "_arch_major", lambda device: 9)
    monkeypatch.setattr(dgx.DeepGemmExperts, "supports",
                        classmethod(lambda cls, cfg, quant, device: None))
    cfg = get_preset("deepseek-v3-tiny")
    quant = QuantConfig("fp8_block")
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 2 * cfg.moe_intermediate, cfg.hidden, generator=g)
    w2 = torch.randn(4, cfg.hidden, cfg.moe_intermediate, generator=g)
    return dgx.DeepGemmExperts(build_expert_weights(w13, w2, quant, range(4)), cfg, quant)


def test_alignment_is_the_gemms(stub_experts):
    assert stub_experts.alignment == 128


def test_finer_alignment_is_refused(stub_experts):
    ids = torch.randint(0, 4, (8, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"alignment \(64\) must be a multiple of deepgemm's "
                                         r"GEMM alignment \(128\)"):
        stub_experts.make_layout(ids, alignment=64)


def test_layout_is_aligned_to_the_gemm(stub_experts):
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: interpreter or compiled
    ids = torch.randint(-1, 4, (40, 2), dtype=torch.int32, device=dev)
    lay = stub_experts.make_layout(ids)
    assert lay.alignment == 128
    assert bool((lay.offsets_E1 % 128 == 0).all())
    assert lay.num_rows % 128 == 0


def test_run_contiguous_refuses_a_finer_layout(stub_experts):
    from epmoe.layout import make_contiguous_layout

    ids = torch.randint(0, 4, (8, 2), dtype=torch.int32)
    lay = make_contiguous_layout(ids, 4, alignment=32)
    x = quantize_act(torch.randn(lay.num_rows, 256), QuantConfig("fp8_block"))
    with pytest.raises(ValueError, match=r"multiple of DeepGEMM's M block \(128\)"):
        stub_experts.run_contiguous(x, lay)


def test_weight_scales_transformed_once_sm100(monkeypatch):
    monkeypatch.setattr(dgx, "_arch_major", lambda device: 10)
    w = quantize_weight(torch.randn(2, 256, 512), QuantConfig("fp8_block", "ue8m0_fp32"))
    data, scale = dgx._weight_operand(w, sm100=True)
    assert scale.dtype == torch.int32 and scale.shape == (2, 256, 1)
    data90, scale90 = dgx._weight_operand(w, sm100=False)
    assert scale90.dtype == torch.float32 and scale90.shape == (2, 2, 4)


def test_supports_without_cuda_names_the_reason():
    why = dgx.DeepGemmExperts.supports(get_preset("deepseek-v3-tiny"), QuantConfig("fp8_block"),
                                       torch.device("cpu"))
    assert why and "not CUDA" in why


def test_auto_falls_back_with_the_reason():
    from epmoe.experts.select import make_experts

    cfg = get_preset("deepseek-v3-tiny")
    quant = QuantConfig("bf16")
    g = torch.Generator().manual_seed(1)
    ew = build_expert_weights(torch.randn(2, 2 * cfg.moe_intermediate, cfg.hidden, generator=g),
                              torch.randn(2, cfg.hidden, cfg.moe_intermediate, generator=g),
                              quant, range(2))
    ex, reason = make_experts("auto", ew, cfg, quant, "cpu")
    assert "deepgemm" in reason and ex.name != "deepgemm"
