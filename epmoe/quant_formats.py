"""Scale formats and packed codes of the quantization recipes (plain torch, CPU and CUDA):
powers of two, e8m0 bytes, UE8M0 packed four per int32 in DeepGEMM's MN-major TMA layout, and
the e2m1 (fp4) codes of W4A8 MXFP4. `epmoe.quant` builds the recipes on these.
"""

from __future__ import annotations

import torch

E8M0_BIAS = 127
E2M1_MAX = 6.0
# e2m1 magnitudes by code 0..7; bit 0x8 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TMA_ALIGN_INT32 = 4  # 16 bytes of int32


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# --------------------------------------------------------------------------------------------
# Scale formats: powers of two, e8m0 bytes, UE8M0 packed four per int32.

def round_scale_pow2(s: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(s)) for positive fp32 s, exactly (bit arithmetic), never smaller than s.

    A power of two maps to itself; a subnormal s rounds up to 2**-126.
    """
    bits = s.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def e8m0_to_fp32(e: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes (uint8) -> fp32 2**(e - 127); e == 255 is NaN (OCP MX)."""
    if e.dtype != torch.uint8:
        raise ValueError(f"e8m0 exponents must be uint8, got {e.dtype}; pass the raw scale bytes")
    ei = e.to(torch.int32)
    bits = torch.where(ei == 0, torch.full_like(ei, 0x400000), ei << 23)  # 2**-127 is subnormal
    bits = torch.where(ei == 255, torch.full_like(ei, 0x7FC00000), bits)
    return bits.view(torch.float32)


def fp32_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """fp32 powers of two in [2**-127, 2**127] -> uint8 biased exponents. Raises otherwise."""
    if s.dtype != torch.float32:
        raise ValueError(f"e8m0 conversion takes fp32 scales, got {s.dtype}; call .float() first")
    bits = s.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    normal = ((bits & 0x7FFFFF) == 0) & (exp >= 1) & (exp <= 254) & (bits > 0)
    sub = bits == 0x400000
    ok = normal | sub
    if not bool(ok.all()):
        bad = s.reshape(-1)[(~ok).reshape(-1).nonzero()[0, 0]].item()
        raise ValueError(f"scale ({bad!r}) is not a power of two in [2**-127, 2**127]: e8m0 stores "
                         f"only an exponent; round scales with round_scale_pow2 first")
    return torch.where(sub, torch.zeros_like(exp), exp).to(torch.uint8)


def _mn_major(words: torch.Tensor) -> torch.Tensor:
    """Copy int32 [..., MN, W] into the MN-major, TMA-aligned layout DeepGEMM reads:
    strides (W*align(MN,4), 1, align(MN,4)) (batched) / (1, align(MN,4)) (2-D)."""
    squeeze = words.dim() == 2
    if squeeze:
        words = words.unsqueeze(0)
    b, mn, w = words.shape
    out = torch.zeros((b, w, _align(mn, _TMA_ALIGN_INT32)), dtype=torch.int32,
                      device=words.device).mT[:, :mn, :]
    out.copy_(words)
    return out.squeeze(0) if squeeze else out


def _pack_exponents(e: torch.Tensor) -> torch.Tensor:
    """uint8 exponents [..., MN, G] -> int32 [..., MN, ceil(G/4)]: group 4j+b is byte b
    (little-endian) of word j, zero-padded; MN-major TMA-aligned (see `_mn_major`)."""
    g = e.shape[-1]
    gp = _align(g, 4)
    padded = torch.zeros((*e.shape[:-1], gp), dtype=torch.uint8, device=e.device)
    padded[..., :g] = e
    return _mn_major(padded.view(torch.int32))


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales [MN, G] or [E, MN, G] -> int32 [(E,) MN, ceil(G/4)].

    Byte e = biased exponent (fp32 bits 23..30); G is zero-padded to a multiple of 4; group 4j+b
    is byte b (little-endian) of word j. Stored MN-major with the MN stride padded to a multiple
    of 4 (16 bytes): strides (1, align(MN,4)), batched (Gp/4*align(MN,4), 1, align(MN,4)).
    Same layout as DeepGEMM's get_mn_major_tma_aligned_packed_ue8m0_tensor.
    """
    if scale.dim() not in (2, 3):
        raise ValueError(f"pack_ue8m0 takes scales [MN, G] or [E, MN, G], got shape "
                         f"{tuple(scale.shape)}; reshape to 2-D or 3-D first")
    return _pack_exponents(fp32_to_e8m0(scale))


def unpack_ue8m0(packed: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Inverse of pack_ue8m0: int32 [(E,) MN, W] (any strides) -> fp32 [(E,) MN, num_groups]."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed UE8M0 scales must be int32, got {packed.dtype}")
    w = packed.shape[-1]
    if not 4 * (w - 1) < num_groups <= 4 * w:
        raise ValueError(f"num_groups ({num_groups}) does not fit {w} packed words "
                         f"(needs {4 * (w - 1) + 1}..{4 * w}); pass the unpadded group count")
    dense = torch.empty(packed.shape, dtype=torch.int32, device=packed.device).copy_(packed)
    e = dense.view(torch.uint8)[..., :num_groups]  # (contiguous() keeps a size-1 dim's stride)
    return e8m0_to_fp32(e)


# --------------------------------------------------------------------------------------------
# e2m1 (fp4) codes: sign bit 0x8, magnitude code 0..7 indexing E2M1_VALUES.

def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> uint8 codes 0..15.

    Magnitudes round to the nearest of E2M1_VALUES, ties to the even code (0.25 -> 0, 0.75 -> 1.0,
    5 -> 4), and saturate at 6. Negative values (including ones rounding to 0) set bit 0x8.
    """
    xf = x.float()
    a = xf.abs().clamp(max=E2M1_MAX)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    lo = torch.bucketize(a, mids, right=False)  # a tie goes to the lower code
    hi = torch.bucketize(a, mids, right=True)   # a tie goes to the upper code
    mag = torch.where(lo % 2 == 0, lo, hi)
    return (mag | ((xf < 0).to(mag.dtype) << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> fp32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                         device=codes.device)
    return table[codes.long() & 0xF]


def e2m1_pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> bytes [..., K//2]; the LOW nibble is the even column."""
    if codes.shape[-1] % 2:
        raise ValueError(f"e2m1_pack needs an even last dim, got {codes.shape[-1]}")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def e2m1_unpack(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K//2] -> uint8 codes [..., K] (low nibble first)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
