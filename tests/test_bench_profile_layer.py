"""bench.profile_layer on the CPU: its arguments, its table, and the timer's host clock it
reads (the GPU comparison itself needs CUDA)."""

from __future__ import annotations

import time

import pytest
import torch

from epmoe.bench import profile_layer as P
from epmoe.timing import StageTimer


def test_host_clock_records_each_stage_when_asked():
    timer = StageTimer(enabled=True, device="cpu", host=True)
    for _ in range(3):
        with timer.stage("a"):
            time.sleep(0.002)
            with timer.stage("a.b"):
                pass
    ms, host = timer.collect(), timer.collect_host()
    assert set(host) == {"a", "a.b"} and len(host["a"]) == 3
    assert host == ms and min(host["a"]) >= 2.0
    plain = StageTimer(enabled=True, device="cpu")
    with plain.stage("a"):
        pass
    assert plain.collect_host() == {}
    timer.reset()
    assert timer.collect_host() == {}


def test_table_fits_80_columns_and_says_which_stage_waits_on_the_host():
    res = {"model": "deepseek-v3", "recipe": "fp8_block", "experts": "triton", "tokens": 128,
           "forward_host_ms": 2.5,
           "stages": {"router": {"launched": 0.30, "device": 0.12, "host": 0.26},
                      "experts.gemm1": {"launched": 1.6, "device": 1.5, "host": 0.2}},
           "host_top": [{"where": "jit.py:695(run)" + "x" * 80, "own_ms_per_forward": 0.28,
                         "calls_per_forward": 12.0}],
           "warning": "w"}
    out = P.table(res)
    assert all(len(line) <= 80 for line in out.splitlines()), out
    router = next(line for line in out.splitlines() if line.startswith("router"))
    assert router.split()[1:] == ["0.300", "0.120", "0.260", "2.50"]
    assert "jit.py:695(run)" in out and "warning: w" in out


@pytest.mark.parametrize("argv", [["--tokens", "x"], ["--tokens", "0"], ["--reps", "0"],
                                  ["--host-top", "-1"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:  # argparse's refusal, before anything runs
        P.main(argv)
    assert e.value.code == 2
    assert "error: argument --" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert P.main(["--tokens", "8"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
