"""What the symm kernels' synchronisation costs on this GPU: each primitive of
`epmoe.comm.symm.sync` in a kernel of its own, launched back to back from a CUDA graph, beside
an empty kernel and beside what two of them replaced (the baselines): the per-peer release
atomic `publish` replaced, and the system-scope count `arrive_last` did before it counted at
GPU scope (every CTA it counts runs on this GPU; the last one's publish is the release to
peers).

    python -m epmoe.bench.symm_sync [--ctas 1,24,132] [--warps 16] [--launches 200] [--json F]

One line per kernel, one column per CTA count: us per launch (the median of 5 graph replays
of `--launches` launches); then each primitive's time beyond the empty kernel over its
baseline's. The flags are those of a 2-rank loopback arena on this GPU (every peer is local
memory, as in the loopback world).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from epmoe.argtypes import at_least, int_list
from epmoe.kernels._common import INTERPRET

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm import sync as S  # noqa: E402
from epmoe.outputs import dump_json, run_main, writable_file  # noqa: E402

W = 2
W_C = tl.constexpr(W)
FAR_C = tl.constexpr(1 << 30)  # a spin limit never reached (the flags are already set)
TIMER_C = tl.constexpr(S.USE_TIMER)


@triton.jit
def _empty(arena_ptr, delta_ptr, out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1)


@triton.jit
def _arrive(arena_ptr, delta_ptr, out_ptr):
    tl.store(out_ptr + tl.program_id(0), S.arrive_last(arena_ptr, S.C_DONE_SEND,
                                                       tl.num_programs(0)))


@triton.jit
def _arrive_sys_baseline(arena_ptr, delta_ptr, out_ptr):
    """The baseline: `arrive_last` counting with a system-scope acq_rel atomic."""
    tl.debug_barrier()
    done = S.ctrl_ptr(arena_ptr, S.C_DONE_SEND)
    old = tl.atomic_add(done, 1, sem="acq_rel", scope="sys")
    last = (old == tl.num_programs(0) - 1).to(tl.int32)
    if last != 0:
        tl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")
    tl.store(out_ptr + tl.program_id(0), last)


@triton.jit
def _wait(arena_ptr, delta_ptr, out_ptr):
    tl.store(out_ptr + tl.program_id(0),
             S.wait_all(arena_ptr, S.C_READY, 0, 0, FAR_C, W_C, TIMER_C))


@triton.jit
def _publish(arena_ptr, delta_ptr, out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1)
    if tl.program_id(0) == 0:
        tl.debug_barrier()
        S.publish(arena_ptr, delta_ptr, S.C_READY + 8, 1, W_C)


@triton.jit
def _publish_per_peer_release(arena_ptr, delta_ptr, out_ptr):
    """The baseline: one release atomic per peer (what `publish` did before)."""
    tl.store(out_ptr + tl.program_id(0), 1)
    if tl.program_id(0) == 0:
        tl.debug_barrier()
        for d in tl.static_range(W_C):
            tl.atomic_xchg(S.ctrl_ptr(S.peer_ptr(arena_ptr, delta_ptr, d), S.C_READY + 8), 1,
                           sem="release", scope="sys")


@triton.jit
def _send_half(arena_ptr, delta_ptr, out_ptr):
    """A send half's whole protocol without data: wait for acks, count in, publish."""
    ok = S.wait_all(arena_ptr, S.C_READY, 0, 0, FAR_C, W_C, TIMER_C)
    tl.store(out_ptr + tl.program_id(0), ok)
    S.finish_send(arena_ptr, delta_ptr, 0, 1, 0, W_C)


KERNELS = {"empty": _empty, "arrive_last": _arrive, "arrive_baseline": _arrive_sys_baseline,
           "wait_all": _wait, "publish": _publish,
           "publish_baseline": _publish_per_peer_release, "send_half": _send_half}
BASELINES = {"publish": "publish_baseline", "arrive_last": "arrive_baseline"}


def time_kernel(kernel, ctas: int, warps: int, launches: int) -> float:
    """us per launch: `launches` launches captured in one CUDA graph, median of 5 replays."""
    arena = torch.zeros(W, 1 << 16, dtype=torch.uint8, device="cuda")
    delta = torch.tensor([d * arena.stride(0) for d in range(W)], dtype=torch.int64,
                         device="cuda")
    out = torch.zeros(max(ctas, 1), dtype=torch.int32, device="cuda")

    def run():
        kernel[(ctas,)](arena[0], delta, out, num_warps=warps)

    run()
    torch.cuda.synchronize()
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(launches):
            run()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    return statistics.median(times)


def table(rows: list[dict]) -> str:
    """Kernels down, CTA counts across (us per launch); then each primitive's cost beyond the
    empty kernel over its baseline's, per CTA count."""
    head = f"{'us per launch':<18}" + "".join(f"{str(r['ctas']) + ' CTAs':>10}" for r in rows)
    lines = [head, "-" * len(head)]
    for name in KERNELS:
        lines.append(f"{name:<18}" + "".join(f"{r['us_per_launch'][name]:>10.2f}"
                                             for r in rows))
    for name, base in BASELINES.items():
        ratios = []
        for r in rows:
            us = r["us_per_launch"]
            ratios.append((us[name] - us["empty"]) / max(1e-9, us[base] - us["empty"]))
        lines.append(f"{name + ' / base':<18}" + "".join(f"{x:>9.2f}x" for x in ratios))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.symm_sync",
                                description=__doc__.splitlines()[0])
    p.add_argument("--ctas", type=int_list(1), default="1,24,132",
                   help="comma-separated grid sizes")
    p.add_argument("--warps", type=at_least(1), default=16)
    p.add_argument("--launches", type=at_least(1), default=200)
    p.add_argument("--json", type=writable_file, help="write the figures as JSON to this file")
    a = p.parse_args(argv)
    if INTERPRET or not torch.cuda.is_available():
        print("error: needs a CUDA GPU (compiled Triton, not the interpreter)", file=sys.stderr)
        return 2
    rows = []
    for ctas in a.ctas:
        us = {n: time_kernel(k, ctas, a.warps, a.launches) for n, k in KERNELS.items()}
        rows.append({"ctas": ctas, "warps": a.warps, "us_per_launch": us})
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            dump_json({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
