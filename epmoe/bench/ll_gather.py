"""`python -m epmoe.bench.ll_gather`: symm-ll's three ways into the Triton experts, timed with
the experts (one GPU, the loopback world of 2 ranks, DeepSeek-V3 dims; the loop and its timing
are `epmoe.bench.gather_ways`').

    direct    a row per (token, expert) stored into the peers' masked layout (the default)
    staged    ll_dedup: a token once per rank, the receive copies it into its experts' rows
    gathered  ll_dedup + ll_gather: the receive copies nothing; GEMM1 reads the staged rows
              through the index (`MaskedBatch.rows_EC`)
"""

from __future__ import annotations

from epmoe.bench.gather_ways import cli

WAYS = {"direct": {}, "staged": {"ll_dedup": True},
        "gathered": {"ll_dedup": True, "ll_gather": True}}


def main(argv=None) -> int:
    from epmoe.comm.symm.ll import SymmLowLatencyComm

    return cli("python -m epmoe.bench.ll_gather", __doc__, SymmLowLatencyComm, WAYS, "staged",
               (1, 8, 128, 256), argv)


if __name__ == "__main__":
    raise SystemExit(main())
