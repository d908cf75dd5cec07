"""Run the test suite (`make test`'s pytest) in parallel shards on a many-core machine.

A lent GPU machine gives one command at most 600 s; the whole suite takes longer than that one
file after another. This splits it: the GPU tests (`-m gpu`) in one shard (they share the one
device, and the symm tests start NVSHMEM), with --interpreter the tests that run Triton
kernels on CPU tensors (`-m interpreter`, skipped where CUDA is) in one with CUDA hidden (their
Triton must interpret scalar loops: the lent GPU image's Triton 3.6 does not, CI's 3.7 does), the
rest over N shards by test file, each file's weight its number of tests (a test of a file that
starts Ray clusters counts as four, plus the cluster). Every shard is its own pytest process
with its own log and JUnit XML; the summary names each failed test and shard, and the XMLs
give each file's time.

    python tools/test_shards.py --shards 5 --out $OUT --xml-dir /tmp/x [-- extra pytest args]

Exit status: 0 when every shard passed, 1 otherwise (a shard that hit --timeout counts as
failed and is named).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

# weights in quick tests' worth: a file that starts Ray clusters pays for the cluster and
# launches a run per test (the GPU image's first run: ~4 s a test against ~0.3 s elsewhere)
RAY_FILE, RAY_TEST = 20, 4
CPU = "not gpu and not interpreter"


@dataclass
class Shard:
    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    weight: int = 0
    files: list[str] = field(default_factory=list)


def _collect(root: Path) -> dict[str, tuple[int, bool]]:
    """test file -> (number of tests that are not GPU tests, starts Ray)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", CPU],
                       cwd=root, capture_output=True, text=True)
    counts: dict[str, int] = {}
    for line in r.stdout.splitlines():
        if "::" in line:
            f = line.split("::", 1)[0]
            counts[f] = counts.get(f, 0) + 1
    return {f: (n, "ray" in (root / f).read_text().lower()) for f, n in counts.items()}


def plan(files: dict[str, tuple[int, bool]], shards: int) -> list[Shard]:
    """Largest first onto the lightest shard (LPT)."""
    out = [Shard(f"cpu{i}", ["-m", CPU]) for i in range(shards)]
    weight = {f: RAY_FILE + RAY_TEST * n if ray else n for f, (n, ray) in files.items()}
    for f in sorted(weight, key=lambda f: (-weight[f], f)):
        s = min(out, key=lambda s: s.weight)
        s.files.append(f)
        s.weight += weight[f]
    return [s for s in out if s.files]


def _summary(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"\d+ (passed|failed|error|skipped)", ln):
            return ln.strip("= ")
    return lines[-1] if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=max(1, (os.cpu_count() or 2) // 3),
                   help="CPU shards besides the GPU one (default: cores / 3)")
    p.add_argument("--out", type=Path, required=True, help="folder for the shards' logs")
    p.add_argument("--xml-dir", type=Path, help="folder for JUnit XML (default: --out)")
    p.add_argument("--interpreter", action="store_true",
                   help="also a shard of the interpreter tests, CUDA hidden")
    p.add_argument("--timeout", type=float, default=560.0, help="seconds for the whole run")
    p.add_argument("pytest_args", nargs="*", help="after --: passed to every shard")
    a = p.parse_args(argv)
    if a.shards < 1:
        p.error("--shards must be >= 1")
    root = Path(__file__).resolve().parents[1]
    xml_dir = a.xml_dir or a.out
    for d in (a.out, xml_dir):
        d.mkdir(parents=True, exist_ok=True)
    shards = [Shard("gpu", ["-m", "gpu"]), *plan(_collect(root), a.shards)]
    if a.interpreter:
        shards.append(Shard("interp", ["-m", "interpreter"], dict(CUDA_VISIBLE_DEVICES="")))
    threads = str(max(1, (os.cpu_count() or 2) // len(shards)))
    procs = {}
    for s in shards:
        log = a.out / f"{s.name}.log"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml_dir / (s.name + '.xml')}", *s.args, *s.files, *a.pytest_args]
        env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, **s.env)
        procs[s.name] = (subprocess.Popen(cmd, cwd=root, env=env, stdout=log.open("w"),
                                          stderr=subprocess.STDOUT, start_new_session=True), log)
        print(f"{s.name}: {len(s.files) or 'all'} file(s), weight {s.weight}", flush=True)
    deadline, t0, failed = time.monotonic() + a.timeout, time.monotonic(), []
    for name, (proc, log) in procs.items():
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
            print(f"{name}: killed after --timeout {a.timeout:.0f} s", flush=True)
        print(f"{name}: rc {rc} after {time.monotonic() - t0:.0f} s: {_summary(log)}", flush=True)
        if rc not in (0, 5):  # 5: nothing collected (no GPU tests selected)
            failed.append(name)
            for ln in log.read_text(errors="replace").splitlines():
                if ln.startswith(("FAILED ", "ERROR ")):
                    print(f"  {ln[:200]}")
    per_file: dict[str, float] = {}  # over all shards
    for s in shards:
        xml = xml_dir / f"{s.name}.xml"
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                key = "/".join(case.get("classname", "").split(".")[:2]) + ".py"
                per_file[key] = per_file.get(key, 0.0) + float(case.get("time", 0))
    for f, sec in sorted(per_file.items(), key=lambda x: -x[1])[:10]:
        print(f"  {sec:7.1f} s  {f}")
    print("FAILED shards: " + ", ".join(failed) if failed else "every shard passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
