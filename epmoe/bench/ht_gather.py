"""`python -m epmoe.bench.ht_gather`: symm-ht's two ways into the Triton experts, timed with
the experts (one GPU, the loopback world of 2 ranks, DeepSeek-V3 dims; the loop and its timing
are `epmoe.bench.gather_ways`').

    copied    the receive stores each row into the contiguous layout, once per local expert
              of its token (the default)
    gathered  ht_gather: the receive writes each layout row's arena slot (own rows copied
              into the arena once); GEMM1 reads the rows through it (`LayoutBatch.rows_M`)

On one GPU the loopback receive's copy is a local one; on a link it is what bounds symm-ht's
dispatch (BENCHMARKS.md 20), so `epmoe.bench.comm --sweep` on two GPUs measures the rest.
"""

from __future__ import annotations

from epmoe.bench.gather_ways import cli

WAYS = {"copied": {}, "gathered": {"ht_gather": True}}


def main(argv=None) -> int:
    from epmoe.comm.symm.ht import SymmHighThroughputComm

    return cli("python -m epmoe.bench.ht_gather", __doc__, SymmHighThroughputComm, WAYS,
               "copied", (512, 2048, 4096), argv)


if __name__ == "__main__":
    raise SystemExit(main())
