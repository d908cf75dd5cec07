"""`python -m epmoe.bench.symm_host`: the host's time to issue each call of our symm backends,
in the loopback world on one GPU (both ranks' arenas on the device, rank by rank).

A device sleep keeps the GPU busy for the whole iteration, so no call waits for the GPU: what
is timed is Python, Triton's launcher and the torch ops around the kernels (the GPU's time is
`bench.comm`'s). Per rank and call, median of the timed iterations; with the Triton kernels
launched per phase. Why it matters: in an eager step the GPU idles while the host issues a
call, so a launched stage costs its issue time plus its GPU time; on the lent H200s a symm-ht
dispatch's issue time was measured at several times its GPU time at 4096 tokens per rank
(BENCHMARKS.md, section 17).

    python -m epmoe.bench.symm_host [--json FILE] [--profile IN --out OUT]

--profile / --out: write the medians over the cases into profile IN's kernels["comm"] as
"host.<backend>.<dispatch|combine>" (alpha only: the cost model adds it to the call's GPU
time, scaled by the host's speed like every host figure) and save the result as OUT.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

from epmoe.argtypes import at_least
from epmoe.plan.figures import HOST_PREFIX
from epmoe.outputs import dump_json, run_main

CASES = (("symm-ht", 128, "fp8_block"), ("symm-ht", 4096, "fp8_block"),
         ("symm-ht", 4096, "bf16"), ("symm-ll", 128, "fp8_block"), ("symm-ll", 1, "fp8_block"))
PHASES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
SLEEP_CYCLES = 60_000_000  # ~30 ms: longer than the host takes to issue one iteration
NO_BYTES_GBPS = 1e9  # an issue time does not grow with the bytes: the fits are alpha only


def measure(backend: str, tokens: int, recipe: str, iters: int = 10, warmup: int = 4) -> dict:
    """-> {phase: host us per rank and call, "triton_launches": per phase, the launches through
    Triton's JITFunction.run (0 where a bound `Launcher` took the shortcut), "gpu_busy": bool}."""
    import torch
    import triton.runtime.jit as tj

    from epmoe.bench.comm_loopback import _cfg, routing
    from epmoe.bench.comm_ranks import identity_experts
    from epmoe.comm import backend_class
    from epmoe.comm.symm.loopback import loopback_comms
    from epmoe.config import QuantConfig

    launched = [0]
    orig = tj.JITFunction.run

    def counting(self, *a, **k):
        launched[0] += 1
        return orig(self, *a, **k)

    tj.JITFunction.run = counting
    try:
        _, comms = loopback_comms(backend_class(backend), _cfg(), QuantConfig(recipe), 2,
                                  tokens, device="cuda")
        g = torch.Generator().manual_seed(tokens)
        xs = [torch.randn(tokens, _cfg().hidden, generator=g).bfloat16().cuda()
              for _ in comms]
        rw = [routing(tokens, g, "cuda") for _ in comms]
        times = {p: [] for p in PHASES}
        busy, counts = True, {}
        for it in range(warmup + iters):
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            marks, ns = [time.perf_counter()], [launched[0]]

            def mark():
                marks.append(time.perf_counter())
                ns.append(launched[0])

            pend = [c.dispatch_send(x, *r) for c, x, r in zip(comms, xs, rw)]
            mark()
            outs = [c.dispatch_recv(p) for c, p in zip(comms, pend)]
            mark()
            ys = [identity_experts(b) for b, _ in outs]
            mark()
            sent = [c.combine_send(y, h) for c, y, (_, h) in zip(comms, ys, outs)]
            mark()
            for c, s in zip(comms, sent):
                c.combine_recv(s)
            mark()
            still = not torch.cuda.current_stream().query()
            torch.cuda.synchronize()
            for c in comms:
                c.check_errors()
            if it < warmup:  # first calls compile and load modules (a load can synchronize)
                continue
            busy = busy and still
            per = [(marks[i + 1] - marks[i]) / len(comms) * 1e6 for i in range(5)]
            for p, us in zip(PHASES, (per[0], per[1], per[3], per[4])):
                times[p].append(us)
            n = [(ns[i + 1] - ns[i]) / len(comms) for i in range(5)]
            counts = dict(zip(PHASES, (n[0], n[1], n[3], n[4])))
    finally:
        tj.JITFunction.run = orig
    return {**{p: statistics.median(v) for p, v in times.items()},
            "triton_launches": counts, "gpu_busy": busy}


def host_fits(results: dict) -> dict:
    """{"host.<backend>.<direction>": us}: per backend, the median over its cases of send +
    receive."""
    out: dict = {}
    for key, r in results.items():
        backend = key.split()[0]
        for direction in ("dispatch", "combine"):
            us = r[f"{direction}_send"] + r[f"{direction}_recv"]
            out.setdefault(f"{HOST_PREFIX}{backend}.{direction}", []).append(us)
    return {k: round(statistics.median(v), 1) for k, v in out.items()}


def write_profile(src: str, dst: str, fits: dict, note: str,
                  host_op_us: float | None = None) -> None:
    """Profile `src` with `fits` as its host issue times, saved as `dst`. host_op_us: the
    measuring host's time per tiny op; where the profile records its own host's, the fits are
    scaled to that host (the cost model scales them back to a run's host)."""
    from epmoe.plan.figures import HOST_OP
    from epmoe.plan.profile import AlphaBeta, Provenance, load_profile

    prof = load_profile(src)
    scale = 1.0
    if host_op_us and HOST_OP in prof.device:
        scale = prof.fig(HOST_OP) / host_op_us
        note += (f"; measured on a host at {host_op_us:.2f} us per op, scaled x{scale:.3f} "
                 f"to this profile's {prof.fig(HOST_OP):.2f}")
    comm = dict(prof.kernels.get("comm", {}))
    for k, us in fits.items():
        comm[k] = AlphaBeta(round(us * scale, 1), NO_BYTES_GBPS, Provenance("measured", note))
    prof.replace(kernels={**prof.kernels, "comm": comm}).save(dst)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.symm_host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the measurements here")
    p.add_argument("--profile", help="profile to add the host fits to (with --out)")
    p.add_argument("--out", help="where the profile with the host fits goes")
    p.add_argument("--iters", type=at_least(1), default=10)
    a = p.parse_args(argv)
    if bool(a.profile) != bool(a.out):
        print("error: --profile and --out go together", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (the symm kernels and their launcher)", file=sys.stderr)
        return 2
    from epmoe.timing import host_op_us

    results = {}
    host = host_op_us("cuda")
    print(f"host: {host:.2f} us per tiny eager op", flush=True)
    for backend, tokens, recipe in CASES:
        r = measure(backend, tokens, recipe, a.iters)
        results[f"{backend} {recipe} {tokens}"] = r
        print(f"{backend:<8} {recipe:<9} {tokens:>5} tok: " + ", ".join(
            f"{ph} {r[ph]:.0f}" for ph in PHASES) + f" us; launches through Triton's binder "
            f"{r['triton_launches']}" + ("" if r["gpu_busy"] else " (GPU went idle: "
                                               "a wait crept in)"), flush=True)
    fits = host_fits(results)
    if a.json:
        with open(a.json, "w") as f:
            dump_json({"results": results, "fits": fits, "host_op_us": host}, f, indent=1)
    if a.profile:
        when = datetime.date.today().isoformat()
        write_profile(a.profile, a.out, fits, f"{torch.cuda.get_device_name()}, {when}, "
                                              f"python -m epmoe.bench.symm_host", host)
        print(f"wrote {a.out}: " + ", ".join(f"{k} {v:.0f} us" for k, v in fits.items()))
    return 0


if __name__ == "__main__":
    run_main(main)
