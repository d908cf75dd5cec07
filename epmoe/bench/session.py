"""`python -m epmoe.bench.session`: the measurements the open issues wait for, as named sets
run in order on a lent machine within one time budget, every log and JSON in one folder.

    python -m epmoe.bench.session --list
    python -m epmoe.bench.session --out DIR [--budget-s 540] [--tar FILE] [--dry-run]
                                  [--src DIR --cutlass-wheel WHL] [--site DIR] SET...

A set runs as a child process (its output in DIR/SET.log, its JSON, if any, in DIR/SET.json);
one that needs more GPUs than the machine has, or more seconds than the budget has left by its
expected duration, is skipped with the reason, never half-run. A set still running when
the budget is spent is stopped (its whole process group) and marked so. DIR/session.json lists
every set with its command, exit code, seconds and status; `--tar FILE` packs DIR into one file
(a lent machine returns only a few). `deps` first makes DeepEP and DeepGEMM importable: already
importable, a built `--site DIR`, or built from `--src` by tools/build_gpu_deps.sh (~100 s);
the later sets then find them on PYTHONPATH. Exit code: 0 when every set that ran exited 0,
1 when one failed or was stopped, 2 on a bad set name or flag; Ctrl-C or SIGTERM stops the set
under way with its process group (130 / 143).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path
from epmoe.outputs import json_text, run_main

REPO = Path(__file__).resolve().parents[2]
PY = (sys.executable, "-m")


@dataclasses.dataclass(frozen=True)
class MeasureSet:
    """One named measurement: the command, what it needs and what it is for."""

    name: str
    gpus: int  # GPUs it needs on this machine
    est_s: float  # expected seconds: measured where it ran before (skipped with less left)
    argv: tuple[str, ...]  # "{json}" stands for DIR/<name>.json
    why: str  # the issue item it answers


SETS = (
    MeasureSet("gpu-tests", 1, 240.0, (*PY, "pytest", "-q", "-m", "gpu and not multigpu",
                                       "tests/test_symm_gpu.py", "tests/test_symm_gpu_faults.py"),
               "symm-ht / symm-ll compiled: loopback worlds, graph replays, timeouts"),
    MeasureSet("loopback", 1, 150.0, (*PY, "epmoe.bench.comm", "--world", "2", "--quick",
                                      "--json", "{json}"),
               "symm-* kernel cost without a link (every rank's arena on one GPU; BENCHMARKS 7)"),
    MeasureSet("multigpu-tests", 2, 120.0, (*PY, "pytest", "-q", "-m", "multigpu",
                                            "tests/test_symm_gpu.py", "tests/test_gpu_backends.py"),
               "every GPU comm backend at ep 2 against the oracle; symm-* on two real ranks"),
    MeasureSet("ll-link", 2, 180.0, (*PY, "epmoe.bench.comm", "--world", "2", "--only", "ll",
                                     "--sweep", "0,0:0:0:0:0:0:0:1", "--json", "{json}"),
               "issue 10: LL targets (20 / 25 us), ll_dedup on the link, deepep-ll fp8"),
    MeasureSet("ht-link", 2, 260.0, (*PY, "epmoe.bench.comm", "--world", "2", "--only", "ht",
                                     "--ht-tokens", "4096", "--recipes", "bf16,fp8_block",
                                     "--backends", "deepep-ht,symm-ht",
                                     "--sweep", "0,0:0:0:0:0:2,0:0:0:0:0:0:0:0:0:1",
                                     "--json", "{json}"),
               "issue 10: HT dispatch <= 0.6x DeepEP's, combine <= 0.7x, at 4096 tokens"),
    MeasureSet("plan-ep2", 2, 420.0, (*PY, "epmoe.bench.plan_accuracy", "--ep", "2", "--quick",
                                      "--tokens", "128,4096", "--calibrate", "quick",
                                      "--calibrate-budget-s", "150", "--budget-s", "230",
                                      "--json", "{json}"),
               "issue 11: per-stage accuracy at ep 2, calibrated on this host; shared MLP"),
    # one GPU; est_s of these three estimated, not yet run as sets
    MeasureSet("router-tests", 1, 90.0, (*PY, "pytest", "-q", "-m", "gpu",
                                         "tests/test_router.py", "tests/test_router_kernel.py",
                                         "tests/test_hash_layers.py",
                                         "tests/test_graph_gpu.py"),
               "the router's split and fused ways and its packed-key selection, compiled"),
    # the split way's configs only: all of them at 1 / 128 / 4096 tokens and both ways did
    # not finish the first model's first row in 190 s on an H100 (2026-12-07; a fused
    # candidate compiles a kernel over the whole gate); the routing kernel alone at 6 configs
    # of 9 cases took 35 s there
    MeasureSet("router-tune", 1, 150.0, (*PY, "epmoe.bench.router_tune", "--tokens",
                                         "1,128,4096", "--ways", "split", "--iters", "30",
                                         "--json", "{json}"),
               "the routing kernel's own latency and config (LOGITS_ROUTER)"),
    # 22 s on one H100 (2026-12-07, the 27 rows)
    MeasureSet("router-model", 1, 60.0, (*PY, "epmoe.bench.router_model", "--json", "{json}"),
               "issue 11: the spec profiles' router price against the split way timed here"),
    # 82 s on one H100 (2026-12-07): the calibration stops at the sizes that fit
    MeasureSet("plan-1gpu", 1, 300.0, (*PY, "epmoe.bench.plan_accuracy", "--tokens", "128,4096",
                                       "--timing", "launched", "--calibrate", "full",
                                       "--calibrate-budget-s", "200", "--budget-s", "200",
                                       "--json", "{json}"),
               "issue 11: one GPU's per-stage accuracy on a fresh calibration (on an H200: the "
               "H200 profiles' router fits are an H100's; python -m epmoe.plan.refresh "
               "takes measured ones from the .profile.json it writes)"),
    MeasureSet("plan-device", 1, 300.0, (*PY, "epmoe.bench.plan_accuracy", "--tokens",
                                         "128,4096", "--timing", "device", "--calibrate", "full",
                                         "--calibrate-budget-s", "200", "--budget-s", "200",
                                         "--json", "{json}"),
               "issue 11: plan-1gpu under --timing device (GPU time; 78 s on one H100), for "
               "the *-device-timed profiles"),
    MeasureSet("ll-peers-8", 8, 200.0, (*PY, "epmoe.bench.comm", "--world", "8", "--only", "ll",
                                        "--ll-tokens", "1,128", "--json", "{json}"),
               "issue 11: symm-ll's fixed cost per peer on a real 8-GPU node"),
)
DEPS = "deps"


@dataclasses.dataclass
class Outcome:
    name: str
    argv: list[str]
    status: str  # ok | failed | stopped | skipped | present
    rc: int | None = None
    seconds: float = 0.0
    why: str = ""


def _stamp(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def _run(argv: list[str], log: Path, env: dict, timeout: float) -> tuple[int | None, float]:
    """argv in its own process group, output to log; -> (rc, seconds), rc None if stopped."""
    t = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
        except BaseException:  # Ctrl-C, SIGTERM: the set (its own session) goes too
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    return rc, time.monotonic() - t


def _importable(env: dict) -> bool:
    code = "import deep_ep, deep_gemm"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                          capture_output=True).returncode == 0


def _deps(a, out: Path, env: dict, left: float) -> Outcome:
    """DeepEP + DeepGEMM importable for the sets after this one (env's PYTHONPATH)."""
    if a.site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (a.site, env.get("PYTHONPATH"))))
    if _importable(env):
        return Outcome(DEPS, [], "present", 0, why="deep_ep and deep_gemm import")
    if not a.src:
        return Outcome(DEPS, [], "skipped", why="not importable and no --src to build from")
    site = a.site or str(out / "site")
    argv = ["bash", "tools/build_gpu_deps.sh", "--src", a.src, "--target", site, "--strip",
            *(["--cutlass-wheel", a.cutlass_wheel] if a.cutlass_wheel else [])]
    rc, secs = _run(argv, out / f"{DEPS}.log", env, left)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (site, env.get("PYTHONPATH"))))
    status = "stopped" if rc is None else ("ok" if rc == 0 else "failed")
    return Outcome(DEPS, argv, status, rc, secs)


