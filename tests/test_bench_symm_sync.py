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
