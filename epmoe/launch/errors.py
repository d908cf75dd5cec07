"""The launcher's two failure kinds, one per exit code (see epmoe.launch.cli), and the stop
signals (SIGTERM, SIGHUP) unwinding it like Ctrl-C."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
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


STOP_SIGNALS = ("SIGTERM", "SIGHUP")  # a scheduler or `kill`; the terminal closing


@dataclasses.dataclass
class Stopped:
    """Which stop signal arrived, if any. Its handler raises KeyboardInterrupt, which Ray's
    blocking calls turn into a plain one: hence the record."""

    signum: int | None = None

    def exit(self) -> int:
        """After the KeyboardInterrupt: one line on stderr; -> the exit code (130 for Ctrl-C,
        else 128 + the signal's number: 143 SIGTERM, 129 SIGHUP)."""
        name = signal.Signals(self.signum).name if self.signum else None
        print(f"error: terminated ({name})" if name else "error: interrupted", file=sys.stderr)
        return 128 + (self.signum or signal.SIGINT)


def _stop_signals() -> list[int]:
    return [getattr(signal, n) for n in STOP_SIGNALS if hasattr(signal, n)]


@contextlib.contextmanager
def stop_handlers_kept():
    """Within: anything may set the stop signals' handlers (Ray's driver installs C++ ones
    that print a stack and exit 15, unwinding nothing); after: the ones before are back. Main
    thread only (elsewhere Python can neither set nor need to restore them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in _stop_signals()}
    try:
        yield
    finally:
        for s, h in before.items():
            if h is not None:  # None: one set outside Python, which Python cannot restore
                signal.signal(s, h)


@contextlib.contextmanager
def stop_signals_interrupt():
    """Within: SIGTERM and SIGHUP unwind like Ctrl-C, so what the launcher started (the
    private cluster, its token file) is stopped on the way out; -> the Stopped record."""
    seen = Stopped()

    def on_stop(signum, frame):
        if seen.signum:  # a second one while unwinding: let the clean-up finish
            return
        seen.signum = signum
        raise KeyboardInterrupt(signal.Signals(signum).name)

    with stop_handlers_kept():
        if threading.current_thread() is threading.main_thread():
            for s in _stop_signals():
                signal.signal(s, on_stop)
        yield seen
