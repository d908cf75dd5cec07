"""`python -m epmoe.bench.session` on CPU: every set's command is one its module accepts, and the
runner keeps to its budget (skips what would not fit, stops what overruns, whole process
group), records each set's outcome, and packs the folder."""

from __future__ import annotations

import importlib
import json
import os
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from epmoe.bench import session
from epmoe.bench.session import MeasureSet, run_session

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("s", session.SETS, ids=[s.name for s in session.SETS])
def test_every_set_is_a_command_its_module_accepts(s, tmp_path):
    argv = session.argv_of(s, tmp_path)
    assert argv[:2] == [session.PY[0], "-m"]
    module, args = argv[2], argv[3:]
    if module == "pytest":
        marks = args[args.index("-m") + 1]
        files = [a for a in args if a.endswith(".py")]
        assert files and all((REPO / f).is_file() for f in files)
        ini = (REPO / "pyproject.toml").read_text()
        assert all(f'"{m}' in ini for m in ("gpu", "multigpu")), marks
        return
    parsed = importlib.import_module(module).parser().parse_args(args)
    if "--json" in args:
        assert parsed.json == str(tmp_path / f"{s.name}.json")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _args(tmp_path, **kw):
    return SimpleNamespace(budget_s=kw.pop("budget_s", 60.0), site=None, src=None,
                           cutlass_wheel=None, **kw)


def _py(code: str) -> tuple[str, ...]:
    return (session.PY[0], "-c", code)


def test_the_runner_skips_stops_and_records(tmp_path):
    sets = (
        MeasureSet("fine", 1, 0.0, _py("print('hello')"), "ok"),
        MeasureSet("broken", 1, 0.0, _py("raise SystemExit(3)"), "fails"),
        MeasureSet("two-gpus", 2, 0.0, _py("print('never')"), "needs 2"),
        MeasureSet("too-long", 1, 1e6, _py("print('never')"), "estimated over budget"),
        # overruns the budget; its child would outlive a plain kill of the parent
        MeasureSet("overrun", 1, 0.0, _py(
            "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); print('child', c.pid, flush=True); "
            "time.sleep(60)"),
            "stopped"),
    )
    t = time.monotonic()
    res = run_session([s.name for s in sets], _args(tmp_path, budget_s=8.0), tmp_path, gpus=1,
                      sets=sets)
    assert time.monotonic() - t < 30
    got = {o.name: o for o in res}
    assert [o.name for o in res] == [s.name for s in sets]
    assert got["fine"].status == "ok" and got["fine"].rc == 0
    assert (tmp_path / "fine.log").read_text().strip() == "hello"
    assert got["broken"].status == "failed" and got["broken"].rc == 3
    assert got["two-gpus"].status == "skipped" and "needs 2 GPUs, 1 here" in got["two-gpus"].why
    assert got["too-long"].status == "skipped" and "s left" in got["too-long"].why
    assert got["overrun"].status == "stopped" and got["overrun"].rc is None
    child = int((tmp_path / "overrun.log").read_text().split()[1])
    for _ in range(50):  # its process group went with it (a zombie counts as gone)
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), f"the overrunning set's child {child} outlived it"
    assert not (tmp_path / "two-gpus.log").exists() and not (tmp_path / "too-long.log").exists()
    text = session.table(res)
    assert all(len(ln) <= 80 for ln in text.splitlines()) and "stopped" in text


def test_deps_without_sources_is_skipped_not_built(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "_importable", lambda env: False)
    res = run_session(["deps"], _args(tmp_path), tmp_path, gpus=0, sets=())
    assert res[0].status == "skipped" and "--src" in res[0].why


def test_main_lists_dry_runs_and_refuses_unknown_sets(tmp_path, capsys):
    assert session.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in listed if ln[0] != " "] == [s.name for s in session.SETS]
    assert all(len(ln) <= 80 for ln in listed)
    assert session.main(["--dry-run", "--out", str(tmp_path), "ll-link", "ht-link"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "--only ll" in lines[0] and "--only ht" in lines[1]
    assert str(tmp_path / "ll-link.json") in lines[0]
    with pytest.raises(SystemExit) as e:
        session.main(["nosuch"])
    assert e.value.code == 2
    assert "choose from deps, gpu-tests" in capsys.readouterr().err


def test_main_writes_session_json_and_packs_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "_importable", lambda env: False)
    out, tar = tmp_path / "o", tmp_path / "r.tar.gz"
    (out / "site").mkdir(parents=True)
    (out / "site" / "big.so").write_text("x")  # a built site stays out of the tarball
    rc = session.main(["--out", str(out), "--tar", str(tar), "deps", "gpu-tests"])
    assert rc == 0  # nothing ran, nothing failed
    doc = json.loads((out / "session.json").read_text())
    assert [s["name"] for s in doc["sets"]] == ["deps", "gpu-tests"]
    assert doc["sets"][1]["status"] == "skipped" and doc["gpus"] == 0
    with tarfile.open(tar) as t:
        names = t.getnames()
    assert "o/session.json" in names and not any("site" in n for n in names)


def test_an_interrupted_set_goes_with_the_session(tmp_path):
    """Ctrl-C (or SIGTERM, which the CLI turns into the same) while a set runs: the set's
    whole process group is killed before the interrupt goes on."""
    import _thread
    import threading

    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); print('child', c.pid, flush=True); time.sleep(60)")
    log = tmp_path / "x.log"
    threading.Timer(2.0, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        session._run([session.PY[0], "-c", code], log, dict(os.environ), timeout=60)
    child = int(log.read_text().split()[1])
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), "the interrupted set's child outlived it"
