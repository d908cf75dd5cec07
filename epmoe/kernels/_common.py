"""Helpers shared by the kernel wrappers: interpreter flag, input checks, scale layouts."""

from __future__ import annotations

import os

import epmoe.env  # noqa: F401  (sets TRITON_INTERPRET before triton defines any kernel)
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_tensor(name: str, t: torch.Tensor, dtypes: tuple, dim: int | None = None,
                 contiguous: bool = True) -> None:
    """dtype / rank / contiguity of one kernel input, each failure naming the fix. (On every
    launch: the messages are built only on failure, the host's time is the decode step's.)"""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype ({t.dtype}) must be one of "
                         f"{[str(d) for d in dtypes]}; convert it with .to() first")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} (shape {tuple(t.shape)}, stride {t.stride()}) must be "
                         f"contiguous; call .contiguous() first")


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Same bytes as a signed/unsigned int tensor (copies stay bit-exact, fp8/e8m0 included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def empty_mn_major(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[rows, cols] with strides (1, align(rows, 4)): the TMA-aligned column-major scale layout
    DeepGEMM reads (fp32 on SM90, packed UE8M0 int32 on SM100)."""
    ld = align_up(max(rows, 1), 4)
    return torch.empty_strided((rows, cols), (1, ld), dtype=dtype, device=device)


def is_mn_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.shape[1] > 1 and t.stride(0) == 1


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


# In-kernel rounding helpers. The CPU interpreter's fp32 -> fp8 cast does not carry a rounding
# into the exponent (7.94 -> 4 instead of 8) and its fp32 -> bf16 cast truncates; kernels
# pre-round in fp32 (exact round-to-nearest-even) when INTERPRET so the final cast is exact.
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def round_e4m3(x):
    """fp32 x with |x| <= 448 -> the nearest e4m3 value (ties to even), still fp32."""
    bits = tl.abs(x).to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 255) - 127, -6)  # e4m3 subnormals share 2**-6's quantum
    inv_quantum = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    quantum = ((127 + (e - 3)) << 23).to(tl.float32, bitcast=True)
    t = tl.abs(x) * inv_quantum  # exact (power of two), t < 2**4
    t = ((t + 12582912.0) - 12582912.0) * quantum  # 1.5 * 2**23: round to nearest even integer
    # Copy x's sign bit (a value rounding to zero keeps it: -0.0); `-t` would be 0 - t = +0.0.
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
    return (t.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still fp32 (finite inputs)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_scale(amax, fp8_max, POW2: tl.constexpr):
    """The activation scale rule of `epmoe.quant`: amax / fp8_max with IEEE division (plain /
    is approximate on GPU), rounded up to a power of two when POW2 (exact bit arithmetic).
    -> (scale, the rounded-up biased exponent)."""
    s = tl.math.div_rn(amax, fp8_max)
    bits = s.to(tl.int32, bitcast=True)
    e8 = ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    if POW2:
        s = (e8 << 23).to(tl.float32, bitcast=True)
    return s, e8


@triton.jit
def e8m0_to_fp32(e):
    """e8m0 bytes (biased exponents) -> 2**(e - 127) in fp32 (0: the subnormal 2**-127)."""
    e = e.to(tl.int32)
    return tl.where(e == 0, 0x400000, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def grouped_tile(row_expert_ptr, counts_ptr, arow_ptr, M, N, GRID_M, MASKED: tl.constexpr,
                 A_GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """The pointer grouped GEMMs' tile of program (0, 0, e). Grouped order: GROUP_M consecutive
    M tiles sweep all N tiles together, so the programs in flight share their A rows and
    (mostly one expert's) weight tiles in L2. Masked: M = capacity C, expert e's rows are
    [e*C, e*C + count); contiguous: a tile's expert is its first row's (-1: padding, skipped).
    A_GATHER: output row m reads A's row arow[m] (masked: arow [E, C], read below the count;
    contiguous: arow [M], -1 on padding); rows that read nothing load row 0 (their outputs
    are padding, any value).
    -> (run, expert, output rows, A rows to load, row mask, N offsets, clamped N)."""
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(GRID_M - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    if MASKED:
        e = tl.program_id(2)
        local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        count = tl.load(counts_ptr + e)
        run = pid_m * BLOCK_M < count
        rows = e * M + local
        row_mask = local < M
        rows_ld = e * M + tl.minimum(local, M - 1)  # clamped: loads need no mask
        live = local < count
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        e = tl.load(row_expert_ptr + pid_m * BLOCK_M)
        run = e >= 0
        row_mask = rows < M
        rows_ld = tl.minimum(rows, M - 1)
        live = row_mask
    if A_GATHER:
        arow = tl.load(arow_ptr + rows_ld)
        rows_ld = tl.where(live & (arow >= 0), arow, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_nl = tl.minimum(offs_n, N - 1).to(tl.int64)
    return run, e.to(tl.int64), rows, rows_ld.to(tl.int64), row_mask, offs_n, offs_nl


@triton.jit
def store_tile(acc, c_ptr, stride_cm, rows, row_mask, offs_n, N, bias_ptr, stride_b, e64,
               offs_nl, HAS_BIAS: tl.constexpr, PRE_ROUND: tl.constexpr):
    """acc (+ the expert's fp32 bias row, before the one bf16 rounding) -> c rows, masked."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e64 * stride_b + offs_nl)[None, :]
    if PRE_ROUND:
        acc = round_bf16(acc)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (offs_n < N)[None, :])
