"""The device's own figures for a calibration (`python -m epmoe.bench.calibrate`): SMs or cores,
compute capability, memory, copy bandwidth, the host's cost of one eager op and of a sync,
on CPU the fp32 matmul rate and the scheduler's slice; `time_us`, the timer the calibration's
microbenchmarks share."""

from __future__ import annotations

import os
import statistics
import time

from epmoe.bench.sched_slice import measure_slice_us
from epmoe.plan.profile import HOST_OP, SCHED_SLICE, Figure, HardwareProfile, Provenance


def time_us(fn, dev, reps: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in us (CUDA: synchronized around each call)."""
    import torch

    cuda = dev.type == "cuda"
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(dev)
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def measure_device(dev, clock, base: HardwareProfile, timing: str = "launched") -> dict:
    """{figure name: Figure} of `dev`, each with `clock.prov` (calibrate.Clock: this run's
    machine, date and command); the data-sheet peaks on a GPU are `base`'s."""
    import torch

    cuda = dev.type == "cuda"
    figs = {}
    if cuda:
        p = torch.cuda.get_device_properties(dev)
        figs["sm_arch"] = Figure(p.major * 10 + p.minor, clock.prov(p.name))
        figs["sms"] = Figure(p.multi_processor_count, clock.prov(p.name))
        figs["hbm_GiB"] = Figure(round(p.total_memory / 2**30, 1), clock.prov(p.name))
        n = 1 << 28
    else:
        figs["sm_arch"] = Figure(0, clock.prov("CPU"))
        figs["sms"] = Figure(os.cpu_count() or 1, clock.prov("logical CPUs"))
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        figs["hbm_GiB"] = Figure(round(ram / 2**30, 1), clock.prov("RAM"))
        n = 1 << 23
    a = torch.empty(n, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    us = time_us(lambda: b.copy_(a), dev, reps=10)
    figs["hbm_GBps"] = Figure(2 * a.numel() * 4 / us / 1e3,
                              clock.prov(f"copy of {a.numel() * 4 >> 20} MiB, read+write"))
    one = torch.zeros(1, device=dev)
    n_ops = 200

    def ops():
        for _ in range(n_ops):
            one.add_(1)

    if cuda:
        ops()  # the first launches load kernels
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        ops()
        launch = (time.perf_counter() - t) * 1e6 / n_ops
        torch.cuda.synchronize(dev)
        sync = time_us(lambda: (one.add_(1), torch.cuda.synchronize(dev)), dev, reps=20) - launch
        if timing == "device":  # what a tiny op costs the GPU, the host issuing ahead of it
            from epmoe.timing import DeviceSleep

            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            DeviceSleep(dev).hold(2 * launch * n_ops / 1e3 + 1.0)
            a.record()
            ops()
            b.record()
            b.synchronize()
            launch = a.elapsed_time(b) * 1e3 / n_ops
    else:
        launch = time_us(ops, dev, reps=5) / n_ops
        sync = 0.0
    figs["launch_us"] = Figure(launch, clock.prov(f"{n_ops} tiny eager ops ({timing} timing: "
                                                  f"{'GPU' if timing == 'device' else 'host'} "
                                                  f"time per op)"))
    from epmoe.timing import HOST_OPS, HOST_REPS, host_op_us

    figs[HOST_OP] = Figure(host_op_us(dev), clock.prov(
        f"{HOST_OPS} tiny eager ops, median of {HOST_REPS} (epmoe.timing.host_op_us: the "
        f"host's time per op{', issued behind a device hold' if cuda else ''})"))
    figs["sync_us"] = Figure(max(sync, 0.0), clock.prov("tiny kernel + synchronize" if cuda
                                                       else "no device to synchronize"))
    for name in ("peak_tflops_fp8", "peak_tflops_bf16", "peak_tflops_fp32"):
        if cuda:  # peaks are data-sheet figures: keep the base profile's
            f = base.device[name]
            figs[name] = Figure(f.value, f.prov.inherit(base.name))
    if not cuda:
        x = torch.randn(512, 512)
        us = time_us(lambda: x @ x, dev, reps=5)
        tf = 2 * 512**3 / us / 1e6
        what = f"fp32 matmul 512^3 on {torch.get_num_threads()} threads"
        figs["peak_tflops_fp32"] = Figure(tf, clock.prov(what))
        for name in ("peak_tflops_fp8", "peak_tflops_bf16"):
            figs[name] = Figure(tf, Provenance("derived", f"{what}: torch experts compute in "
                                                          f"fp32 on CPU"))
        slice_us = measure_slice_us()  # 0: nothing preempted (the model takes Linux's default)
        if slice_us > 0:
            figs[SCHED_SLICE] = Figure(slice_us, clock.prov(
                "the scheduler's slice: median run of two busy processes on one CPU"))
    return figs
