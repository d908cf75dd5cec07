"""DeepGemmExperts' hot path on CPU against the float64 oracle, deep_gemm replaced by a torch
model of the calls it makes: the contiguous GEMM in DeepGEMM's psum layout (group g covers rows
[align(psum[g-1], 128), psum[g]); nothing past the last group is computed) and the dense GEMM of
run_dense. The workspace buffers are poisoned with NaN between calls: rows the layout does not
cover (the worst case's padding) must never reach the output."""

import pytest
import torch

import epmoe.experts.deepgemm_experts as dgx
from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import ExpertWeights
from epmoe.quant import dequantize_weight, quantize_weight
from epmoe.reference import TOLERANCE, max_rel_err, reference_moe

pytestmark = pytest.mark.interpreter  # Triton kernels on the CPU tensors of the model

ALIGN = 128
CFG = MoEConfig("psum", hidden=256, moe_intermediate=128, num_experts=4, top_k=2)


def _deq_a(a):
    if isinstance(a, torch.Tensor):
        return a.float()
    data, scale = a
    return data.float() * scale.float().repeat_interleave(128, dim=1)[:, :data.shape[1]]


def _deq_b(b, e):
    if isinstance(b, torch.Tensor):
        return b[e].float()
    data, scale = b
    s = scale[e].float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return data[e].float() * s[:data.shape[1], :data.shape[2]]


class _TorchDeepGemm:
    """What DeepGemmExperts calls, with DeepGEMM's documented semantics (SM90 recipe)."""

    calls: list = []

    @staticmethod
    def get_mk_alignment_for_contiguous_layout():
        return ALIGN

    @classmethod
    def m_grouped_fp8_fp4_gemm_nt_contiguous(cls, a, b, d, layout, recipe=None,
                                             use_psum_layout=False, **kw):
        cls.calls.append(("contiguous", use_psum_layout))
        x = _deq_a(a)
        if use_psum_layout:
            start = 0
            for g, end in enumerate(layout.tolist()):
                if end > start:
                    d[start:end] = (x[start:end] @ _deq_b(b, g).T).to(d.dtype)
                start = -(-end // ALIGN) * ALIGN
        else:
            for r, g in enumerate(layout.tolist()):
                if g >= 0:
                    d[r] = (x[r] @ _deq_b(b, g).T).to(d.dtype)

    m_grouped_bf16_gemm_nt_contiguous = m_grouped_fp8_fp4_gemm_nt_contiguous

    @classmethod
    def fp8_fp4_gemm_nt(cls, a, b, d, recipe=None, **kw):
        cls.calls.append(("dense", False))
        w = b if isinstance(b, torch.Tensor) else b
        d.copy_((_deq_a(a) @ _deq_b((w[0][None], w[1][None]), 0).T).to(d.dtype))

    @classmethod
    def bf16_gemm_nt(cls, a, b, d, **kw):
        cls.calls.append(("dense", False))
        d.copy_((a.float() @ b.float().T).to(d.dtype))


@pytest.fixture
def model_dg(monkeypatch):
    # a CPU model of DeepGEMM's calls (with CUDA the real DeepGEMM runs in the GPU tests); the
    # CPU tensors go through Triton kernels: tests using it are marked interpreter
    monkeypatch.setattr(dgx, "_deep_gemm", lambda: _TorchDeepGemm)
    monkeypatch.setattr(dgx, "_arch_major", lambda device: 9)
    monkeypatch.setattr(dgx.DeepGemmExperts, "supports",
                        classmethod(lambda cls, cfg, quant, device: None))
    _TorchDeepGemm.calls = []
    return _TorchDeepGemm


def _experts(cfg, quant):
    e, d, i = cfg.num_experts, cfg.hidden, cfg.moe_intermediate
    w13 = torch.randn(e, 2 * i, d) / d ** 0.5
    w2 = torch.randn(e, d, i) / i ** 0.5
    ew = ExpertWeights(quantize_weight(w13, quant), quantize_weight(w2, quant), torch.arange(e))
    return dgx.DeepGemmExperts(ew, cfg, quant), ew


def _oracle(ew):
    return (None, None, dequantize_weight(ew.w13).double(), dequantize_weight(ew.w2).double(),
            None)


def _poison(ex):
    for buf in ex.ws._bufs.values():
        if buf.is_floating_point():
            buf.fill_(float("nan"))


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_apply_in_psum_layout_matches_the_oracle(model_dg, recipe, seed):
    quant = QuantConfig(recipe)
    ex, ew = _experts(CFG, quant)
    n = 37
    x = torch.randn(n, CFG.hidden)
    ids = torch.rand(n, CFG.num_experts).topk(CFG.top_k, dim=1).indices.to(torch.int32)
    ids[torch.rand(n, CFG.top_k) < 0.2] = -1
    ids[:, :][ids == 3] = -1  # an expert with no rows: an empty group
    w = torch.rand(n, CFG.top_k)
    ref = reference_moe(x, _oracle(ew), CFG, quant, ids.long(), w)
    for _ in range(2):  # the second call reuses (poisoned) buffers
        y = ex.apply(ex.quantize_input(x), ids, w)
        err = max_rel_err(y, ref)
        assert err <= TOLERANCE[recipe], f"{recipe=} {err=:.2e} {seed=}"
        _poison(ex)
    assert ("contiguous", True) in model_dg.calls and ("contiguous", False) not in model_dg.calls


def test_psum_is_the_layout_group_ends(model_dg):
    from epmoe.layout import make_contiguous_layout

    ex, _ = _experts(CFG, QuantConfig("bf16"))
    ids = torch.tensor([[0, 2], [2, -1], [0, 2], [2, 0]], dtype=torch.int32)
    lay = make_contiguous_layout(ids, CFG.num_experts, ALIGN, num_rows=4 * ALIGN)
    # an empty group ends where it starts: the aligned end of the one before
    assert ex.psum(lay).tolist() == [3, ALIGN, ALIGN + 4, 2 * ALIGN]
    coarse = make_contiguous_layout(ids, CFG.num_experts, 2 * ALIGN)
    assert ex.psum(coarse) is None  # groups start on 256-row bounds: not DeepGEMM's psum


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_run_dense_matches_the_oracle(model_dg, recipe, seed):
    cfg, quant = CFG.replace(num_experts=1, top_k=1), QuantConfig(recipe)
    ex, ew = _experts(cfg, quant)
    n = 19
    x = torch.randn(n, cfg.hidden)
    ref = reference_moe(x, _oracle(ew), cfg, quant, torch.zeros(n, 1, dtype=torch.long),
                        torch.ones(n, 1))
    y = ex.run_dense(ex.quantize_input(x))
    assert y.dtype == torch.bfloat16 and max_rel_err(y, ref) <= TOLERANCE[recipe]
    assert model_dg.calls == [("dense", False)] * 2
