"""Helpers of the launcher tests: find a run's processes, what they listen on, Ray clusters of
our own for `--address` runs, and `python -m epmoe.launch` as a subprocess.

Processes of one run are found by a unique EPMOE_TEST_TAG in their environment (the driver
forwards every EPMOE_* variable to its ranks; locally started Ray daemons inherit it), so the
checks never confuse them with other Ray clusters on the machine. Clusters these tests start
with `ray start` are stopped by killing exactly their tagged processes (never `ray stop`, which
would stop every Ray cluster of the user on this machine). They use token authentication and
loopback addresses, as README "Security" tells users to, and no GPUs (--num-gpus=0: the
launches these CPU tests make stay CPU runs on a machine with GPUs).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager

import pytest

from epmoe.launch.reaper import fd_targets

# Ray's CLI: its console script beside this Python, else its module (Ray installed without
# entry points, e.g. unpacked onto PYTHONPATH)
_RAY_SCRIPT = os.path.join(os.path.dirname(sys.executable), "ray")
RAY_CLI = [_RAY_SCRIPT] if os.path.exists(_RAY_SCRIPT) else \
    [sys.executable, "-m", "ray.scripts.scripts"]


def new_tag() -> str:
    return uuid.uuid4().hex[:12]


def _read(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def environ(pid: int) -> dict[str, str]:
    try:
        items = _read(pid, "environ").split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


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


# ---------------------------------------------------------------------------------- sockets


def _socket_inodes(pid: int) -> set[int]:
    return {int(link[8:-1]) for link in fd_targets(pid) if link.startswith("socket:[")}


def _addr(hex_addr: str, v6: bool) -> tuple[str, int]:
    ip, port = hex_addr.split(":")
    b = bytes.fromhex(ip)
    if v6:  # four little-endian 32-bit words
        b = b"".join(b[i:i + 4][::-1] for i in range(0, 16, 4))
        return socket.inet_ntop(socket.AF_INET6, b), int(port, 16)
    return socket.inet_ntop(socket.AF_INET, b[::-1]), int(port, 16)


def listening(pids) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that one of `pids` holds, from
    /proc/<pid>/net/tcp{,6} (the socket table of the pids' network namespace) and their fds."""
    owner = {}
    for p in pids:
        for ino in _socket_inodes(p):
            owner[ino] = p
    out = set()
    if not owner:
        return out
    some = next(iter(owner.values()))
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = _read(some, f"net/{name}").decode().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[9]) in owner:  # 0A: LISTEN
                ip, port = _addr(f[1], v6)
                out.add((owner[int(f[9])], ip, port))
    return out


def is_loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip)
    if getattr(a, "ipv4_mapped", None) is not None:
        a = a.ipv4_mapped
    return a.is_loopback


# ---------------------------------------------------------------------------------- clusters


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


def launch_env(tag: str, auth: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a launch or `ray start`: the tag, no inherited fault, the given auth
    variables (none: the user's defaults, i.e. whatever the suite runs with)."""
    env = dict(os.environ, EPMOE_TEST_TAG=tag, PYTHONUNBUFFERED="1")
    for k in ("EPMOE_FAULT", "RAY_ADDRESS"):
        env.pop(k, None)
    env.update(auth or {})
    env.update(extra)
    return env


class RayNodes:
    """Ray nodes started with `ray start` on this machine (head first), token authentication
    with a token of their own; `stop()` kills exactly their processes. `auth` is what a driver
    needs to join them. One node listens on loopback only (a single-machine cluster); Ray
    refuses a second node in that mode, so multi-node clusters listen on the machine's address
    (behind their token)."""

    def __init__(self, tag: str | None = None, loopback: bool = True):
        self.tag = tag or new_tag()
        self.temp_dir = f"/tmp/rt{self.tag[:8]}"  # short: Ray's socket paths are length-limited
        os.makedirs(self.temp_dir, mode=0o700)
        token = os.path.join(self.temp_dir, "auth_token")
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token}
        if loopback:
            self.auth["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
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
        r = subprocess.run([*RAY_CLI, "start", *args, "--disable-usage-stats"],
                           env=launch_env(self.tag, self.auth), capture_output=True, text=True,
                           timeout=180)
        if r.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed ({r.returncode}):\n"
                               f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")

    def start_head(self, num_cpus: int) -> str:
        (port,) = free_ports(1)
        self._start(["--head", f"--port={port}", f"--num-cpus={num_cpus}", "--num-gpus=0",
                     "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                     f"--temp-dir={self.temp_dir}/ray", *self._node_ports()])
        self.address = f"127.0.0.1:{port}"
        return self.address

    def add_node(self, num_cpus: int) -> None:
        self._start([f"--address={self.address}", f"--num-cpus={num_cpus}", "--num-gpus=0",
                     "--node-ip-address=127.0.0.1", *self._node_ports()])

    def stop(self) -> None:
        kill_tagged(self.tag)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@contextmanager
def ray_nodes(num_cpus: int, extra_nodes: int = 0):
    """A head (and `extra_nodes` more nodes) of `num_cpus` CPUs each for a test module; at the
    end every process of it is gone."""
    nodes = RayNodes(loopback=extra_nodes == 0)
    try:
        nodes.start_head(num_cpus=num_cpus)
        for _ in range(extra_nodes):
            nodes.add_node(num_cpus=num_cpus)
        yield nodes
    finally:
        nodes.stop()
        left = wait_gone(nodes.tag, within=15)
        assert not left, f"cluster processes left behind: {describe(left)}"


def run_launch(args: list[str], tag: str, timeout: float, auth: dict | None = None,
               watch=None, **env: str):
    """`python -m epmoe.launch ...` as a subprocess; -> (rc, stdout, stderr, wall s, tagged ray
    workers seen while it ran). `watch(tag)` is called every 0.3 s while it runs."""
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "epmoe.launch", *args, "--quiet"],
                         env=launch_env(tag, auth, **env), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    try:
        while p.poll() is None:
            if time.monotonic() - t0 > timeout:
                p.kill()
                pytest.fail(f"launch {args} still running after {timeout} s")
            seen |= {q for q in tagged_procs(tag) if is_ray_worker(q)}
            if watch is not None:
                watch(tag)
            time.sleep(0.3)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, err, time.monotonic() - t0, seen


def launch_in_process(tmp_path, model_args: list[str], *args: str) -> tuple[int, dict]:
    """`python -m epmoe.launch` in this process (one CPU rank unless `args` say otherwise), 16
    tokens, one step -> (exit code, its JSON summary). model_args: e.g. ["--model", folder]."""
    import json

    from epmoe.launch.cli import main as launch

    out = tmp_path / "summary.json"
    rc = launch([*model_args, "--tokens", "16", "--steps", "1", "--device", "cpu", "--quiet",
                 "--out", str(out), *args])
    return rc, json.loads(out.read_text())


def config_folder(tmp_path, name: str, config: dict):
    """A folder `name` holding `config` as its config.json (a model for --model)."""
    import json

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder
