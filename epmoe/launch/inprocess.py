"""One rank in this process (no Ray, no process group), and the step loop every driver runs
(epmoe.launch.driver picks between this and its Ray actors)."""

from __future__ import annotations

import gc
import os
import time
from typing import Iterator

import torch

from epmoe.launch.blame import Failure
from epmoe.launch.console import Phases
from epmoe.launch.errors import LaunchError
from epmoe.launch.oracle import LayerCheck, LayerVerdict, solve
from epmoe.plan.run import RunConfig
from epmoe.plan.topology import local_cores
from epmoe.runtime import Runtime


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines() or [type(e).__name__])[0][:300]


def run_steps(d, on_step=None) -> tuple[list[dict], list[dict]]:
    """Start the ranks, run every step (calling on_step(step) after each), collect reports."""
    where = d.start()
    d.phases(f"running {d.run.steps} step(s)")
    bar = d.phases.steps(d.run.steps)
    try:
        for s in range(d.run.steps):
            d.call_all(f"step {s}", "step", s)
            if on_step is not None:
                on_step(s)
            if bar:
                bar.advance(bar.task_ids[0])
    finally:
        if bar:
            bar.stop()
    return d.call_all("report", "report"), where


class InProcessDriver:
    """One rank, no Ray, no process group (--timeout does not apply: nothing to wait for)."""

    on_ray = False

    def __init__(self, run: RunConfig, phases: Phases, device: str | None = None):
        self.run, self.phases, self.device = run, phases, device
        self.seconds: dict[str, float] = {}  # wall time of each stage of the launch

    def _fail(self, stage: str, e: Exception) -> LaunchError:
        f = Failure(stage=stage, kind="failed", ranks=(0,), waiting=(), finished=(),
                    detail=f"{type(e).__name__}: {first_line(e)}", where={0: stage})
        return LaunchError(f.message(), f)

    def start(self) -> list[dict]:
        self.phases("building the layers (1 rank, in this process)")
        t0 = time.monotonic()
        try:
            self.rt = Runtime(self.run, device=self.device)
        except Exception as e:
            raise self._fail("build", e) from None
        self.seconds["build"] = round(time.monotonic() - t0, 3)
        return [dict(rank=0, host=os.uname().nodename, node_id="local", device=str(self.rt.device),
                     pid=os.getpid(), cpus=local_cores())]

    def call_all(self, stage: str, method: str, *args) -> list:
        t0 = time.monotonic()
        try:
            out = [self.rt.call(method, *args)]
        except Exception as e:
            raise self._fail(stage, e) from None
        self.seconds[stage] = round(time.monotonic() - t0, 3)
        return out

    def execute(self) -> tuple[list[dict], list[dict]]:
        return run_steps(self)

    def solve_checks(self, checks: list[LayerCheck]) -> Iterator[LayerVerdict]:
        """The float64 check of each layer here, on the rank's device."""
        for c in checks:
            try:
                yield solve(self.run, c, self.rt.device)
            except Exception as e:
                raise self._fail("oracle", e) from None

    def close(self):
        """Close the runtime and hand its device memory back before the next launch in this
        process (a sweep builds one model per candidate: without this the previous ones'
        weights could still be held by reference cycles and the caching allocator)."""
        rt, self.rt = getattr(self, "rt", None), None
        if rt is None:
            return
        cuda = rt.device.type == "cuda"
        rt.close()
        del rt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
