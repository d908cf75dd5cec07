"""Per-stage timing (CUDA events on GPU, perf_counter on CPU) and where a rank is right now.

`with timer.stage("dispatch"): ...` times a stage; `timer.collect()` -> {stage: [ms per call]}.
The timer also knows the stage a rank is in (`timer.where()`), so a launcher can ask a busy
rank where it is (a heartbeat) and call an `on_enter(name)` hook at every stage entry.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class StagePosition:
    """Where a rank is: the innermost open stage (None between stages), how many stages it has
    entered so far (ranks running the same program enter the same sequence, so a rank with
    fewer entries is behind), how many are open (of two ranks that entered as many, the one
    that has left more of them is ahead: it finished the stage the other is still in), and
    for how long it has been in that stage."""

    stage: str | None
    entered: int
    seconds_in_stage: float
    depth: int = 0


class StageTimer:
    """`with timer.stage("dispatch"): ...`; `timer.collect()` -> {stage: [ms per call]}.

    `record=False` marks a stage for `where()` and the hook without timing it (waits outside
    the timed step, e.g. the barrier before a step). Disabled timers still track position.
    `host=True` also times each stage on the host's clock (`collect_host()`): on a GPU that is
    the time the host spends issuing the stage, next to the events' time on the stream.
    Inside `capturing()` (a CUDA graph capture) each stage records external events, nodes of
    the graph that fire on every replay; `replayed()` reads them after each replay.
    `step` / `layer` (set by the runtime as it issues) tag each call: `collect_where()`."""

    def __init__(self, enabled: bool = True, device: torch.device | str = "cpu",
                 host: bool = False):
        self.enabled = enabled
        self.cuda = torch.device(device).type == "cuda"
        self.host = host
        self._events: list[tuple[str, object, object, tuple]] = []
        self._ms: dict[str, list[float]] = defaultdict(list)
        self._at: dict[str, list[tuple]] = defaultdict(list)  # (step, layer) of each call
        self.step: int | None = None
        self.layer: int | None = None
        self._host_ms: dict[str, list[float]] = defaultdict(list)
        self._open: list[str] = []
        self._entered = 0
        self._since = time.monotonic()
        self.on_enter: Callable[[str], None] | None = None
        self.failed_in: str | None = None  # the innermost stage an exception left (if any)
        self._capture: list | None = None  # the events of a capture under way
        self._graph_events: list[tuple[str, object, object, int | None]] = []

    @contextmanager
    def stage(self, name: str, record: bool = True):
        self._open.append(name)
        self._entered += 1
        self._since = time.monotonic()
        try:
            if self.on_enter is not None:
                self.on_enter(name)
            if not (self.enabled and record):
                yield
            elif self._capture is not None:  # graph nodes: no host time (nothing runs now)
                a, b = (torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
                a.record()
                yield
                b.record()
                self._capture.append((name, a, b, self.layer))
            elif self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                a.record()
                yield
                b.record()
                self._events.append((name, a, b, (self.step, self.layer)))
                if self.host:
                    self._host_ms[name].append((time.perf_counter() - t0) * 1e3)
            else:
                t0 = time.perf_counter()
                yield
                self._ms[name].append((time.perf_counter() - t0) * 1e3)
                self._at[name].append((self.step, self.layer))
                if self.host:  # on the CPU the stage's time is the host's
                    self._host_ms[name].append(self._ms[name][-1])
        except BaseException:
            if self.failed_in is None:
                self.failed_in = name
            raise
        finally:
            self._open.pop()
            self._since = time.monotonic()

    @contextmanager
    def capturing(self):
        """Stages entered inside are timed by the graph being captured (see the class)."""
        self._capture = []
        try:
            yield
        finally:
            self._graph_events, self._capture = self._capture, None

    def replayed(self) -> None:
        """After a replay of the captured graph has finished (synchronized): its stage times.
        Each replay re-records the same events, so they are read now, before the next."""
        for name, a, b, layer in self._graph_events:
            self._ms[name].append(a.elapsed_time(b))
            self._at[name].append((self.step, layer))

    def where(self) -> StagePosition:
        """The innermost open stage; safe to call from another thread while a step runs."""
        open_ = list(self._open)
        return StagePosition(open_[-1] if open_ else None, self._entered,
                             time.monotonic() - self._since, len(open_))

    def collect(self) -> dict[str, list[float]]:
        if self._events:
            torch.cuda.synchronize()
            for name, a, b, at in self._events:
                self._ms[name].append(a.elapsed_time(b))
                self._at[name].append(at)
            self._events.clear()
        return {k: list(v) for k, v in self._ms.items()}

    def collect_where(self) -> dict[str, list[tuple]]:
        """{stage: [(step, layer) of each call]}, in collect()'s order (call collect first)."""
        return {k: list(v) for k, v in self._at.items()}

    def collect_host(self) -> dict[str, list[float]]:
        """{stage: [host ms per call]} (timers made with host=True; else empty)."""
        return {k: list(v) for k, v in self._host_ms.items()}

    def reset(self) -> None:
        self._events.clear()
        self._ms.clear()
        self._at.clear()
        self._host_ms.clear()


RATE_CYCLES = 2_000_000  # ~1 ms spins measure the device clock once per DeviceSleep


class DeviceSleep:
    """Keeps a GPU busy while the host issues work: `hold(ms)` enqueues a spin kernel of about
    `ms` on the current stream, so the launches that follow queue up behind it and CUDA events
    between them time the GPU's work only (the rate, cycles per ms, is measured at first use)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._cycles_per_ms: float | None = None

    def _rate(self) -> float:
        if self._cycles_per_ms is None:  # a first spin loads the kernel and keeps the GPU busy
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(RATE_CYCLES)  # while the host records the timed one behind it
            a.record()
            torch.cuda._sleep(RATE_CYCLES)
            b.record()
            b.synchronize()
            self._cycles_per_ms = RATE_CYCLES / max(a.elapsed_time(b), 1e-3)
        return self._cycles_per_ms

    def hold(self, ms: float) -> None:
        torch.cuda._sleep(max(1, int(self._rate() * ms)))


HOST_OPS, HOST_REPS = 200, 5  # the host-speed probe: tiny eager ops per rep, reps (median)


def host_op_us(device: torch.device | str, n_ops: int = HOST_OPS, reps: int = HOST_REPS) -> float:
    """The host's time to issue one tiny eager op (`x.add_(1)` on one element), median over
    `reps` runs of `n_ops`: how fast this process's host launches work. On CUDA each run
    issues behind a device hold, so the GPU never holds the host back; on the CPU the op
    runs where it is issued. A profile records it (`host_op_us`) and a run measures it again:
    the ratio scales the profile's host-bound figures to this host
    (`HardwareProfile.at_host_speed`)."""
    import statistics

    dev = torch.device(device)
    one = torch.zeros(1, device=dev)
    cuda = dev.type == "cuda"
    sleep = DeviceSleep(dev) if cuda else None
    out = []
    for r in range(reps + 1):  # the first run loads the kernel: not counted
        if cuda:
            torch.cuda.synchronize(dev)
            sleep.hold(1.0 + 2e-3 * n_ops * (out[-1] if out else 20.0))  # > the issue time
        t = time.perf_counter()
        for _ in range(n_ops):
            one.add_(1)
        if r:
            out.append((time.perf_counter() - t) * 1e6 / n_ops)
    if cuda:
        torch.cuda.synchronize(dev)
    return statistics.median(out)
