"""Fused act + quant and per_token_group_quant against `activation` + `quant.quantize_act`.

Tolerances: scales are computed from the same fp32 amax, so they match to fp32 rounding
(rtol 1e-6; power-of-two scales exactly, save where the activation's last-bit difference moves
an amax across a power of two: allowed for <= 1% of groups). Quantized codes: equal but for
values the activation's last fp32 bit moves across a rounding boundary (<= 1% of codes, each
within one e4m3 step, 2**-3 relative at the top of the range)."""

import pytest
import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import activation
from epmoe.kernels.act_quant import ValidRows, per_token_group_quant, triton_act_quant
from epmoe.quant import QTensor, dequantize_act, quantize_act, unpack_ue8m0

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SWIGLU = MoEConfig("t", hidden=256, moe_intermediate=256, num_experts=4, top_k=2)
CLAMPED = SWIGLU.replace(swiglu_limit=7.0)
OAI = SWIGLU.replace(activation="swigluoai", activation_alpha=1.702, swiglu_limit=7.0)


def _scales_fp32(q):
    if q.scale_fmt == "ue8m0_packed":
        return unpack_ue8m0(q.scale.cpu(), q.data.shape[-1] // q.group)
    if q.scale.dtype == torch.uint8:
        return (q.scale.cpu().to(torch.int32) << 23).view(torch.float32)
    return q.scale.cpu().float()


def _compare(q, ref):
    assert q.data.dtype == ref.data.dtype and q.data.shape == ref.data.shape
    assert q.recipe == ref.recipe and q.group == ref.group and q.scale_fmt == ref.scale_fmt
    if ref.scale is None:  # bf16: in-kernel cast (the interpreter truncates): 1 bf16 ulp
        torch.testing.assert_close(q.data.float(), ref.data.float(), atol=1e-2, rtol=1e-2)
        return
    s, sr = _scales_fp32(q), _scales_fp32(ref)
    close = torch.isclose(s, sr, rtol=1e-6, atol=0)
    assert close.float().mean() >= 0.99, f"{(~close).sum()} scales differ"
    a, ar = dequantize_act(q).cpu(), dequantize_act(ref).cpu()
    step = sr.repeat_interleave(q.group, dim=1) * 448 * 2.0 ** -3  # one e4m3 step at the top
    assert bool(((a - ar).abs() <= step + 1e-6).all())
    same = (q.data.cpu().view(torch.uint8) == ref.data.cpu().view(torch.uint8)).float().mean()
    assert same >= 0.99, f"only {same:.3f} of fp8 codes equal"


@pytest.mark.parametrize("cfg", [SWIGLU, CLAMPED, OAI], ids=["swiglu", "clamp", "oai"])
@pytest.mark.parametrize("recipe,fmt", [("bf16", "fp32"), ("fp8_block", "fp32"),
                                        ("fp8_block", "ue8m0_fp32"),
                                        ("fp8_block", "ue8m0_packed"), ("mxfp8", "fp32"),
                                        ("w4a8_mxfp4", "fp32")])
def test_act_quant_matches_reference(cfg, recipe, fmt, seed):
    m, i = 40, 640  # 5 groups of 128: a partial word of packed UE8M0
    h = (torch.randn(m, 2 * i, device=DEV) * 4).to(torch.bfloat16)
    quant = QuantConfig(recipe, fmt)
    q = triton_act_quant(h, cfg, quant)
    ref = quantize_act(activation(h.float(), cfg), quant)
    _compare(q, ref)
    if fmt == "ue8m0_packed":
        assert q.scale.dtype == torch.int32 and q.scale.shape == (m, 2)
        assert q.scale.stride() == (1, 40)


def test_act_quant_mn_major_fp32_scales(seed):
    m, i = 37, 256
    h = torch.randn(m, 2 * i, device=DEV).to(torch.bfloat16)
    quant = QuantConfig("fp8_block")
    q = triton_act_quant(h, SWIGLU, quant, mn_major=True)
    assert q.scale.shape == (m, 2) and q.scale.stride() == (1, 40)  # align(37, 4) = 40
    _compare(q, quantize_act(activation(h.float(), SWIGLU), quant))


def _poisoned_allocations(monkeypatch):
    """torch.empty / empty_strided come back filled with a poison (NaN; 0x7f = e4m3 NaN bytes;
    -1 words): what the kernel leaves unwritten stays poison."""
    real_empty, real_strided = torch.empty, torch.empty_strided

    def poison(t):
        if t.dtype in (torch.int32, torch.uint8):
            return t.fill_(-1 if t.dtype == torch.int32 else 0xAB)
        if t.element_size() == 1:
            t.view(torch.uint8).fill_(0x7F)
            return t
        return t.fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **k: poison(real_strided(*a, **k)))


