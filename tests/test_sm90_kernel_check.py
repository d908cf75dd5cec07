"""tools/sm90_kernel_check.py stays in step with the kernels it compiles: the W4A8 GEMM at a
decode BLOCK_M compiles for sm_90 on this GPU-less box and ptxas reports its registers."""

import json
import os
import subprocess
import sys

import pytest

TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "sm90_kernel_check.py")


def test_the_w4a8_gemm_compiles_for_sm90():
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this triton wheel bundles no ptxas")
    out = subprocess.run([sys.executable, TOOL, "--set", "w4a8", "--only", "bm16 bn64 w4 s4",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["kernel"] for r in rows] == ["w4a8 bm16 bn64 w4 s4"]
    assert 0 < rows[0]["registers"] <= 255 and rows[0]["warps"] == 4


def test_an_unknown_set_is_exit_2():
    out = subprocess.run([sys.executable, TOOL, "--set", "nope"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "invalid choice" in out.stderr