def argv_of(s: MeasureSet, out: Path) -> list[str]:
    return [str(out / f"{s.name}.json") if v == "{json}" else v for v in s.argv]


def run_session(names: list[str], a, out: Path, gpus: int, sets=SETS,
                clock=time.monotonic) -> list[Outcome]:
    """Each named set in order within a.budget_s; -> what became of each."""
    by_name = {s.name: s for s in sets}
    t0, res = clock(), []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))
    for name in names:
        left = a.budget_s - (clock() - t0)
        if name == DEPS:
            res.append(_deps(a, out, env, left))
            _stamp(t0, f"{DEPS}: {res[-1].status} {res[-1].why}".rstrip())
            continue
        s = by_name[name]
        argv = argv_of(s, out)
        if gpus < s.gpus:
            res.append(Outcome(name, argv, "skipped", why=f"needs {s.gpus} GPUs, {gpus} here"))
        elif left < s.est_s:
            res.append(Outcome(name, argv, "skipped",
                               why=f"~{s.est_s:.0f} s expected, {left:.0f} s left"))
        else:
            _stamp(t0, f"{name}: running (~{s.est_s:.0f} s; {left:.0f} s left): {s.why}")
            rc, secs = _run(argv, out / f"{name}.log", env, left)
            status = "stopped" if rc is None else ("ok" if rc == 0 else "failed")
            res.append(Outcome(name, argv, status, rc, secs,
                               "the budget ran out" if rc is None else ""))
        _stamp(t0, f"{name}: {res[-1].status} {res[-1].why}".rstrip())
    return res


