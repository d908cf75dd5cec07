"""The grouped GEMM's time over each expert's own rows (epmoe/plan/grouped.py): the bucketed
Poisson expectation against a direct sum over every row count, and the mechanism it models
(a weight-read-bound expert costs the same at any rows; skew costs more than its mean)."""

from __future__ import annotations

import math

import pytest

from epmoe.config import QuantConfig
from epmoe.plan import traffic as tr
from epmoe.plan.figures import GemmCurve, Provenance
from epmoe.plan.grouped import NORMAL_ABOVE, expert_us, grouped_gemm_us, row_buckets

P = Provenance("measured", "test")
Q = QuantConfig("bf16")
N, K, ALIGN = 512, 1024, 128
# flat time (weight-read bound) up to one block, compute bound from four blocks on
CURVE = GemmCurve("deepgemm", "bf16", "contiguous", N, K,
                  ((4.0, 40.0), (128.0, 300.0), (256.0, 500.0), (512.0, 600.0)), P)
NO_HBM = 1e12  # no HBM floor: the curve alone


def _direct(m: float, align: int, hbm: float = NO_HBM) -> float:
    """E[tau(X)], X ~ Poisson(m), summed over every x (log-space pmf, no buckets)."""
    total, x = 0.0, 1
    while x < m + 20 * math.sqrt(m) + 2 * align:
        p = math.exp(x * math.log(m) - m - math.lgamma(x + 1))
        aligned = -(-x // align) * align
        total += p * expert_us(CURVE, Q, aligned, x if x < align else aligned, N, K, hbm)
        x += 1
    return total


@pytest.mark.parametrize("m", [0.2, 3.0, 40.0, 97.0, 128.0, 300.0, 700.0])
def test_the_buckets_carry_the_mass_of_a_row_and_its_expected_time(m):
    buckets = row_buckets(m, ALIGN)
    assert sum(p for p, _, _ in buckets) == pytest.approx(-math.expm1(-m), abs=1e-7)
    exact_rows = sum(p * a for p, _, a in buckets)
    direct_rows = sum(math.exp(x * math.log(m) - m - math.lgamma(x + 1)) * -(-x // ALIGN) * ALIGN
                      for x in range(1, int(m + 20 * math.sqrt(m) + 2 * ALIGN)))
    assert exact_rows == pytest.approx(direct_rows, rel=1e-2 if m > NORMAL_ABOVE else 1e-7)
    got = grouped_gemm_us(CURVE, Q, [m], N, K, ALIGN, NO_HBM)
    # below NORMAL_ABOVE exact (up to the tail left out); above, the normal approximation
    assert got == pytest.approx(_direct(m, ALIGN), rel=2e-2 if m > NORMAL_ABOVE else 1e-7)


def test_an_expert_with_no_row_costs_nothing():
    assert grouped_gemm_us(CURVE, Q, [0.0] * 8, N, K, ALIGN, NO_HBM) == 0.0
    # 1e-4 expected rows: busy in 1e-4 of the steps, then with one row (read at the m = 4
    # point, below the curve's first one) in one padded block
    one_row = expert_us(CURVE, Q, 128, 1.0, N, K, NO_HBM)
    assert one_row == pytest.approx(tr.gemm_flops(128, N, K) / 40e6)
    assert grouped_gemm_us(CURVE, Q, [1e-4] * 8, N, K, ALIGN, NO_HBM) == pytest.approx(
        8 * 1e-4 * one_row, rel=1e-3)


def test_skewed_rows_cost_the_sum_of_their_experts_more_than_their_mean_says():
    """One expert at 1024 rows and seven at 32: the hot one is compute bound, the cold ones
    each still pay a whole block; eight experts at the mean (156 rows) would cost less."""
    skew = [1024.0] + [32.0] * 7
    mean = sum(skew) / len(skew)
    per_expert = grouped_gemm_us(CURVE, Q, skew, N, K, ALIGN, NO_HBM)
    assert per_expert > 1.2 * grouped_gemm_us(CURVE, Q, [mean] * 8, N, K, ALIGN, NO_HBM)
    hot = grouped_gemm_us(CURVE, Q, [1024.0], N, K, ALIGN, NO_HBM)
    cold = grouped_gemm_us(CURVE, Q, [32.0], N, K, ALIGN, NO_HBM)
    assert per_expert == pytest.approx(hot + 7 * cold, rel=1e-9)


def test_the_hbm_floor_holds_per_expert():
    """With a slow HBM every expert costs at least its weights' read, however few its rows."""
    hbm = 10.0  # GB/s
    floor = tr.gemm_bytes(128, 1, N, K, Q) / (hbm * 1e3)
    assert expert_us(CURVE, Q, 128, 4.0, N, K, hbm) == pytest.approx(floor)
    got = grouped_gemm_us(CURVE, Q, [50.0] * 4, N, K, ALIGN, hbm)
    assert got == pytest.approx(4 * floor, rel=1e-6)  # Poisson(50) never fills a block


def test_exact_rows_without_alignment_take_the_mean_of_a_busy_expert():
    torch_curve = GemmCurve("torch", "bf16", "contiguous", N, K, ((4096.0, 47.0),), P)
    got = grouped_gemm_us(torch_curve, Q, [10.0] * 3, N, K, 1, NO_HBM)
    assert got == pytest.approx(3 * tr.gemm_flops(10.0, N, K) / 47e6, rel=1e-9)
