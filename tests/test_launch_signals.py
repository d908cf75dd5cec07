"""Stopping a run from outside while its ranks step: Ctrl-C (SIGINT), a scheduler's or
`kill`'s SIGTERM, a closed terminal's SIGHUP, and `kill -9` (or the OOM killer). The first
three unwind the launcher: one line (`error: interrupted`, exit 130; `error: terminated
(SIGTERM)`, 143; `(SIGHUP)`, 129). After any of the four, the private Ray cluster, every rank
and the token file are gone: on SIGKILL the reaper (epmoe/launch/reaper.py) sees the launcher's
pipe close and sweeps. (Before: Ray's driver handler printed a C++ stack and exited 15 on
SIGTERM, and kill -9 left Ray's agents running and the token file on disk.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from epmoe.launch import reaper
from tests.launch_util import (cmdline, describe, environ, new_tag, run_launch, tagged_procs,
                               wait_gone)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.parametrize("sig,rc,line", [
    (signal.SIGINT, 130, "error: interrupted"),
    (signal.SIGTERM, 143, "error: terminated (SIGTERM)"),
    (signal.SIGHUP, 129, "error: terminated (SIGHUP)"),
    (signal.SIGKILL, -9, None),
], ids=["SIGINT", "SIGTERM", "SIGHUP", "SIGKILL"])
def test_a_signal_stops_the_run_and_everything_it_started(sig, rc, line):
    tag = new_tag()
    sent, tokens = [], set()

    def watch(tag):
        procs = tagged_procs(tag)
        tokens.update(filter(None, (environ(p).get("RAY_AUTH_TOKEN_PATH") for p in procs)))
        ranks = [p for p in procs if cmdline(p).startswith("ray::Worker")]
        if not sent and ranks:  # the rank actors are up: the run is under way
            launcher = [p for p in procs if "epmoe.launch" in cmdline(p)]
            assert len(launcher) == 1, describe(procs)
            os.kill(launcher[0], sig)
            sent.append(launcher[0])

    got, out, err, _, seen = run_launch(["--ep", "2", "--steps", "100000", "--tokens", "64",
                                         "--timeout", "300"], tag, timeout=240, watch=watch)
    assert sent, f"the rank actors never showed (exit {got}): {err[-600:]}"
    assert got == rc, (got, err[-600:])
    if line is not None:
        assert err.strip().splitlines()[-1] == line, err[-600:]
        assert "Traceback" not in err and "SIGTERM received" not in err, err[-600:]
    left = wait_gone(tag, within=30)
    assert not left, f"left behind: {describe(left)}"
    assert tokens and not any(os.path.exists(t) for t in tokens), tokens


def test_the_reaper_sweeps_only_its_tag_when_the_pipe_closes(tmp_path):
    """The reaper on its own: two sleepers carry its tag (one ignoring SIGTERM: killed after
    the grace; one with a child whose environment lacks the tag, as when a process renames
    itself over its environment block: swept as a descendant), one without the tag holding a
    log open in the run's temp dir (an orphaned Ray agent: swept), one carries another tag
    and lives on, and so does its parent (the launcher's part, here the test) though it holds
    a file there too; the temp dir goes."""
    tag, other = "t" + new_tag(), "o" + new_tag()
    tmp = tmp_path / "run"
    (tmp / "ray").mkdir(parents=True)
    (tmp / "auth_token").write_text("x")
    sleep = [sys.executable, "-c", "import signal, subprocess, sys, time; "
             "sys.argv[1] == 'deaf' and signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "c = sys.argv[1] == 'parent' and subprocess.Popen(['sleep', '120'], env={}); "
             "log = sys.argv[1].startswith('/') and open(sys.argv[1], 'a'); "
             "print('up', c and c.pid, flush=True); time.sleep(120)"]
    log = str(tmp / "ray" / "agent.log")
    # this process plays the launcher: its Ray driver logs there too, and it must be spared
    driver_log = open(tmp / "ray" / "driver.log", "a")
    procs = [subprocess.Popen([*sleep, how], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **({reaper.TAG_VAR: t} if t else {})})
             for t, how in ((tag, "parent"), (tag, "deaf"), (other, "plain"), (None, log))]
    try:
        ups = [p.stdout.readline().split() for p in procs]
        assert all(u[0] == "up" for u in ups), ups
        child = int(ups[0][1])
        r, w = os.pipe()
        rp = subprocess.Popen([sys.executable, reaper.__file__, str(r), tag, str(tmp)],
                              pass_fds=(r,))
        os.close(r)
        time.sleep(0.5)
        assert rp.poll() is None and all(p.poll() is None for p in procs)  # waits for EOF
        os.close(w)
        assert rp.wait(timeout=30) == 0
        assert procs[0].wait(timeout=5) == -signal.SIGTERM
        assert procs[1].wait(timeout=5) == -signal.SIGKILL  # after the grace period
        assert procs[2].poll() is None, "a process of another tag was touched"
        assert procs[3].wait(timeout=5) == -signal.SIGTERM  # by its open file
        for _ in range(50):
            if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read(
                    ).rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.1)
        else:
            pytest.fail("the untagged child of a tagged process outlived the sweep")
        assert not tmp.exists()
    finally:
        driver_log.close()
        for p in procs:
            p.kill()
