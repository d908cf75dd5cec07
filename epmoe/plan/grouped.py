"""A grouped GEMM's time from each expert's own rows.

A grouped GEMM (the contiguous layout or the masked one) runs each expert's rows in blocks of
`align` rows against that expert's weights. A profile's curve is measured with every expert
holding the same rows, so it gives one expert's time at x rows:

    tau(x) = max(FLOPs(aligned x) / TFLOPS(key), bytes(one expert's weights, aligned x) / HBM)

with key = the real rows below one aligned block (a block of mostly padding runs at the rate
measured there), else the aligned rows. tau is flat while the weight read dominates and grows
linearly once the blocks are compute bound, so a step does not take E x tau(mean rows): it
takes the sum over the experts of tau at each one's own rows. Skewed routing therefore costs
more than its mean rows per expert say (the hot experts are compute bound, the cold ones
still read their weights), and an expert with no row costs nothing.

One expert's rows in one step are Poisson around its expected rows (each token's experts are
drawn independently of the others'); tau's expectation is taken over that distribution:
exactly for means up to NORMAL_ABOVE rows, above with the normal approximation per aligned
block (continuity-corrected).

    t_us = grouped_gemm_us(curve, quant, slot_rows, n, k, align=128, hbm_GBps=4800.0)
"""

from __future__ import annotations

import math
from collections import Counter

from epmoe.config import QuantConfig
from epmoe.plan import traffic as tr
from epmoe.plan.figures import GemmCurve

NORMAL_ABOVE = 100.0  # mean rows above which a Poisson count is taken as normal
TAIL = 1e-9  # probability mass left out of a distribution's tail
SIGMAS = 8.0  # blocks within this many standard deviations of the mean are visited


def expert_us(curve: GemmCurve, quant: QuantConfig, aligned: float, key: float, n: int,
              k: int, hbm_GBps: float) -> float:
    """tau: one expert's GEMM at `aligned` rows (FLOPs and bytes), the curve read at `key`."""
    if aligned <= 0:
        return 0.0
    flops_us = tr.gemm_flops(aligned, n, k) / (curve.tflops(key) * 1e6)
    return max(flops_us, tr.gemm_bytes(aligned, 1, n, k, quant) / (hbm_GBps * 1e3))


def row_buckets(m: float, align: int) -> list[tuple[float, float, float]]:
    """(probability, curve key, aligned rows) of one expert's rows X ~ Poisson(m) in a step,
    X > 0 only: each X below one block (keyed by X, one block of rows), then by aligned block,
    X in ((j - 1) align, j align] (keyed by the aligned rows j align). Above NORMAL_ABOVE the
    counts below one block are one bucket keyed by their mean (the curve is flat there, the
    block weight-read bound). align <= 1 (exact rows, a cost linear in them): one bucket at the
    mean of X given X > 0."""
    if m <= 0:
        return []
    hit = -math.expm1(-m)
    if align <= 1:
        return [(hit, m / hit, m / hit)]
    if m > NORMAL_ABOVE:
        return _normal_buckets(m, align)
    out: list[tuple[float, float, float]] = []
    blocks: dict[int, float] = {}
    p, cdf, x = math.exp(-m), math.exp(-m), 0
    while cdf < 1 - TAIL:
        x += 1
        p *= m / x
        cdf += p
        if x < align:  # below one block: each count read at its own rows
            out.append((p, float(x), float(align)))
        else:
            j = -(-x // align)
            blocks[j] = blocks.get(j, 0.0) + p
    return out + [(pj, float(j * align), float(j * align)) for j, pj in sorted(blocks.items())]


def _phi(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2))


def _normal_buckets(m: float, align: int) -> list[tuple[float, float, float]]:
    s = math.sqrt(m)

    def z(rows: float) -> float:  # P(X <= rows) = _cdf(z(rows))
        return (rows + 0.5 - m) / s

    lo = max(1, int((m - SIGMAS * s) // align))
    hi = max(lo, int(-(-(m + SIGMAS * s) // align)))
    out = []
    for j in range(lo, hi + 1):
        a, b = z(0 if j == 1 else (j - 1) * align), z(j * align)
        pj = _cdf(b) - _cdf(a)
        if pj <= TAIL:
            continue
        key = m + s * (_phi(a) - _phi(b)) / pj if j == 1 else j * align  # truncated mean
        out.append((pj, min(max(key, 1.0), align) if j == 1 else key, j * align))
    return out


def grouped_gemm_us(curve: GemmCurve, quant: QuantConfig, slot_rows, n: int, k: int,
                    align: int, hbm_GBps: float) -> float:
    """Sum over the experts (slot_rows: each one's expected rows in a step) of E[tau]."""
    tau: dict[tuple[float, float], float] = {}  # (aligned, key) -> us, shared by the experts
    total = 0.0
    for m, count in Counter(float(r) for r in slot_rows if r > 0).items():
        for p, key, aligned in row_buckets(m, align):
            t = tau.get((aligned, key))
            if t is None:
                t = tau[aligned, key] = expert_us(curve, quant, aligned, key, n, k, hbm_GBps)
            total += count * p * t
    return total
