"""One GPU timer the benchmarks share: CUDA events around a call issued behind a device sleep
(the GPU busy while the host issues, so the time is the kernels', not the launch's)."""

from __future__ import annotations

import statistics

import torch


def event_median_us(fn, iters: int) -> float:
    """The median of `iters` timed calls of fn, after one untimed call (compiles, warm-up)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)