def table(res: list[Outcome]) -> str:
    lines = [f"{'set':<16}{'status':<9}{'rc':>4}{'seconds':>9}  note", "-" * 80]
    for o in res:
        rc = "-" if o.rc is None else str(o.rc)
        lines.append(f"{o.name:<16}{o.status:<9}{rc:>4}{o.seconds:>9.1f}  {o.why}"[:80].rstrip())
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.session",
                                description=__doc__.splitlines()[0].strip("`"))
    p.add_argument("sets", nargs="*", help=f"{DEPS} and the sets of --list, in the order to run")
    p.add_argument("--list", action="store_true", help="list the sets and exit")
    p.add_argument("--out", default="session-out", help="folder for logs, JSON, session.json")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="seconds for all the sets (default 540: a 600 s call, with margin)")
    p.add_argument("--tar", default=None, help="pack the folder into this .tar.gz at the end")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--src", default=None, help=f"{DEPS}: DeepEP/, DeepGEMM/, fmt/ to build")
    p.add_argument("--cutlass-wheel", default=None, help=f"{DEPS}: CUTLASS headers' wheel")
    p.add_argument("--site", default=None, help=f"{DEPS}: a built site folder to use or fill")
    return p


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    known = [DEPS, *(s.name for s in SETS)]
    if a.list:
        for s in SETS:
            print(textwrap.fill(s.why, 80, initial_indent=f"{s.name:<16}{s.gpus} GPU "
                                f"~{s.est_s:3.0f} s  ", subsequent_indent=" " * 30))
        return 0
    bad = [n for n in a.sets if n not in known]
    if bad or not a.sets:
        ap.error(f"sets {bad or '(none)'}: choose from {', '.join(known)}")
    if a.budget_s <= 0:
        ap.error(f"--budget-s ({a.budget_s}) must be > 0")
    out = Path(a.out).resolve()  # the sets run in the repository root
    if a.dry_run:
        for s in SETS:
            if s.name in a.sets:
                print(shlex.join(argv_of(s, out)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    from epmoe.launch.errors import stop_signals_interrupt

    with stop_signals_interrupt() as stop:
        try:
            res = run_session(a.sets, a, out, gpus)
        except KeyboardInterrupt:  # the set under way was stopped; its log stays in DIR
            return stop.exit()
    (out / "session.json").write_text(json_text(
        dict(gpus=gpus, budget_s=a.budget_s, sets=[dataclasses.asdict(o) for o in res])))
    print(table(res))
    if a.tar:
        with tarfile.open(a.tar, "w:gz") as t:
            t.add(out, arcname=out.name,  # not a site built into it (tens of MB)
                  filter=lambda i: None if i.name.split("/")[1:2] == ["site"] else i)
    return 1 if any(o.status in ("failed", "stopped") for o in res) else 0


if __name__ == "__main__":
    run_main(main)
