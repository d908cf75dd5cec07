"""Fault injection for tests: EPMOE_FAULT="RANK:WHERE:KIND" makes one rank fail at one point.

WHERE is a launcher stage or any timed stage of the runtime:
| WHERE     | fires                                                                   |
| start     | while the rank's actor is constructed                                   |
| build     | when the rank starts building its layers                                |
| step      | when the rank starts a step (before the step's barrier)                 |
| rebalance | when the rank starts an EPLB rebalance                                  |
| migrate   | when the rebalance starts moving weights (runtime stage eplb.migrate)   |
| measure   | when the rank measures the balancedness an EPLB placement achieved      |
| oracle    | when the rank starts a layer's float64 check (epmoe.launch.oracle)      |
| other     | the first entry into that runtime stage (router, dispatch, experts, ...) |
KIND: exit (os._exit), kill (SIGKILL, as `kill -9`), raise (an exception), hang (sleeps).
A fault fires once, at the first match. With EPMOE_FAULT_MARK=FILE the rank first appends
"RANK PID" to FILE, so a test knows the moment (and the process) without guessing.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

KINDS = ("exit", "kill", "raise", "hang")
# launcher stage -> the worker call or runtime stage where it fires
STAGES = {"start": "start", "build": "build", "step": "step", "rebalance": "rebalance",
          "migrate": "eplb.migrate", "measure": "window_balancedness", "oracle": "oracle"}


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws."""


@dataclass(frozen=True)
class Fault:
    rank: int
    where: str  # as written in EPMOE_FAULT
    kind: str

    @staticmethod
    def parse(spec: str) -> "Fault | None":
        """EPMOE_FAULT -> Fault (None when empty); ValueError names the grammar."""
        if not spec:
            return None
        parts = spec.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or parts[2] not in KINDS or not parts[1]:
            raise ValueError(f"EPMOE_FAULT ({spec!r}) must be RANK:WHERE:KIND with KIND one of "
                             f"{', '.join(KINDS)} and WHERE a stage ({', '.join(STAGES)}) or a "
                             f"runtime stage name, e.g. 1:step:exit")
        return Fault(int(parts[0]), parts[1], parts[2])

    @property
    def point(self) -> str:
        """The worker call or runtime stage name this fault fires at."""
        return STAGES.get(self.where, self.where)

    def fire(self) -> None:
        from epmoe.env import fault_mark  # noqa: PLC0415

        if fault_mark():
            with open(fault_mark(), "a") as f:
                f.write(f"{self.rank} {os.getpid()}\n")
        if self.kind == "exit":
            os._exit(17)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        raise InjectedFault(f"injected fault on rank {self.rank} at {self.where}")


class FaultPoint:
    """One rank's armed fault: `hit(point)` fires it at the first matching point."""

    def __init__(self, fault: Fault | None, rank: int):
        self.fault = fault if fault is not None and fault.rank == rank else None

    def hit(self, point: str) -> None:
        f = self.fault
        if f is not None and f.point == point:
            self.fault = None
            f.fire()
