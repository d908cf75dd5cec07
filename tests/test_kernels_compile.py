"""The grouped GEMM, permute, gather, act + quant and router kernels compile for sm_90
(H100 / H200) on a machine without a GPU: Triton's GPU passes, LLVM and ptxas run on the CPU
(tests/kernel_compile.py, a subprocess: epmoe defines its kernels for the interpreter there
otherwise). The CPU tests run the kernels under the interpreter, which accepts code the
compiler refuses; this catches that before a GPU run. A deliberately broken kernel must
fail, so the harness can."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).with_name("kernel_compile.py")


def _compile(group: str, cache: Path) -> list[dict]:
    """Compiled afresh (a cache of its own: nothing read from an earlier run)."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    p = subprocess.run([sys.executable, str(HELPER), group], capture_output=True, text=True,
                       timeout=600, cwd=HELPER.parent.parent, env=env)
    if p.returncode == 77:
        pytest.skip(f"Triton cannot compile for sm_90 here: {p.stdout.strip()}")
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("group,cases", [("pointer", 20), ("w4a8", 8), ("tma", 4),
                                         ("layout", 8), ("act_quant", 6), ("router", 14)])
def test_kernels_compile_for_sm90(group, cases, tmp_path):
    """GEMMs: each layout (contiguous / masked), recipe and the gathered-row (A_GATHER)
    variant; the permute's count and scatter ways and the gather; the act + quant's output
    formats, activations and row masks; the router's kinds, fused or not, hashed or not."""
    rows = _compile(group, tmp_path)
    assert len(rows) == cases, rows
    bad = [f"{r['case']}: {r['error']}" for r in rows if not r["ok"]]
    assert not bad, "\n".join(bad)


def test_the_harness_reports_a_kernel_that_does_not_compile(tmp_path):
    [row] = _compile("broken", tmp_path)
    assert not row["ok"] and "incompatible dimensions" in row["error"], row
