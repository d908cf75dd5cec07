"""python -m epmoe.bench.symm_sync: a GPU benchmark; without CUDA it says so and exits 2."""

from __future__ import annotations

import pytest
import torch

from epmoe.bench.symm_sync import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path is the benchmark itself "
                                                      "(BENCHMARKS.md section 7)")
def test_refuses_without_cuda(capsys):
    assert main(["--ctas", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_table_puts_each_primitive_beside_its_baseline():
    """Kernels down, CTA counts across, 80 columns; a ratio is the time beyond the empty
    kernel over the baseline's (made-up figures: the arithmetic, not a measurement)."""
    from epmoe.bench.symm_sync import KERNELS, table

    rows = []
    for ctas, extra in ((1, 0.0), (24, 0.5), (132, 1.0)):
        us = dict.fromkeys(KERNELS, 3.0 + extra)
        us.update(empty=1.0, arrive_last=2.0 + extra, arrive_baseline=3.0 + extra,
                  publish=1.5, publish_baseline=2.0)
        rows.append({"ctas": ctas, "us_per_launch": us})
    lines = table(rows).splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert lines[0].split()[3:] == ["1", "CTAs", "24", "CTAs", "132", "CTAs"]
    by_name = {line.split()[0]: line.split()[1:] for line in lines[2:2 + len(KERNELS)]}
    assert list(by_name) == list(KERNELS)
    assert by_name["arrive_last"] == ["2.00", "2.50", "3.00"]
    ratio = next(line for line in lines if line.startswith("arrive_last / base"))
    assert ratio.split()[-3:] == ["0.50x", "0.60x", "0.67x"]
    ratio = next(line for line in lines if line.startswith("publish / base"))
    assert ratio.split()[-3:] == ["0.50x", "0.50x", "0.50x"]
