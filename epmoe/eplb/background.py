"""Asynchronous migration: every layer's changed slots are staged on a background thread while
steps go on with the old placement.

The thread runs `stage_layers` for all layers on the migration's own process group (created once
by the rebalancer, never used by a step, so its point-to-point sends cannot interleave with the
step's collectives). On CUDA its work goes to a side stream, which the thread synchronizes
before it reports done. The weights in use are only read; the staged slots are applied later,
at a step boundary all ranks agree on (see `Rebalancer.begin_step`).
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import torch

from epmoe.eplb.migrate import StagedLayer, stage_layers
from epmoe.experts.base import ExpertWeights


class BackgroundMigration:
    def __init__(self, weights: list[ExpertWeights], old_LR: list[list[int]],
                 new_LR: list[list[int]], rank: int, world: int, group, device: torch.device):
        self.new_LR = new_LR
        self._args = (weights, old_LR, new_LR, rank, world, group)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._staged: list[StagedLayer] = []
        self._error: BaseException | None = None
        self.stage_ms: float | None = None
        self._thread = threading.Thread(target=self._run, name="eplb-migration", daemon=True)
        if self._stream is not None:  # the side stream starts after the weights are written
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._thread.start()

    def _run(self) -> None:
        weights, old_LR, new_LR, rank, world, group = self._args
        t0 = time.perf_counter()
        try:
            if self._stream is not None:  # the current device is per thread
                torch.cuda.set_device(self._stream.device)
            ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
            with ctx:
                self._staged = stage_layers(weights, old_LR, new_LR, rank, world, group)
            if self._stream is not None:
                self._stream.synchronize()
        except BaseException as e:  # noqa: BLE001  (surfaced by result() on the main thread)
            self._error = e
        self.stage_ms = (time.perf_counter() - t0) * 1e3

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def failed(self) -> bool:
        return self.done and self._error is not None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def result(self, timeout: float | None = None) -> list[StagedLayer]:
        """The staged layers (waits for the thread); re-raises the thread's error."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"background migration still running after {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"background migration failed: {self._error}") from self._error
        return self._staged
