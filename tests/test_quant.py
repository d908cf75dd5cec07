"""epmoe.quant: recipes round-trip within their error bounds, scale formats are exact.

Error bounds, per element, with s the element's (dequantized) scale:
- fp8 e4m3 (3 mantissa bits): |deq - x| <= 2**-4 |x| + 2**-10 s  (half an ulp of a normal value,
  plus half the subnormal spacing 2**-9 in scaled units).
- e2m1 (1 mantissa bit): |deq - x| <= 2**-2 |x| + 2**-2 s  (spacing 0.5 below 2, half-ulp 25%).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epmoe.config import QuantConfig
from epmoe.quant import (
    E2M1_VALUES, FP8_DTYPE, FP8_MAX, QTensor, dequantize_act, dequantize_weight,
    e2m1_decode, e2m1_encode, e2m1_pack, e2m1_unpack, e8m0_to_fp32, fp32_to_e8m0,
    pack_ue8m0, quantize_act, quantize_weight, requant_weight_ue8m0, round_scale_pow2,
    unpack_ue8m0,
)

ACT_CASES = [("bf16", "fp32"), ("fp8_block", "fp32"), ("fp8_block", "ue8m0_fp32"),
             ("fp8_block", "ue8m0_packed"), ("mxfp8", "fp32"), ("w4a8_mxfp4", "fp32")]
WEIGHT_CASES = [("bf16", "fp32"), ("fp8_block", "fp32"), ("fp8_block", "ue8m0_fp32"),
                ("mxfp8", "fp32"), ("w4a8_mxfp4", "fp32")]
FP8_BOUND = (2.0 ** -4, 2.0 ** -10)
FP4_BOUND = (2.0 ** -2, 2.0 ** -2)


def _is_pow2(s: torch.Tensor) -> bool:
    m, _ = torch.frexp(s)
    return bool(((m == 0.5) & (s > 0)).all())


def _assert_bound(deq, x, s_full, bound, what):
    rel, absc = bound
    err = (deq - x).abs()
    lim = rel * x.abs() + absc * s_full + 1e-6 * x.abs()
    worst = (err - lim).max().item()
    assert worst <= 0, f"{what}: error exceeds bound by {worst}"


def _act_scale_full(q: QTensor) -> torch.Tensor:
    """The fp32 scale of every element of q.data."""
    d = q.data.shape[-1]
    if q.scale.dtype == torch.uint8:
        s = e8m0_to_fp32(q.scale)
    elif q.scale_fmt == "ue8m0_packed":
        s = unpack_ue8m0(q.scale, d // q.group)
    else:
        s = q.scale
    return s.repeat_interleave(q.group, dim=-1)


def _rand(shape, seed, dtype=torch.float32, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if spread:  # per-row magnitudes over a few decades, so groups get different scales
        x = x * torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1), generator=g).float())
    return x.to(dtype)


# --------------------------------------------------------------------------------------------
# Activations

@pytest.mark.parametrize("recipe,fmt", ACT_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_round_trip(recipe, fmt, dtype, seed):
    quant = QuantConfig(recipe, fmt)
    t, d = 37, 512
    x = _rand((t, d), seed, dtype)
    q = quantize_act(x, quant)
    print(f"{recipe=}, {fmt=}, {dtype=}, {t=}, {d=}, {seed=}")
    assert q.shape == (t, d) and q.num_rows == t and q.recipe == recipe and q.scale_fmt == fmt
    deq = dequantize_act(q)
    assert deq.dtype == torch.float32 and deq.shape == (t, d)
    if recipe == "bf16":
        assert q.data.dtype == torch.bfloat16 and q.scale is None and q.group == 0
        torch.testing.assert_close(deq, x.to(torch.bfloat16).float(), rtol=0, atol=0)
        return
    assert q.data.dtype == FP8_DTYPE
    group = 32 if recipe == "mxfp8" else 128
    assert q.group == group
    if recipe == "mxfp8":
        assert q.scale.dtype == torch.uint8 and q.scale.shape == (t, d // 32)
    elif fmt == "ue8m0_packed":
        assert q.scale.dtype == torch.int32 and q.scale.shape == (t, math.ceil(d // 128 / 4))
        assert q.scale.stride() == (1, (t + 3) // 4 * 4)
    else:
        assert q.scale.dtype == torch.float32 and q.scale.shape == (t, d // 128)
    s_full = _act_scale_full(q)
    if recipe == "mxfp8" or fmt != "fp32":
        assert _is_pow2(s_full)
    _assert_bound(deq, x.float(), s_full, FP8_BOUND, f"{recipe}/{fmt}")


def test_act_leading_dims_and_fp32_rule(seed):
    x = _rand((2, 3, 256), seed)
    q = quantize_act(x, QuantConfig("fp8_block"))
    assert q.scale.shape == (2, 3, 2) and q.num_rows == 6
    amax = x.reshape(2, 3, 2, 128).abs().amax(-1).clamp(min=1e-10)
    torch.testing.assert_close(q.scale, amax / 448.0, rtol=0, atol=0)


@pytest.mark.parametrize("recipe,fmt", ACT_CASES)
def test_act_index_select_and_to(recipe, fmt, seed):
    x = _rand((9, 256), seed)
    q = quantize_act(x, QuantConfig(recipe, fmt))
    idx = torch.tensor([8, 0, 3, 3, 5])
    sub = q.index_select(idx)
    torch.testing.assert_close(dequantize_act(sub), dequantize_act(q)[idx], rtol=0, atol=0)
    assert sub.data.dtype == q.data.dtype and sub.recipe == recipe and sub.scale_fmt == fmt
    if fmt == "ue8m0_packed":
        assert sub.scale.stride() == (1, 8)  # 5 rows -> MN stride padded to 8
    moved = q.to("cpu")
    torch.testing.assert_close(dequantize_act(moved), dequantize_act(q), rtol=0, atol=0)


def test_pow2_scales_never_clip(seed):
    x = _rand((64, 1024), seed)
    q32 = quantize_act(x, QuantConfig("fp8_block", "fp32"))
    q2 = quantize_act(x, QuantConfig("fp8_block", "ue8m0_fp32"))
    assert _is_pow2(q2.scale) and bool((q2.scale >= q32.scale).all())
    assert bool((q2.scale < 2 * q32.scale).all())
    ratio = x.reshape(64, 8, 128).abs() / q2.scale.unsqueeze(-1)
    assert ratio.max().item() <= FP8_MAX
    s = torch.rand(4096) * torch.exp2(torch.randint(-100, 100, (4096,)).float()) + 1e-30
    r = round_scale_pow2(s)
    assert _is_pow2(r) and bool((r >= s).all()) and bool((r < 2 * s).all())
    p = torch.exp2(torch.arange(-126, 127).float())
    torch.testing.assert_close(round_scale_pow2(p), p, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Weights

@pytest.mark.parametrize("recipe,fmt", WEIGHT_CASES)
def test_weight_round_trip(recipe, fmt, seed):
    e, n, k = 3, 256, 384
    w = _rand((e, n, k), seed, torch.bfloat16)
    qw = quantize_weight(w, QuantConfig(recipe, fmt))
    print(f"{recipe=}, {fmt=}, {e=}, {n=}, {k=}, {seed=}")
    assert qw.shape == (e, n, k) and qw.recipe == recipe
    deq = dequantize_weight(qw)
    assert deq.dtype == torch.float32 and deq.shape == (e, n, k)
    if recipe == "bf16":
        assert qw.data.dtype == torch.bfloat16 and qw.scale is None
        torch.testing.assert_close(deq, w.float(), rtol=0, atol=0)
        return
    if recipe == "fp8_block":
        assert qw.data.dtype == FP8_DTYPE and qw.data.shape == (e, n, k)
        assert qw.scale.dtype == torch.float32 and qw.scale.shape == (e, n // 128, k // 128)
        assert qw.scale_fmt == fmt
        s_full = qw.scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
        if fmt == "ue8m0_fp32":
            assert _is_pow2(qw.scale)
    else:
        assert qw.scale.dtype == torch.uint8 and qw.scale.shape == (e, n, k // 32)
        if recipe == "mxfp8":
            assert qw.data.dtype == FP8_DTYPE and qw.data.shape == (e, n, k)
        else:
            assert qw.data.dtype == torch.uint8 and qw.data.shape == (e, n, k // 2)
        s_full = e8m0_to_fp32(qw.scale).repeat_interleave(32, 2)
    bound = FP4_BOUND if recipe == "w4a8_mxfp4" else FP8_BOUND
    _assert_bound(deq, w.float(), s_full, bound, recipe)


def test_requant_weight_ue8m0(seed):
    w = _rand((2, 256, 256), seed)
    qw = quantize_weight(w, QuantConfig("fp8_block", "fp32"))
    rq = requant_weight_ue8m0(qw)
    assert rq.scale_fmt == "ue8m0_fp32" and rq.data.dtype == FP8_DTYPE
    assert rq.scale.shape == qw.scale.shape and _is_pow2(rq.scale)
    assert bool((rq.scale >= qw.scale).all())
    s_full = rq.scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    s_old = qw.scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    # Two roundings: the original quantization, then the re-quantization.
    _assert_bound(dequantize_weight(rq), dequantize_weight(qw), s_full, FP8_BOUND, "requant")
    _assert_bound(dequantize_weight(rq), w, s_full + s_old, (2 * 2.0 ** -4 + 2.0 ** -8, 2.0 ** -10),
                  "requant vs original")
    with pytest.raises(ValueError, match="applies to fp8_block"):
        requant_weight_ue8m0(quantize_weight(w, QuantConfig("mxfp8")))


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block", "mxfp8", "w4a8_mxfp4"])
def test_weight_select_and_narrow(recipe, seed):
    w = _rand((4, 256, 256), seed)
    qw = quantize_weight(w, QuantConfig(recipe))
    full = dequantize_weight(qw)
    sel = qw.select(torch.tensor([3, 1]))
    torch.testing.assert_close(dequantize_weight(sel), full[[3, 1]], rtol=0, atol=0)
    rows = qw.narrow_rows(128, 128)
    torch.testing.assert_close(dequantize_weight(rows), full[:, 128:], rtol=0, atol=0)
    cols = qw.narrow_cols(128, 128)
    assert cols.shape == (4, 256, 128)
    torch.testing.assert_close(dequantize_weight(cols), full[:, :, 128:], rtol=0, atol=0)
    if recipe in ("mxfp8", "w4a8_mxfp4"):
        c = qw.narrow_cols(32, 64)
        torch.testing.assert_close(dequantize_weight(c), full[:, :, 32:96], rtol=0, atol=0)
    if recipe == "fp8_block":
        with pytest.raises(ValueError, match="multiples of fp8_block's 128-wide scale block"):
            qw.narrow_rows(64, 128)
    if recipe != "bf16":
        with pytest.raises(ValueError, match="multiples of"):
            qw.narrow_cols(16, 32)
    with pytest.raises(ValueError, match="out of range"):
        qw.narrow_rows(128, 256)


# --------------------------------------------------------------------------------------------
# Scale formats

def test_e8m0_round_trip_all_exponents():
    e = torch.arange(0, 255, dtype=torch.uint8)
    s = e8m0_to_fp32(e)
    torch.testing.assert_close(s, torch.exp2(e.double() - 127).float(), rtol=0, atol=0)
    assert torch.equal(fp32_to_e8m0(s), e)
    assert math.isnan(e8m0_to_fp32(torch.tensor([255], dtype=torch.uint8)).item())


@pytest.mark.parametrize("bad", [3.0, 0.75, 0.0, -2.0])
def test_fp32_to_e8m0_rejects_non_pow2(bad):
    with pytest.raises(ValueError, match=r"is not a power of two.*round_scale_pow2"):
        fp32_to_e8m0(torch.tensor([1.0, bad, 2.0]))
    with pytest.raises(ValueError, match="is not a power of two"):
        pack_ue8m0(torch.tensor([[1.0, bad]]))


def test_pack_ue8m0_hand_computed():
    packed = pack_ue8m0(torch.tensor([[1.0, 2.0, 0.5, 4.0]]))
    word = 127 | 128 << 8 | 126 << 16 | 129 << 24
    word -= 1 << 32 if word >= 1 << 31 else 0  # as int32
    assert packed.dtype == torch.int32 and packed.shape == (1, 1)
    assert packed.item() == word
    # G = 5: a second word holding group 4 in byte 0, zero padding above.
    packed = pack_ue8m0(torch.tensor([[1.0, 2.0, 0.5, 4.0, 2.0 ** -3]]))
    assert packed.shape == (1, 2) and packed[0, 1].item() == 124


@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (8, 4), (13, 9), (3, 6, 5), (2, 4, 8)])
def test_pack_ue8m0_round_trip(shape, seed):
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
    s = e8m0_to_fp32(e)
    packed = pack_ue8m0(s)
    mn, groups = shape[-2], shape[-1]
    words, amn = math.ceil(groups / 4), (mn + 3) // 4 * 4
    assert packed.dtype == torch.int32 and packed.shape == (*shape[:-1], words)
    if len(shape) == 2:
        assert packed.stride() == (1, amn)
    else:
        assert packed.stride() == (words * amn, 1, amn)
    back = unpack_ue8m0(packed, groups)
    assert torch.equal(back.view(torch.int32), s.view(torch.int32))  # bit-exact
    # Byte b of word j is group 4j+b.
    j, b = (groups - 1) // 4, (groups - 1) % 4
    byte = (packed[..., j].to(torch.int64) >> (8 * b)) & 0xFF
    assert torch.equal(byte.to(torch.uint8), e[..., groups - 1])
    with pytest.raises(ValueError, match="num_groups"):
        unpack_ue8m0(packed, 4 * words + 1)


# --------------------------------------------------------------------------------------------
# e2m1

def test_e2m1_pack_bijective():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = e2m1_unpack(b)
    assert codes.shape == (512,) and int(codes.max()) <= 15
    assert torch.equal(codes[0::2], b & 0xF)  # low nibble = even column
    assert torch.equal(e2m1_pack(codes), b)
    assert len(set(zip(codes[0::2].tolist(), codes[1::2].tolist()))) == 256


def test_e2m1_encode_exact_and_ties():
    vals = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES[1:]))
    assert torch.equal(e2m1_decode(e2m1_encode(vals)), vals)
    assert torch.equal(e2m1_decode(torch.arange(16, dtype=torch.uint8)).abs(),
                       torch.tensor(E2M1_VALUES * 2))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -4.0])
    assert torch.equal(e2m1_decode(e2m1_encode(ties)), want)
    # Exactly representable weights (pow2 scale times e2m1 values) quantize exactly.
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (2, 4, 64), generator=g, dtype=torch.uint8)
    codes[..., ::32] = 7  # each group holds a 6 so its scale is exactly 2**-3
    w = e2m1_decode(codes) * 2.0 ** -3
    qw = quantize_weight(w, QuantConfig("w4a8_mxfp4"))
    torch.testing.assert_close(dequantize_weight(qw), w, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Property: the bound holds for random shapes and magnitudes.

@settings(max_examples=25, deadline=None)
@given(recipe_fmt=st.sampled_from(ACT_CASES[1:]), rows=st.integers(1, 5),
       groups=st.integers(1, 3), log2_mag=st.integers(-30, 30), seed=st.integers(0, 2 ** 16))
def test_property_act_error_bound(recipe_fmt, rows, groups, log2_mag, seed):
    recipe, fmt = recipe_fmt
    quant = QuantConfig(recipe, fmt)
    d = groups * quant.act_group
    x = _rand((rows, d), seed) * 2.0 ** log2_mag
    q = quantize_act(x, quant)
    _assert_bound(dequantize_act(q), x, _act_scale_full(q), FP8_BOUND, f"{recipe}/{fmt}")


@settings(max_examples=25, deadline=None)
@given(recipe=st.sampled_from(["fp8_block", "mxfp8", "w4a8_mxfp4"]), experts=st.integers(1, 2),
       log2_mag=st.integers(-20, 20), seed=st.integers(0, 2 ** 16))
def test_property_weight_error_bound(recipe, experts, log2_mag, seed):
    w = _rand((experts, 128, 256), seed) * 2.0 ** log2_mag
    qw = quantize_weight(w, QuantConfig(recipe))
    if recipe == "fp8_block":
        s_full = qw.scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    else:
        s_full = e8m0_to_fp32(qw.scale).repeat_interleave(32, 2)
    bound = FP4_BOUND if recipe == "w4a8_mxfp4" else FP8_BOUND
    _assert_bound(dequantize_weight(qw), w, s_full, bound, recipe)


# --------------------------------------------------------------------------------------------
# Errors

def test_errors_name_value_rule_fix():
    with pytest.raises(ValueError, match=r"hidden \(200\) must be a multiple of fp8_block's "
                                         r"quant group \(128\); pick recipe bf16"):
        quantize_act(torch.randn(4, 200), QuantConfig("fp8_block"))
    with pytest.raises(ValueError, match=r"hidden \(48\) must be a multiple of mxfp8's quant "
                                         r"group \(32\)"):
        quantize_act(torch.randn(4, 48), QuantConfig("mxfp8"))
    with pytest.raises(ValueError, match=r"activation dtype \(torch.int32\) must be"):
        quantize_act(torch.ones(4, 128, dtype=torch.int32), QuantConfig("fp8_block"))
    with pytest.raises(ValueError, match=r"weight dtype \(torch.int64\) must be"):
        quantize_weight(torch.ones(1, 128, 128, dtype=torch.int64), QuantConfig("mxfp8"))
    with pytest.raises(ValueError, match=r"weight rows N \(192\) must be a multiple of "
                                         r"fp8_block's quant group \(128\)"):
        quantize_weight(torch.randn(1, 192, 128), QuantConfig("fp8_block"))
    with pytest.raises(ValueError, match=r"weight K \(input dim\) \(80\) must be a multiple"):
        quantize_weight(torch.randn(1, 4, 80), QuantConfig("w4a8_mxfp4"))
    with pytest.raises(ValueError, match=r"ue8m0_packed needs 2-D activations"):
        quantize_act(torch.randn(2, 3, 128), QuantConfig("fp8_block", "ue8m0_packed"))
    with pytest.raises(ValueError, match=r"weights must be \[E, N, K\]"):
        quantize_weight(torch.randn(128, 128), QuantConfig("fp8_block"))
