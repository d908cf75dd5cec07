"""Output paths are checked before a command starts (epmoe.outputs): every CLI that writes a
file or a folder exits 2 at argument parsing on one it cannot write, naming the path."""

from __future__ import annotations

import importlib
import os

import pytest

from epmoe.outputs import dir_problem, file_problem

# (module, the flag that writes, file or folder, other arguments the parser requires)
WRITERS = [
    ("epmoe.plan.__main__", "--out", "file", ["--model", "deepseek-v3"]),
    ("epmoe.sim.__main__", "--out", "dir", []),
    ("epmoe.bench.calibrate", "--out", "file", []),
    ("epmoe.bench.comm", "--json", "file", []),
    ("epmoe.bench.comm", "--jsonl", "file", []),
    ("epmoe.bench.kernels", "--json", "file", []),
    ("epmoe.bench.w4a8_gemm", "--json", "file", []),
    ("epmoe.bench.graph_step", "--json", "file", []),
    ("epmoe.bench.gpu_moe", "--json", "file", []),
    ("epmoe.bench.eplb_placement", "--json", "file", []),
    ("epmoe.bench.profile_layer", "--json", "file", []),
    ("epmoe.bench.expert_bias", "--json", "file", []),
    ("epmoe.bench.plan_accuracy", "--json", "file", []),
    ("epmoe.bench.symm_sync", "--json", "file", []),
    ("epmoe.bench.kernel_tune", "--out", "dir", []),
    ("epmoe.bench.integration", "--out", "dir", []),
]


def test_the_rules(tmp_path):
    f = tmp_path / "x.json"
    assert file_problem(str(f)) is None and dir_problem(str(tmp_path / "a" / "b")) is None
    assert "is a folder" in file_problem(str(tmp_path))
    assert "does not exist" in file_problem(str(tmp_path / "no" / "x.json"))
    f.write_text("{}")
    assert "is a file" in dir_problem(str(f))
    assert "is a file, not a folder" in dir_problem(str(f / "sub"))
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        assert "not writable" in file_problem(str(ro / "x.json"))
        assert "not writable" in dir_problem(str(ro / "d"))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_what_the_permission_bits_do_not_tell_is_tried(tmp_path):
    """/proc takes no new files, whatever os.access says (as root it says yes to all); the
    probes leave nothing behind where they succeed."""
    assert "cannot be written" in file_problem("/proc/x.json")
    assert "cannot be written" in dir_problem("/proc/x/y")
    f, d = tmp_path / "new.json", tmp_path / "a" / "b"
    assert file_problem(str(f)) is None and dir_problem(str(d)) is None
    assert sorted(tmp_path.iterdir()) == []  # neither the file nor the folders stay
    f.write_text("kept")
    assert file_problem(str(f)) is None and f.read_text() == "kept"


@pytest.mark.parametrize("module,flag,kind,extra", WRITERS,
                         ids=[f"{m.split('.')[-1]}{f}" for m, f, _, _ in WRITERS])
def test_a_path_it_cannot_write_is_exit_2_before_anything_starts(module, flag, kind, extra,
                                                                 tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = str(blocker / ("x.json" if kind == "file" else "out"))
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exc:
        main([*extra, flag, bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and bad in err, err


def test_a_launch_whose_outputs_fail_at_the_end_prints_first_and_exits_3(monkeypatch, capsys,
                                                                         tmp_path):
    """--out checked up front, then the disk fills during the run: the tables are on stdout,
    one error line says what failed, exit 3 (not a traceback, not exit 0)."""
    import errno

    from epmoe.launch import cli

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(cli, "_write", full)
    out = str(tmp_path / "s.json")
    rc = cli.main(["--tokens", "4", "--layers", "1", "--steps", "2", "--quiet", "--out", out])
    got = capsys.readouterr()
    assert rc == 3
    assert "correctness" in got.out and "PASS" in got.out
    assert got.err.strip().splitlines() == [
        f"error: the run finished, but writing its outputs failed: [Errno 28] No space left "
        f"on device: '{out}'"]


@pytest.mark.parametrize("argv", [
    ["epmoe.plan", "--model", "qwen3-30b-a3b", "--topology", "1x2", "--json", "--tokens",
     "1,4,16,64,256,1024,4096"],  # > 64 KiB, a pipe's buffer
    ["epmoe.sim", "epmoe/sim/sweeps/deepseek-v3.toml", "--json"],
])
def test_a_reader_that_goes_away_ends_the_command_quietly(argv):
    """`... --json | head -c 10`: exit 141 as SIGPIPE would, no traceback on stderr."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
    head = p.stdout.read(10)
    p.stdout.close()  # the reader goes away before the command has written everything
    err = p.stderr.read().decode()
    assert p.wait(120) == 141, err
    assert head.startswith(b"{") and "Traceback" not in err and "BrokenPipe" not in err, err


def test_run_main_passes_the_exit_code_through():
    from epmoe.outputs import run_main

    with pytest.raises(SystemExit) as e:
        run_main(lambda a: a + 1, 2)
    assert e.value.code == 3


def test_json_is_standard_a_figure_that_is_not_a_number_is_null(tmp_path):
    """A failed probe's NaN (or an infinite ratio) must not make the summary unparseable by
    strict JSON readers (NaN / Infinity are not JSON)."""
    import json
    import math

    from epmoe.launch.cli import _write
    from epmoe.outputs import json_text

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))

    obj = {"a": float("nan"), "b": [1.5, float("inf"), {"c": -math.inf}], "d": (2, "x"),
           "e": None, "f": 3}
    assert strict(json_text(obj)) == {"a": None, "b": [1.5, None, {"c": None}], "d": [2, "x"],
                                      "e": None, "f": 3}
    path = tmp_path / "s.json"
    _write(str(path), {"timing": {"host_op_us": float("nan"), "step_ms": [1.0, 2.0]}})
    assert strict(path.read_text()) == {"timing": {"host_op_us": None, "step_ms": [1.0, 2.0]}}
