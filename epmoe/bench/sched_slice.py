"""The OS scheduler's time slice, measured: `python -m epmoe.bench.sched_slice`.

CPU ranks that outnumber their cores share them in slices (epmoe/plan/timeslice.py); how long
one runs before the scheduler preempts it is the kernel's (its base slice, rounded up to its
tick: 4 ms on a 250 Hz kernel, whatever the formula says). Two busy processes pinned to one
CPU each record the runs between their preemptions (a gap over 50 us in a tight clock loop);
the median run is the slice.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time

GAP_S = 50e-6


def _spin(cpu: int, seconds: float, out) -> None:
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:  # not allowed here: nothing to measure
        out.put([])
        return
    runs = []
    t0 = last = start = time.perf_counter()
    while last - t0 < seconds:
        now = time.perf_counter()
        if now - last > GAP_S:  # preempted between the two reads
            runs.append(last - start)
            start = now
        last = now
    out.put(runs[1:])  # the first run started before its rival did


def measure_slice_us(seconds: float = 0.5) -> float:
    """Median run (us) of two busy processes sharing one CPU; 0 where nothing was preempted
    (another core took one of them) or affinity is not available."""
    if not hasattr(os, "sched_setaffinity"):
        return 0.0
    cpu = min(os.sched_getaffinity(0))
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_spin, args=(cpu, seconds, out), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        runs = [r for _ in procs for r in out.get(timeout=seconds + 30)]
    except queue.Empty:  # a process died or never got the CPU: not measured
        runs = []
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
    return statistics.median(runs) * 1e6 if runs else 0.0


def main() -> int:
    print(f"scheduler slice: {measure_slice_us(1.0) / 1e3:.2f} ms (median run of two busy "
          f"processes on one CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
