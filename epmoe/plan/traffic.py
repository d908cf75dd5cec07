"""Bytes and FLOPs of each piece of one MoE layer: the one place these counts live.

The cost model divides them by the profile's fitted bandwidths; calibrate divides measured
times by the same counts to fit those bandwidths, so a fit and its use can never disagree.
Row counts: N tokens in, P (token, expert) pairs that land on this rank, M = P rounded up per
expert to the GEMM's alignment. D hidden, I intermediate per expert (per tp shard).
"""

from __future__ import annotations

from epmoe.config import QuantConfig

SCALE_BYTES = 4  # fp32 scale per group on the wire (UE8M0 travels as fp32 too: comm/wire.py)
INDEX_BYTES = 4  # an int32 id or row index
LL_HEADER_BYTES = 16  # DeepEP low-latency message header per (token, expert)
# The fused act+quant kernel computes an expert's rows in blocks of this many and skips padding
# (kernels/act_quant.py, its GPU BLOCK_M): an expert with m rows costs ceil(m / 16) * 16 rows
ACT_BLOCK_ROWS = 16


def act_row_bytes(d: int, quant: QuantConfig) -> float:
    """One activation row as quantized for the wire / the GEMM: data + scales."""
    if quant.recipe == "bf16":
        return 2.0 * d
    return d + d / quant.act_group * SCALE_BYTES


def weight_bytes_per_elem(quant: QuantConfig) -> float:
    """Stored weight bytes per element, scales included."""
    if quant.recipe == "bf16":
        return 2.0
    if quant.recipe == "fp8_block":
        return 1.0 + SCALE_BYTES / (128 * 128)
    if quant.recipe == "mxfp8":
        return 1.0 + 1 / 32
    return 0.5 + 1 / 32  # w4a8_mxfp4: e2m1 two per byte, e8m0 per 32


def gemm_flops(m_rows: float, n: int, k: int) -> float:
    return 2.0 * m_rows * n * k


def gemm_bytes(m_rows: float, num_experts: int, n: int, k: int, quant: QuantConfig) -> float:
    """Weights of every expert read once, activations in, bf16 out."""
    return (num_experts * n * k * weight_bytes_per_elem(quant) + m_rows * act_row_bytes(k, quant)
            + m_rows * n * 2.0)


# The recipes whose Triton experts read tokens in place (TritonExperts.TOKEN_GATHER_RECIPES;
# a test holds the two together, the cost model imports no experts backend).
TRITON_TOKEN_GATHER = ("bf16", "mxfp8")


def permute_copies_rows(experts: str, recipe: str) -> bool:
    """Whether the experts' permute copies each (token, expert) row into the layout; not where
    GEMM1 reads the tokens in place through the layout's row -> token index (the Triton
    experts' TRITON_TOKEN_GATHER recipes)."""
    return not (experts == "triton" and recipe in TRITON_TOKEN_GATHER)


def permute_bytes(n_tokens: float, pairs: float, d: int, quant: QuantConfig,
                  experts: str = "") -> float:
    """Each token row read once, written once per local (token, expert) pair; where the rows
    stay in place (`permute_copies_rows`), per pair its id read and its row and token index
    written."""
    if not permute_copies_rows(experts, quant.recipe):
        return pairs * 3.0 * INDEX_BYTES
    row = act_row_bytes(d, quant)
    return n_tokens * row + pairs * row


def gather_bytes(n_tokens: float, pairs: float, d: int) -> float:
    """bf16 expert outputs read per pair, fp32 weighted sums written per token."""
    return pairs * 2.0 * d + n_tokens * 4.0 * d


def act_quant_bytes(rows: float, inter: int, quant: QuantConfig) -> float:
    """bf16 GEMM1 output [rows, 2I] read, activation [rows, I] written quantized."""
    return rows * (2.0 * 2 * inter + act_row_bytes(inter, quant))


def quantize_bytes(n_tokens: float, d: int, quant: QuantConfig) -> float:
    """bf16 tokens read, quantized rows written (0 for bf16: no kernel runs)."""
    if quant.recipe == "bf16":
        return 0.0
    return n_tokens * (2.0 * d + act_row_bytes(d, quant))


def expert_weight_bytes(num_experts: int, d: int, inter: int, quant: QuantConfig) -> float:
    """w13 [E, 2I, D] and w2 [E, D, I]."""
    return num_experts * 3.0 * inter * d * weight_bytes_per_elem(quant)


def local_dispatch_bytes(n_tokens: float, k: int) -> float:
    """The local backend's id mapping (comm/base.py to_local) beyond its quantize: the int32
    ids and fp32 weights of every (token, k) slot read and written once."""
    return n_tokens * k * 8.0 * 2


def local_combine_bytes(n_tokens: float, d: int) -> float:
    """The local backend's combine: the fp32 weighted sums read, bf16 rows written."""
    return n_tokens * d * 6.0


def norm_bytes(n_rows: float, d: int) -> float:
    """The pre-norm between two layers (runtime.pre_norm): bf16 residual rows read, bf16
    normalized rows written."""
    return n_rows * d * 4.0


def residual_bytes(n_rows: float, d: int) -> float:
    """The residual add after a layer (runtime.residual_add): two bf16 rows read, one
    written."""
    return n_rows * d * 6.0


# the work between two layers (cost.BETWEEN): stage -> its bytes over (rows, hidden)
BETWEEN_BYTES = {"norm": norm_bytes, "residual": residual_bytes}


def router_bytes(n_tokens: float, d: int, num_experts: int) -> float:
    """The router: bf16 token rows read, fp32 logits written and read back for the top-k."""
    return n_tokens * (2.0 * d + 8.0 * num_experts)
