"""The launcher's failure paths: bad flags (exit 2 before any worker), a rank that dies, hangs or
raises (exit 3 naming the rank and the stage, then no process of the run left behind), and a
cluster too small for the ranks asked for.

Processes of one run are found by a unique EPMOE_TEST_TAG in their environment (the driver
forwards every EPMOE_* variable to its workers; locally started Ray daemons inherit it), so the
checks never confuse them with other Ray clusters on the machine. Clusters these tests start
with `ray start` are stopped by killing exactly their tagged processes (not `ray stop`, which
would stop every Ray cluster of the user on this machine).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from epmoe.launch.cli import main

RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")


# ---------------------------------------------------------------------------------- helpers


def new_tag() -> str:
    return uuid.uuid4().hex[:12]


def _read(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def tagged_procs(tag: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries EPMOE_TEST_TAG=tag, read from
    /proc (psutil is not a dependency; these tests run on Linux)."""
    want = f"EPMOE_TEST_TAG={tag}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            if want in _read(int(d), "environ").split(b"\0"):
                if _read(int(d), "stat").rsplit(b")", 1)[1].split()[0] != b"Z":
                    out.append(int(d))
        except OSError:  # gone, or not ours to read
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        return _read(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def describe(pids) -> list[str]:
    return [f"{pid} {cmdline(pid)[:80]}" for pid in pids]


def is_ray_worker(pid: int) -> bool:
    return cmdline(pid).startswith("ray::")


def wait_gone(tag: str, within: float) -> list[int]:
    deadline = time.monotonic() + within
    left = tagged_procs(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = tagged_procs(tag)
    return left


def kill_tagged(tag: str) -> None:
    """SIGTERM, then SIGKILL, exactly the processes carrying this tag (ones we started)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        for pid in tagged_procs(tag):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        if not wait_gone(tag, within=wait):
            return


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def launch_env(tag: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", EPMOE_TEST_TAG=tag, PYTHONUNBUFFERED="1")
    env.pop("EPMOE_FAULT", None)
    env.update(extra)
    return env


class RayNodes:
    """Ray nodes started with `ray start` on this machine (head first), each with its own
    ports; `stop()` kills exactly their processes."""

    def __init__(self, tag: str | None = None):
        self.tag = tag or new_tag()
        self.temp_dir = f"/tmp/rt{self.tag[:8]}"  # short: Ray's socket paths are length-limited
        self.address = None
        # Worker ports come from a fixed block below the kernel's ephemeral range, where the
        # free ports of the other components come from, so the two can never overlap.
        self.worker_port = 10000 + (int(self.tag[:4], 16) % 150) * 100

    def _node_ports(self) -> list[str]:
        lo = self.worker_port
        self.worker_port += 100
        while True:  # belt and braces: re-pick if a component port fell into the worker block
            nm, om, al, ag, me, re = ports = free_ports(6)
            if not any(lo <= p <= lo + 99 for p in ports):
                break
        return ["--node-manager-port", str(nm), "--object-manager-port", str(om),
                "--dashboard-agent-listen-port", str(al), "--dashboard-agent-grpc-port", str(ag),
                "--metrics-export-port", str(me), "--runtime-env-agent-port", str(re),
                "--min-worker-port", str(lo), "--max-worker-port", str(lo + 99)]

    def _start(self, args: list[str]) -> None:
        r = subprocess.run([RAY_BIN, "start", *args, "--disable-usage-stats"],
                           env=launch_env(self.tag), capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed ({r.returncode}):\n"
                               f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")

    def start_head(self, num_cpus: int) -> str:
        (port,) = free_ports(1)
        self._start(["--head", f"--port={port}", f"--num-cpus={num_cpus}",
                     "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                     f"--temp-dir={self.temp_dir}",
                     *self._node_ports()])
        self.address = f"127.0.0.1:{port}"
        return self.address

    def add_node(self, num_cpus: int) -> None:
        self._start([f"--address={self.address}", f"--num-cpus={num_cpus}",
                     "--node-ip-address=127.0.0.1", *self._node_ports()])

    def stop(self) -> None:
        kill_tagged(self.tag)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def run_launch(args: list[str], tag: str, timeout: float, **env: str):
    """`python -m epmoe.launch ...` as a subprocess; -> (rc, stderr, wall s, tagged ray
    workers seen while it ran)."""
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "epmoe.launch", *args, "--quiet"],
                         env=launch_env(tag, **env), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    try:
        while p.poll() is None:
            if time.monotonic() - t0 > timeout:
                p.kill()
                pytest.fail(f"launch {args} still running after {timeout} s")
            seen |= {q for q in tagged_procs(tag) if is_ray_worker(q)}
            time.sleep(0.5)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, err, time.monotonic() - t0, seen


# ---------------------------------------------------------------------------------- bad flags

BAD_FLAGS = [
    (["--ep", "3"], r"experts \(16\) must be divisible by ep \(3\); choose an ep that divides it"),
    (["--ep", "3", "--eplb", "--redundant-experts", "4"], r"experts \(20\) must be divisible by "
                                                          r"ep \(3\)"),
    (["--tp", "3"], r"moe intermediate \(128\) must be divisible by tp \(3\)"),
    (["--tp", "4", "--quant", "fp8_block"], r"moe intermediate per partition \(32\) must be a "
                                            r"multiple of fp8_block's quant group \(128\); lower "
                                            r"tp or pick recipe bf16"),
    (["--ep", "2", "--tp", "2"], r"--ep 2 with --tp 2: one parallel form per run"),
    (["--model", "nope-7b"], r"unknown preset 'nope-7b'; choose one of: .*deepseek-v3-tiny"),
    (["--quant", "int3"], r"--quant 'int3' is not a recipe; choose one of bf16, fp8_block"),
    (["--redundant-experts", "4"], r"--redundant-experts needs --eplb"),
    (["--tp", "2", "--eplb"], r"--eplb places experts across EP ranks: use --ep, not --tp"),
    (["--ep", "0"], r"--ep \(0\) and --tp \(1\) must be >= 1"),
    (["--timeout", "0"], r"--timeout \(0.0\) must be > 0 seconds"),
    (["--eplb", "--rebalance-every", "0"], r"--rebalance-every \(0\) must be >= 1"),
    (["--backend", "allgather"], r"--backend allgather moves tokens between ranks, which form "
                                 r"ep_dp on 1 rank\(s\) does not do"),
    (["--ep", "2", "--no-dp", "--backend", "all2all"], r"--backend all2all moves tokens between "
                                                       r"ranks, which form ep on 2 rank"),
    (["--routing", "zipf"], r"routing spec 'zipf'"),
    (["--quant", "bf16", "--scale-fmt", "ue8m0_packed"], r"scale_fmt \('ue8m0_packed'\) applies "
                                                         r"to fp8_block only"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags_exit_2_before_any_worker(flags, message, capsys, monkeypatch):
    import re

    import epmoe.launch.driver as driver

    def no_driver(*a, **k):
        raise AssertionError("a driver was created for invalid flags")

    monkeypatch.setattr(driver, "driver_for", no_driver)
    t0 = time.monotonic()
    rc = main([*flags, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and re.search(message, err), err
    assert time.monotonic() - t0 < 5


def test_unknown_choice_is_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--backend", "carrier-pigeon"])
    assert e.value.code == 2
    assert "invalid choice: 'carrier-pigeon'" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_bad_flags_as_a_process():
    tag = new_tag()
    rc, err, wall, seen = run_launch(["--ep", "3"], tag, timeout=100)
    assert rc == 2 and "experts (16) must be divisible by ep (3)" in err, err
    assert not seen and not tagged_procs(tag)


# ---------------------------------------------------------------------------------- failing ranks


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_worker_exit_3_names_rank_and_stage_and_tears_down():
    tag = new_tag()
    rc, err, wall, seen = run_launch(["--ep", "2", "--tokens", "4", "--steps", "2",
                                      "--timeout", "60"], tag, timeout=200,
                                     EPMOE_FAULT="1:step:exit")
    print(f"{wall=:.1f}s {err.splitlines()[-1:]}")
    assert rc == 3, err
    assert "error: rank 1 died during stage 'step 0'" in err, err
    assert wall < 60 + 60, "the death was noticed only at the deadline"
    assert len(seen) >= 2, f"no tagged worker seen while running: {seen}"
    left = wait_gone(tag, within=15)
    assert not left, f"left behind: {describe(left)}"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hung_worker_exit_3_within_timeout_and_tears_down():
    tag = new_tag()
    rc, err, wall, seen = run_launch(["--ep", "2", "--tokens", "4", "--steps", "2",
                                      "--timeout", "10"], tag, timeout=200,
                                     EPMOE_FAULT="1:step:hang")
    print(f"{wall=:.1f}s {err.splitlines()[-1:]}")
    assert rc == 3, err
    import re

    m = re.search(r"rank\(s\) \[([\d, ]+)\] did not finish stage 'step 0' within 10 s", err)
    assert m, err
    assert 1 in [int(x) for x in m.group(1).split(",")], err
    assert "raise --timeout" in err
    assert 10 <= wall < 10 + 90, wall  # deadline + Ray start + teardown
    assert len(seen) >= 2
    left = wait_gone(tag, within=15)
    assert not left, f"left behind: {describe(left)}"


# ---------------------------------------------------------------------------------- small cluster


@pytest.fixture(scope="module")
def small_cluster():
    """A 2-CPU Ray head of our own (joined with --address)."""
    nodes = RayNodes()
    try:
        nodes.start_head(num_cpus=2)
        yield nodes
    finally:
        nodes.stop()
        left = wait_gone(nodes.tag, within=15)
        assert not left, f"cluster processes left behind: {describe(left)}"


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_more_ranks_than_the_cluster_has_exit_2(small_cluster, capsys, monkeypatch):
    import ray
    import ray.util.placement_group  # noqa: F401  (the module; ray.util re-exports a function)

    pg = sys.modules["ray.util.placement_group"]
    created = []
    monkeypatch.setattr(pg, "placement_group", lambda *a, **k: created.append(a) or 1 / 0)
    import epmoe.launch.driver as driver

    monkeypatch.setattr(driver.RayDriver, "_all", lambda *a, **k: created.append(a) or 1 / 0)
    t0 = time.monotonic()
    rc = main(["--ep", "4", "--address", small_cluster.address, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert ("error: the cluster has 2 CPU, but 4 ranks need 4 (1 each): lower --ep/--tp or add "
            "nodes") in err, err
    assert not created, "a placement group or actor was requested"
    assert not ray.is_initialized(), "the driver stayed connected to a cluster it only joined"
    assert time.monotonic() - t0 < 60


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_raising_worker_exit_3_names_rank_and_stage(small_cluster):
    tag = new_tag()
    rc, err, wall, seen = run_launch(["--ep", "2", "--tokens", "4", "--steps", "2",
                                      "--timeout", "60", "--address", small_cluster.address],
                                     tag, timeout=200, EPMOE_FAULT="1:step:raise")
    print(f"{wall=:.1f}s {err.splitlines()[-1:]}")
    assert rc == 3, err
    assert ("error: rank 1 failed in stage 'step 0': RuntimeError: injected fault on rank 1 in "
            "step") in err, err
    assert wall < 60, "the error was noticed only at the deadline"
    assert len(seen) == 2, seen
    left = wait_gone(tag, within=15)  # the run's actors; the joined cluster keeps running
    assert not left, f"left behind: {describe(left)}"
    assert tagged_procs(small_cluster.tag), "the joined cluster must keep running"