def _is_poison(t):
    if t.dtype == torch.int32:
        return t == -1
    if t.dtype == torch.uint8:
        return t == 0xAB
    if t.element_size() == 1:
        return t.view(torch.uint8) == 0x7F
    return torch.isnan(t)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("recipe,fmt", [("bf16", "fp32"), ("fp8_block", "fp32"),
                                        ("fp8_block", "ue8m0_packed"), ("mxfp8", "fp32")])
def test_act_quant_skips_padding_rows(layout, recipe, fmt, seed, monkeypatch):
    """Only the valid rows are computed (against the reference) and written; padding rows of a
    and its scales stay as allocated, and a block of rows with no valid row is skipped whole."""
    m, i, cap = 48, 256, 12
    h = (torch.randn(m, 2 * i, device=DEV) * 3).to(torch.bfloat16)
    if layout == "contiguous":  # rows 16..31 all padding (a whole skipped block), others mixed
        row_expert = torch.randint(0, 4, (m,), dtype=torch.int32, device=DEV)
        row_expert[torch.rand(m, device=DEV) < 0.4] = -1
        row_expert[16:32] = -1
        row_expert[0] = 0
        valid, rows = row_expert >= 0, ValidRows.contiguous(row_expert)
    else:  # 4 experts x capacity 12: counts 0 (an empty expert), 3, 12 (full), random
        counts = torch.tensor([0, 3, cap, int(torch.randint(0, cap + 1, ()))],
                              dtype=torch.int32, device=DEV)
        valid = (torch.arange(m, device=DEV) % cap) < counts.repeat_interleave(cap)
        rows = ValidRows.masked(counts, cap)
    quant = QuantConfig(recipe, fmt)
    full = triton_act_quant(h, SWIGLU, quant)  # every row: the reference for the valid ones
    _poisoned_allocations(monkeypatch)
    q = triton_act_quant(h, SWIGLU, quant, rows=rows)
    monkeypatch.undo()
    v = valid.cpu()
    assert bool(_is_poison(q.data.cpu())[~v].all()), "a padding row of a was written"
    assert not bool(_is_poison(q.data.cpu())[v].any()), "a valid row of a was not written"
    bits = (lambda t: t.view(torch.uint8)) if q.data.element_size() == 1 else (lambda t: t)
    assert torch.equal(bits(q.data.cpu()[v]), bits(full.data.cpu()[v]))
    if q.scale is not None:
        assert bool(_is_poison(q.scale.cpu())[~v].all()), "a padding row's scale was written"
        assert torch.equal(q.scale.cpu()[v], full.scale.cpu()[v])
    _compare(QTensor(q.data[valid], None if q.scale is None else q.scale[valid], q.recipe,
                     q.group, q.scale_fmt),
             quantize_act(activation(h[valid].float(), SWIGLU), quant))
    with pytest.raises(ValueError, match="row_expert_M has 5 rows, h has 48"):
        triton_act_quant(h, SWIGLU, quant, rows=ValidRows.contiguous(
            torch.zeros(5, dtype=torch.int32, device=DEV)))


@pytest.mark.parametrize("group,fmt", [(128, "fp32"), (128, "ue8m0_fp32"),
                                       (128, "ue8m0_packed"), (32, "fp32")])
def test_per_token_group_quant_matches_reference(group, fmt, seed):
    x = (torch.randn(50, 512, device=DEV) * 2).to(torch.bfloat16)
    x[3] *= 1e-4  # a row of tiny values
    q = per_token_group_quant(x, group, fmt)
    ref = quantize_act(x, QuantConfig("fp8_block" if group == 128 else "mxfp8",
                                      fmt if group == 128 else "fp32"))
    _compare(q, ref)


def test_act_quant_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"intermediate \(100\) must be a multiple"):
        triton_act_quant(torch.randn(4, 200, device=DEV), SWIGLU, QuantConfig("fp8_block"))
    with pytest.raises(ValueError, match=r"group \(64\) must be 128"):
        per_token_group_quant(torch.randn(4, 128, device=DEV), 64)
    with pytest.raises(ValueError, match=r"h_MF dtype \(torch.int32\)"):
        triton_act_quant(torch.zeros(4, 256, dtype=torch.int32, device=DEV), SWIGLU,
                         QuantConfig("bf16"))
