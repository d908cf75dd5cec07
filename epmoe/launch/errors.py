"""The launcher's two failure kinds, one per exit code (see epmoe.launch.cli), and SIGTERM
unwinding it like Ctrl-C."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading


class InputError(ValueError):
    """Bad input found before any rank started (exit 2): flags, files, an address nothing
    answers at, a cluster too small for the ranks asked for."""


class ClusterTooSmall(InputError):
    """The cluster cannot hold the requested ranks: found before any worker starts (exit 2)."""


class LaunchError(RuntimeError):
    """A run failed after ranks started (exit 3). `failure` (epmoe.launch.blame.Failure, or
    None) says which rank, where, and which ranks were only waiting."""

    def __init__(self, message: str, failure=None):
        super().__init__(message)
        self.failure = failure


@dataclasses.dataclass
class Sigterm:
    """Whether a SIGTERM arrived (a scheduler stopping the job, `kill`). Its handler raises
    KeyboardInterrupt, which Ray's blocking calls turn into a plain one: hence the flag."""

    received: bool = False


@contextlib.contextmanager
def sigterm_interrupts():
    """Within: SIGTERM unwinds like Ctrl-C, so what the launcher started (the private
    cluster, its token file) is stopped on the way out; -> the Sigterm flag. Main thread only
    (elsewhere Python cannot set a handler); the handler before is put back after."""
    seen = Sigterm()

    def on_sigterm(signum, frame):
        seen.received = True
        raise KeyboardInterrupt("SIGTERM")

    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    before = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield seen
    finally:
        if before is not None:  # None: one set outside Python, which Python cannot restore
            signal.signal(signal.SIGTERM, before)
