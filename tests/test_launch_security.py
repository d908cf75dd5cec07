"""A local run is private: its Ray cluster, its ranks and their rendezvous listen on loopback
only, Ray's token authentication is on with a token of the run's own (a file only the user can
read, never printed), and whatever else runs on the machine (another `ray start --head`,
RAY_ADDRESS, a stale `ray_current_cluster` file) does not change that. Joining a cluster with
`--address` uses that cluster's authentication, and every way of failing to connect is a one-line
exit 2 within --timeout."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest

from epmoe.launch.cli import main
from tests.launch_util import (cmdline, describe, environ, is_loopback, listening, ray_nodes,
                               new_tag, run_launch, tagged_procs, wait_gone)


@pytest.fixture(scope="module")
def other_cluster():
    """Another Ray cluster on the machine (as a user's `ray start --head` would be)."""
    with ray_nodes(num_cpus=2) as nodes:
        yield nodes


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_local_run_is_private_loopback_and_token_auth(other_cluster, tmp_path):
    # stale Ray state a local run must ignore: an address in the environment and a
    # ray_current_cluster file where Ray looks for the last cluster, both pointing nowhere
    stale = Path(tempfile.mkdtemp(prefix="eps", dir="/tmp"))  # short: Ray's socket paths
    (stale / "ray_current_cluster").write_text("127.0.0.1:1")
    seen_listen: set = set()
    envs: dict[int, dict] = {}
    cmds: dict[int, str] = {}
    token_files: dict[str, tuple[int, int, str]] = {}

    def watch(tag):
        pids = tagged_procs(tag)
        seen_listen.update(listening(pids))
        for p in pids:
            env, cmd = environ(p), cmdline(p)
            if env and cmd:
                envs[p], cmds[p] = env, cmd
            path = env.get("RAY_AUTH_TOKEN_PATH")
            if path and path not in token_files:
                try:
                    token_files[path] = (os.stat(path).st_mode, os.stat(os.path.dirname(path))
                                         .st_mode, open(path).read())
                except OSError:
                    pass

    tag = new_tag()
    out = tmp_path / "s.json"
    rc, stdout, err, wall, seen = run_launch(
        ["--ep", "2", "--tokens", "4", "--steps", "3", "--layers", "1", "--out", str(out),
         "--timeout", "120", "--device", "cpu"], tag, timeout=280, watch=watch,
        RAY_ADDRESS="127.0.0.1:1", EPMOE_RAY_TMPDIR=str(stale))
    shutil.rmtree(stale, ignore_errors=True)
    print(f"{wall=:.1f}s rc={rc} listeners={sorted(seen_listen)}")
    assert rc == 0, err[-3000:]
    # the run started its own cluster (a GCS of its own) and ran its ranks on it
    assert any("gcs_server" in c for c in cmds.values()), cmds
    assert len(seen) >= 2, "no rank process seen"
    # 1. nothing of the run listens beyond loopback (the GCS, raylet, driver, ranks, store)
    assert len({p for p, _, _ in seen_listen}) >= 3, f"too few listeners seen: {seen_listen}"
    assert any(p in seen for p, _, _ in seen_listen), "no rank's listener seen"
    wide = sorted(x for x in seen_listen if not is_loopback(x[1]))
    assert not wide, f"listening beyond loopback: {wide} {describe({p for p, _, _ in wide})}"
    # 2. token authentication on in every Ray process of the run, with a private token file
    # (read from the GCS and the raylet, the servers that check tokens: Python processes
    # rewrite their /proc environ area with setproctitle, the launcher's shows what it started
    # with)
    servers = [p for p, c in cmds.items() if "gcs_server" in c or "raylet/raylet" in c]
    assert len(servers) >= 2, cmds
    modes = [envs[p].get("RAY_AUTH_MODE") for p in servers]
    assert modes == ["token"] * len(servers), [(p, cmds[p][:60]) for p in servers]
    assert all("RAY_AUTH_TOKEN" not in envs[p] for p in servers), "token in the environment"
    assert len(token_files) == 1, token_files
    (path, (mode, dir_mode, token)), = token_files.items()
    assert stat.S_IMODE(mode) == 0o600 and stat.S_IMODE(dir_mode) == 0o700, (oct(mode),
                                                                           oct(dir_mode))
    assert len(token) == 64
    assert token not in stdout + err + out.read_text(), "the token leaked into the output"
    assert not os.path.exists(path), "the token file outlived the run"
    # 3. the stale state was ignored and the other cluster is untouched
    assert json.loads(out.read_text())["correctness"]["passed"] is True
    assert tagged_procs(other_cluster.tag), "the other cluster must keep running"
    left = wait_gone(tag, within=15)
    assert not left, f"left behind: {describe(left)}"


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_joining_without_the_clusters_token_is_refused_exit_2(other_cluster):
    """The other cluster uses token auth (README "Security"); a driver without its token is
    refused by Ray and the launcher says so in one line (Ray gives up after ~20 s)."""
    tag = new_tag()
    rc, out, err, wall, seen = run_launch(
        ["--ep", "2", "--address", other_cluster.address, "--timeout", "10"], tag, timeout=110,
        RAY_AUTH_MODE="disabled")
    print(f"{wall=:.1f}s {err.strip().splitlines()[-1:]}")
    assert rc == 2, err
    last = err.strip().splitlines()[-1]  # before it: Ray's own log lines of each retry
    assert last.startswith(f"error: joining {other_cluster.address}: ConnectionError") and \
        "RAY_AUTH_MODE=token" in last, err
    assert not seen and "Traceback" not in err
    # with its token, the same cluster accepts the run
    rc, out, err, wall, seen = run_launch(
        ["--ep", "2", "--tokens", "4", "--steps", "1", "--layers", "1", "--address",
         other_cluster.address, "--timeout", "60"], tag, timeout=110, auth=other_cluster.auth)
    assert rc == 0, err[-2000:]


@pytest.mark.timeout(60)
def test_nothing_listening_at_the_address_exit_2_within_timeout():
    tag = new_tag()
    rc, out, err, wall, seen = run_launch(["--ep", "2", "--address", "127.0.0.1:1",
                                           "--timeout", "4"], tag, timeout=50)
    print(f"{wall=:.1f}s {err.strip()}")
    assert rc == 2, err
    assert err.strip() == ("error: nothing answers at 127.0.0.1:1 within 4 s (Connection "
                           "refused): start the cluster (`ray start --head --port 1`) or fix "
                           "--address"), err
    assert 4 <= wall < 4 + 15


ADDRESSES = [
    ("not-a-host", r"--address not-a-host: host 'not-a-host' does not resolve"),
    ("not-a-host:6379", r"host 'not-a-host' does not resolve"),
    ("127.0.0.1:99999", r"must be host:port with a port in 1\.\.65535"),
    ("http://127.0.0.1:6379", r"use host:port \(the head's GCS port"),
    ("ray://127.0.0.1:1", r"ray:// needs the Ray Client \(the grpc package\): pip install "
                          r"'ray\[client\]'"),
]


@pytest.mark.parametrize("address,message", ADDRESSES, ids=[a for a, _ in ADDRESSES])
def test_bad_address_is_one_line_exit_2_at_once(address, message, capsys, monkeypatch):
    import importlib.util
    import re

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as on a machine without ray[client]
                        lambda name, *a: None if name == "grpc" else real(name, *a))
    t0 = time.monotonic()
    rc = main(["--ep", "2", "--address", address, "--timeout", "30", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert time.monotonic() - t0 < 10
