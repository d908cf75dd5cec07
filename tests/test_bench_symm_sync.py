"""python -m epmoe.bench.symm_sync: a GPU benchmark; without CUDA it says so and exits 2."""

from __future__ import annotations

import torch

from epmoe.bench.symm_sync import KERNELS, main


def test_refuses_without_cuda(capsys):
    if torch.cuda.is_available():
        return  # the GPU path is the benchmark itself (BENCHMARKS.md section 7)
    assert main(["--ctas", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_times_every_sync_primitive_and_the_baseline():
    assert {"empty", "arrive_last", "wait_all", "publish", "publish_baseline",
            "send_half"} == set(KERNELS)
