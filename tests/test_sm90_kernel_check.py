"""tools/sm90_kernel_check.py stays in step with the kernels it compiles: the W4A8 GEMM at a
decode BLOCK_M compiles for sm_90 on this GPU-less box and ptxas reports its registers, and
every variant of the layer's kernels compiles (the CPU tests run them under the interpreter,
which accepts code the compiler refuses)."""

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


def test_every_layer_kernel_variant_compiles_for_sm90():
    """`--set layer`: grouped GEMMs (each recipe, layout, gathered rows), permute, gather,
    act + quant, router (tools/sm90_layer_kernels.py) through ptxas; the first kernel that
    does not compile fails the tool, naming it."""
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this triton wheel bundles no ptxas")
    jobs = str(min(4, os.cpu_count() or 1))  # forked compiles, output in the list's order
    out = subprocess.run([sys.executable, TOOL, "--set", "layer", "--json", "--jobs", jobs],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    names = [r["kernel"] for r in rows]
    assert len(rows) == 61 and len(set(names)) == 61, names
    for kind in ("pointer", "w4a8", "tma", "scatter", "gather", "act_quant", "router"):
        assert any(n.startswith(kind) for n in names), kind
    assert sum("gather=True" in n for n in names) == 16
    assert all(0 < r["registers"] <= 255 for r in rows), rows


def test_an_unknown_set_is_exit_2():
    out = subprocess.run([sys.executable, TOOL, "--set", "nope"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "invalid choice" in out.stderr
    out = subprocess.run([sys.executable, TOOL, "--jobs", "0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--jobs (0) must be >= 1" in out.stderr


def _run_with_tool(body: str) -> None:
    """Run `body` with the tool imported as `tool`, in a process of its own: the tool turns
    Triton's interpreter off for the process that imports it (it compiles for real)."""
    prog = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('sm90_kernel_check', {TOOL!r})\n"
            "tool = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(tool)\n" + body)
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_symm_kernel_gets_exactly_its_arguments():
    """A kernel that gained an argument fails here, not at the tool's first compile."""
    _run_with_tool("""
listed = tool.kernels(7168)
assert len(listed) >= 14, len(listed)
for name, fn, sig, consts, _ in listed:
    assert tool.unbound_args(fn, sig, consts) == "", (name, tool.unbound_args(fn, sig, consts))
for name, fn, sig, consts, *_ in tool.w4a8_kernels():
    assert tool.unbound_args(fn, sig, consts) == "", (name, tool.unbound_args(fn, sig, consts))
""")


def test_an_argument_the_list_lacks_is_named():
    _run_with_tool("""
name, fn, sig, consts, fusion = tool.kernels(7168)[-1]
sig = {k: v for k, v in sig.items() if k != "limit"}
try:
    tool.compile_sm90(fn, sig, {**consts, "NOPE": 1}, 4, fusion)
    raise SystemExit("compiled")
except ValueError as exc:
    assert "no value for ['limit']" in str(exc), exc
    assert "not an argument: ['NOPE']" in str(exc), exc
""")
