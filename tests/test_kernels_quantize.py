"""quantize_tokens (the fused Triton activation quantizer) against `epmoe.quant.quantize_act`:
bit for bit (fp8 codes as bytes, scales as bits), every recipe and scale format, both scale
layouts, into poisoned preallocated outputs. The Triton kernel is forced (backend='triton'),
so on CPU it runs under the interpreter at tiny shapes."""

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.kernels.quantize import QuantKernelConfig, TokenQuantizer, quantize_tokens
from epmoe.quant import FP8_DTYPE, QTensor, quantize_act

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [("fp8_block", "fp32"), ("fp8_block", "ue8m0_fp32"), ("fp8_block", "ue8m0_packed"),
           ("mxfp8", "fp32"), ("w4a8_mxfp4", "fp32")]


def _x(t, d, dtype):
    x = torch.randn(t, d, device=DEV) * torch.rand(t, 1, device=DEV) * 8
    x[1, :] = 0.0  # an all-zero row: amax clamps to 1e-10
    x[2] *= 1e-30 if dtype == torch.float32 else 1e-3  # tiny: fp8 subnormal codes
    x[0, 5] = -0.0
    return x.to(dtype)


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else \
        t.contiguous().view(torch.int32)


def _poisoned_like(ref: QTensor, mn_major: bool) -> QTensor:
    t = ref.data.shape[0]
    data = torch.full_like(ref.data.view(torch.uint8), 0x7F).view(FP8_DTYPE)  # fp8 NaN
    s = ref.scale
    if mn_major or ref.scale_fmt == "ue8m0_packed":
        ld = (t + 3) // 4 * 4
        scale = torch.empty_strided(s.shape, (1, ld), dtype=s.dtype, device=s.device)
    else:
        scale = torch.empty_like(s)
    scale.fill_(float("nan") if s.is_floating_point() else (255 if s.dtype == torch.uint8 else -1))
    return QTensor(data, scale, ref.recipe, ref.group, ref.scale_fmt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe,fmt", FORMATS)
def test_quantize_tokens_is_bitwise_the_reference(recipe, fmt, dtype, seed):
    t, d = 9, 640  # 5 groups of 128: a partial packed word; 9 rows: a partial row block
    quant = QuantConfig(recipe, fmt)
    x = _x(t, d, dtype)
    ref = quantize_act(x, quant)
    for mn_major in (False, True):
        out = _poisoned_like(ref, mn_major)
        q = quantize_tokens(x, quant, mn_major=mn_major, out=out, backend="triton",
                            config=QuantKernelConfig(4, 4, 4))
        assert q is out
        assert (q.recipe, q.group, q.scale_fmt) == (ref.recipe, ref.group, ref.scale_fmt)
        assert torch.equal(_bits(q.data), _bits(ref.data)), f"{seed=}"
        assert q.scale.dtype == ref.scale.dtype and q.scale.shape == ref.scale.shape
        assert torch.equal(_bits(q.scale), _bits(ref.scale)), f"{seed=}"


@pytest.mark.parametrize("recipe,fmt", [("fp8_block", "fp32"), ("fp8_block", "ue8m0_packed")])
def test_quantize_tokens_allocating_layouts(recipe, fmt, seed):
    quant = QuantConfig(recipe, fmt)
    x = _x(6, 1024, torch.bfloat16)
    ref = quantize_act(x, quant)
    q = quantize_tokens(x, quant, mn_major=True, backend="triton")
    assert q.scale.stride() == (1, 8)  # MN-major, T aligned to 4
    assert torch.equal(_bits(q.data), _bits(ref.data))
    assert torch.equal(_bits(q.scale), _bits(ref.scale))
    auto = quantize_tokens(x, quant)  # CPU: the reference itself; CUDA: the kernel
    assert torch.equal(_bits(auto.data), _bits(ref.data))
    assert torch.equal(_bits(auto.scale), _bits(ref.scale))


def test_quantize_tokens_bf16_and_errors():
    x = torch.randn(4, 256, device=DEV)
    q = quantize_tokens(x, QuantConfig("bf16"))
    assert q.scale is None and torch.equal(q.data, x.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"hidden \(200\) must be a multiple of fp8_block"):
        quantize_tokens(torch.randn(4, 200, device=DEV), QuantConfig("fp8_block"))
    with pytest.raises(ValueError, match=r"backend \('cuda'\) must be"):
        quantize_tokens(x, QuantConfig("fp8_block"), backend="cuda")
    bad = QTensor(torch.empty(4, 256, dtype=FP8_DTYPE, device=DEV),
                  torch.empty(4, 2, dtype=torch.float32, device=DEV), "fp8_block", 128)
    with pytest.raises(ValueError, match=r"out.scale must be torch.int32 \(4, 1\)"):
        quantize_tokens(x, QuantConfig("fp8_block", "ue8m0_packed"), out=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,fmt", FORMATS)
def test_quantize_tokens_bitwise_at_deepseek_shape(recipe, fmt, seed):
    """The compiled kernel (tuned config) at 4096 x 7168, both scale layouts."""
    quant = QuantConfig(recipe, fmt)
    x = _x(4096, 7168, torch.bfloat16)
    ref = quantize_act(x, quant)
    for mn_major in (False, True):
        q = quantize_tokens(x, quant, mn_major=mn_major, out=_poisoned_like(ref, mn_major))
        assert torch.equal(_bits(q.data), _bits(ref.data)), f"{seed=}"
        assert torch.equal(_bits(q.scale), _bits(ref.scale)), f"{seed=}"


@pytest.mark.parametrize("recipe,fmt", FORMATS)
def test_token_quantizer_is_bitwise_the_reference(recipe, fmt, seed):
    """The bound quantizer (one format, its kernel bound once): the reference's codes and
    scales bit for bit, called again with other token counts (0 included)."""
    quant = QuantConfig(recipe, fmt)
    tq = TokenQuantizer(quant, 640, QuantKernelConfig(4, 4, 4))
    for t in (9, 3, 0):
        x = _x(max(t, 3), 640, torch.bfloat16)[:t]
        ref = quantize_act(x, quant)
        q = tq(x)
        assert (q.recipe, q.group, q.scale_fmt) == (ref.recipe, ref.group, ref.scale_fmt)
        assert torch.equal(_bits(q.data), _bits(ref.data)), f"{seed=} {t=}"
        assert torch.equal(_bits(q.scale), _bits(ref.scale)), f"{seed=} {t=}"
    with pytest.raises(ValueError, match="must be \\[T, 640\\]"):
        tq(torch.zeros(2, 512, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="nothing to quantize"):
        TokenQuantizer(QuantConfig("bf16"), 640)
