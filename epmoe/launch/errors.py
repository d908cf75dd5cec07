"""The launcher's two failure kinds, one per exit code (see epmoe.launch.cli)."""

from __future__ import annotations


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
