"""tools/build_gpu_deps.sh on CPU: argument checks and the source assembly (--prepare-only) from
stand-in source folders: DeepGEMM's empty submodules filled with CUTLASS/CuTe from a wheel or a
folder and fmt's include/, the given sources left untouched. The compile itself needs CUDA."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "build_gpu_deps.sh"


def _write(path: Path, text: str = "x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def sources(tmp_path):
    src = tmp_path / "src"
    _write(src / "DeepEP" / "setup.py")
    _write(src / "DeepEP" / "csrc" / "deep_ep.cpp")
    _write(src / "DeepGEMM" / "setup.py")
    _write(src / "DeepGEMM" / "deep_gemm" / "__init__.py")
    (src / "DeepGEMM" / "third-party" / "cutlass").mkdir(parents=True)  # empty submodule
    _write(src / "fmt" / "include" / "fmt" / "format.h", "fmt")
    whl = tmp_path / "sgl_deep_gemm-0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("deep_gemm/include/cute/tensor.hpp", "cute")
        z.writestr("deep_gemm/include/cutlass/cutlass.h", "cutlass")
        z.writestr("deep_gemm/__init__.py", "")
    return src, whl


def _run(*args, cwd):
    return subprocess.run(["bash", str(SCRIPT), "--python", sys.executable, *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_prepare_only_assembles_deepgemm_third_party_from_the_wheel(sources, tmp_path):
    src, whl = sources
    work = tmp_path / "work"
    r = _run("--prepare-only", "--src", src, "--cutlass-wheel", whl, "--target",
             tmp_path / "site", "--work", work, cwd=tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    tp = work / "DeepGEMM" / "third-party"
    assert (tp / "cutlass" / "include" / "cute" / "tensor.hpp").read_text() == "cute"
    assert (tp / "cutlass" / "include" / "cutlass" / "cutlass.h").read_text() == "cutlass"
    assert (tp / "fmt" / "include" / "fmt" / "format.h").read_text() == "fmt"
    assert (work / "DeepEP" / "csrc" / "deep_ep.cpp").is_file()
    assert not any((src / "DeepGEMM" / "third-party" / "cutlass").iterdir())  # source untouched


def test_cutlass_from_a_folder(sources, tmp_path):
    src, _ = sources
    inc = tmp_path / "inc"
    _write(inc / "cute" / "a.hpp", "A")
    _write(inc / "cutlass" / "b.h", "B")
    work = tmp_path / "work"
    r = _run("--prepare-only", "--only", "deepgemm", "--src", src, "--cutlass-include", inc,
             "--target", tmp_path / "site", "--work", work, cwd=tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    assert (work / "DeepGEMM/third-party/cutlass/include/cute/a.hpp").read_text() == "A"
    assert not (work / "DeepEP").exists()  # --only deepgemm


@pytest.mark.parametrize("args,match", [
    ((), "--target DIR is required"),
    (("--target", "t", "--only", "nccl"), r"--only \(nccl\) must be deepep or deepgemm"),
    (("--target", "t", "--bogus"), "unknown argument '--bogus'"),
])
def test_argument_errors_name_the_fix(args, match, tmp_path):
    import re

    r = _run(*args, cwd=tmp_path)
    assert r.returncode != 0 and re.search(match, r.stderr), r.stderr


def test_missing_cutlass_says_where_to_get_it(sources, tmp_path):
    src, _ = sources
    r = _run("--prepare-only", "--only", "deepgemm", "--src", src, "--target", tmp_path / "site",
             "--work", tmp_path / "work", cwd=tmp_path)
    assert r.returncode != 0
    assert "--cutlass-include DIR" in r.stderr and "--cutlass-wheel" in r.stderr, r.stderr
