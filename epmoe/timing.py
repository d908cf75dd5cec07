"""Per-stage timing: CUDA events on GPU (no sync until read), perf_counter on CPU."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class StageTimer:
    """`with timer.stage("dispatch"): ...`; `timer.collect()` -> {stage: [ms per call]}."""

    def __init__(self, enabled: bool = True, device: torch.device | str = "cpu"):
        self.enabled = enabled
        self.cuda = torch.device(device).type == "cuda"
        self._events: list[tuple[str, object, object]] = []
        self._ms: dict[str, list[float]] = defaultdict(list)

    @contextmanager
    def stage(self, name: str):
        if not self.enabled:
            yield
            return
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self._events.append((name, a, b))
        else:
            t0 = time.perf_counter()
            yield
            self._ms[name].append((time.perf_counter() - t0) * 1e3)

    def collect(self) -> dict[str, list[float]]:
        if self._events:
            torch.cuda.synchronize()
            for name, a, b in self._events:
                self._ms[name].append(a.elapsed_time(b))
            self._events.clear()
        out = {k: list(v) for k, v in self._ms.items()}
        return out

    def reset(self) -> None:
        self._events.clear()
        self._ms.clear()
