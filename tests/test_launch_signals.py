"""Stopping a run from outside: Ctrl-C (SIGINT) and a scheduler's or `kill`'s SIGTERM while
the ranks step. Either unwinds the launcher: one line (`error: interrupted`, exit 130;
`error: terminated (SIGTERM)`, exit 143), the private Ray cluster and every rank gone, its
token file deleted. (Ray's driver installs its own SIGTERM handler, which printed a C++
stack and exited 15 without stopping anything in order; the launcher puts its own back.)"""

from __future__ import annotations

import os
import signal

import pytest

from tests.launch_util import (cmdline, describe, environ, new_tag, run_launch, tagged_procs,
                               wait_gone)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.parametrize("sig,rc,line", [(signal.SIGINT, 130, "error: interrupted"),
                                         (signal.SIGTERM, 143, "error: terminated (SIGTERM)")])
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
    assert err.strip().splitlines()[-1] == line, err[-600:]
    assert "Traceback" not in err and "SIGTERM received" not in err, err[-600:]
    left = wait_gone(tag, within=20)
    assert not left, f"left behind: {describe(left)}"
    assert tokens and not any(os.path.exists(t) for t in tokens), tokens
