"""`python -m epmoe.bench.calibrate --out profile.json [--quick]`: measure this machine and
write a hardware profile (epmoe.plan.profile) for the planner.

What it measures, through the runtime's own code (the StageTimer stage names the cost model
predicts), each figure marked `measured` with the machine, date and command:
- device (calibrate_device.py): SMs / cores, compute capability, memory, HBM (or RAM) copy
  bandwidth, the host cost of one eager op and of a host sync; on CPU also the fp32 matmul
  rate and the scheduler's slice (sched_slice.py);
- the layer at one rank (calibrate_layer.py): for every available experts backend (torch;
  triton and deepgemm on CUDA) and recipe, a one-layer Runtime's MoELayer.forward at several
  token counts: GEMM1/GEMM2 TFLOPS vs rows per expert (-> curves), permute / gather /
  act_quant, the dispatch quantizer, the local backend's dispatch and combine (-> alpha-beta
  fits on epmoe/plan/traffic.py's byte counts) and the shared MLP (-> time vs tokens, alone
  and, on CUDA, overlapped as the runtime runs it);
- comm, with >= 2 ranks (spawned processes: gloo on CPU, NCCL on GPUs): collectives' alpha-
  beta and the comm backends' stage times (calibrate_comm.py).
Everything it cannot measure here (one GPU: no comm; CPU: no fp8 peak) is copied from a base
profile (`--base`, default: the shipped profile of this GPU kind, or cpu) and marked
`inherited`. GPU libraries are imported lazily; `--quick` keeps a CPU run to seconds.

Time on one H200 (DeepSeek-V3 dims, 256 experts at one rank; the sizes and why: see
calibrate_layer.py): four (backend, recipe) layers, 6 token counts (3 with --quick), 5 timed
forwards (3) each, alone and overlapped; most of it is building the weights and compiling
(DeepGEMM's JIT, Triton's autotuner); `--budget-s` stops new sizes and layers when spent.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

from epmoe.argtypes import at_least, model_name, seconds
from epmoe.bench.calibrate_device import measure_device, time_us
from epmoe.outputs import run_main, writable_file
from epmoe.plan import traffic as tr
from epmoe.plan.figures import public_note
from epmoe.plan.profile import (HOST_OP, OVERLAPPED, QUEUED, AlphaBeta, Figure, HardwareProfile,
                                Provenance, load_profile)
from epmoe.plan.topology import gpu_kind_of

DEFAULT_MODEL = {"cpu": "deepseek-v3-tiny", "cuda": "deepseek-v3"}


class Clock:
    """Provenance of this run and the time budget."""

    def __init__(self, argv, budget_s: float, machine: str):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        day = datetime.date.today().isoformat()
        cmd = f"python -m epmoe.bench.calibrate {' '.join(argv)}".strip()
        self.note = public_note(f"{machine}, {day}, {cmd}")
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def prov(self, what: str = "") -> Provenance:
        return Provenance("measured", f"{self.note}{': ' + what if what else ''}")


UNBOUNDED_GBPS = 1e9  # beta of a fit whose time does not grow with bytes: a fixed cost


def fit_ab(points) -> tuple[float, float]:
    """Least-squares t = alpha + bytes / beta over (bytes, us) points -> (alpha us, beta GB/s).
    One size: no fixed cost visible (beta through the point). A time that does not grow with
    the bytes (slope <= 0: a fixed cost, e.g. a host-bound launch sequence): alpha = the mean
    time, beta = UNBOUNDED_GBPS. A negative intercept: alpha 0, beta through the largest."""
    pts = [(float(b), float(t)) for b, t in points if b > 0 and t > 0]
    if not pts:
        raise ValueError("no positive (bytes, us) points to fit")
    if len(pts) == 1 or len({b for b, _ in pts}) == 1:
        b, t = max(pts)
        return 0.0, b / t / 1e3
    n = len(pts)
    mb = sum(b for b, _ in pts) / n
    mt = sum(t for _, t in pts) / n
    sxx = sum((b - mb) ** 2 for b, _ in pts)
    slope = sum((b - mb) * (t - mt) for b, t in pts) / sxx
    if slope <= 0:
        return mt, UNBOUNDED_GBPS
    alpha = mt - slope * mb
    if alpha < 0:
        b, t = max(pts)
        return 0.0, b / t / 1e3
    return alpha, 1.0 / slope / 1e3


# ------------------------------------------------------------------------------ experts
def measure_quantize(cfg, quant, dev, clock: Clock) -> AlphaBeta:
    import torch

    from epmoe.kernels.quantize import quantize_tokens

    q = quant if quant.recipe != "bf16" else type(quant)("fp8_block")
    pts = []
    for n in (256, 4096) if dev.type == "cpu" else (1024, 16384):
        x = torch.randn(n, cfg.hidden, device=dev, dtype=torch.bfloat16)
        pts.append((tr.quantize_bytes(n, cfg.hidden, q),
                    time_us(lambda: quantize_tokens(x, q), dev)))
    return AlphaBeta(*fit_ab(pts), clock.prov(f"epmoe.kernels.quantize.quantize_tokens (the "
                                              f"comm's quantizer) {q.recipe}, alone"))


# ------------------------------------------------------------------------------ assembly
def _inherited(obj, frm: str):
    import dataclasses

    return dataclasses.replace(obj, prov=obj.prov.inherit(frm))


def _base(spec, gpu: str) -> HardwareProfile | None:
    """The profile unmeasured figures come from; None on a CPU without a shipped cpu profile
    (a CPU run measures everything the CPU planner reads)."""
    try:
        return load_profile(spec or gpu)
    except ValueError:
        if spec or gpu != "cpu":
            raise
        return None


def _recipes(spec: str | None, kind: str, cfg) -> list[str]:
    """The recipes to time: --recipes, else fp8_block and bf16 on GPU, bf16 on CPU."""
    from epmoe.config import RECIPES, QuantConfig

    if not spec:
        return ["bf16"] if kind == "cpu" else ["fp8_block", "bf16"]
    recipes = [r for r in spec.split(",") if r]
    if not recipes or set(recipes) - set(RECIPES):
        raise ValueError(f"--recipes {spec!r}: each must be one of {RECIPES}")
    for r in recipes:
        QuantConfig(r).check_shapes(cfg)  # e.g. gpt-oss's hidden 2880 takes no fp8 1x128
    return recipes


def merge_onto(base: HardwareProfile | None, gemm, kernels: dict, mlp):
    """What a calibration measured, over what it inherits from `base` (each kept base figure
    marked inherited). A curve replaces the base's curves of its backend, recipe and layout
    at its own (N, K) only, an MLP curve the base's at its (width, hidden) and side: the
    base keeps its other shapes, so calibrating gpt-oss's shapes over a DeepSeek-shaped
    profile adds curves (the lookups take the nearest shape) instead of dropping them. A
    kernel fit measured here replaces the base's of its name (and its `.overlapped` /
    `.queued` twins when only the plain fit was measured).
    -> (gemm, kernels, comm, collectives, mlp)."""
    shapes = {(c.backend, c.recipe, c.layout, c.n, c.k) for c in gemm}
    mlp_shapes = {(c.backend, c.recipe, c.overlapped, c.width, c.hidden) for c in mlp}
    kern, comm, coll, kept_gemm, kept_mlp = {}, {}, {}, (), ()
    if base is not None:
        kept_gemm = tuple(_inherited(c, base.name) for c in base.gemm
                          if (c.backend, c.recipe, c.layout, c.n, c.k) not in shapes)
        kept_mlp = tuple(_inherited(c, base.name) for c in base.mlp
                         if (c.backend, c.recipe, c.overlapped, c.width, c.hidden)
                         not in mlp_shapes)
        kern = {b: {k: _inherited(v, base.name) for k, v in t.items()}
                for b, t in base.kernels.items()}
        comm = {b: {l: {d: _inherited(f, base.name) for d, f in t.items()}
                    for l, t in lt.items()} for b, lt in base.comm.items()}
        coll = {c: {l: _inherited(f, base.name) for l, f in t.items()}
                for c, t in base.collectives.items()}
    for b, t in kernels.items():
        kern.setdefault(b, {}).update(t)
        for name in t:  # a fit measured here outdates the base's fits of it measured beside
            for sfx in (OVERLAPPED, QUEUED):  # the shared MLP or behind a device hold
                if name + sfx not in t:
                    kern[b].pop(name + sfx, None)
    return tuple(gemm) + kept_gemm, kern, comm, coll, tuple(mlp) + kept_mlp


PARTS = ("layer", "comm")


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(p for p in text.split(",") if p)
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise ValueError(f"--parts ({text!r}) takes a comma-separated subset of {PARTS}")
    return parts


def calibrate(args, argv) -> tuple[HardwareProfile, Clock]:
    import torch

    dev = torch.device("cuda", 0) if torch.cuda.is_available() and args.device != "cpu" \
        else torch.device("cpu")
    kind = dev.type
    if kind == "cpu":  # as the runtime's CPU workers (launch/worker.py): one thread per rank
        torch.set_num_threads(1)
    gpu_name = torch.cuda.get_device_name(dev) if kind == "cuda" else platform.processor() or \
        platform.machine()
    gpu = "cpu" if kind == "cpu" else gpu_kind_of(gpu_name) or "h200"
    base = _base(args.base, gpu)
    load = f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs" \
        if kind == "cpu" else ""
    clock = Clock(argv, args.budget_s, f"{gpu_name}{load}")
    from epmoe.bench.calibrate_layer import measure_layer
    from epmoe.bench.layer_points import LayerFits, finish
    from epmoe.config import QuantConfig, default_scale_fmt, get_preset

    model = args.model or DEFAULT_MODEL[kind]
    cfg = get_preset(model)
    backends = ["torch"]
    if kind == "cuda":
        backends = ["deepgemm", "triton"] + (["torch"] if not args.quick else [])
    recipes = _recipes(args.recipes, kind, cfg)  # checked before anything is measured
    parts = _parts(args.parts)
    device = measure_device(dev, clock, base, args.timing)
    fits = LayerFits()
    if "layer" not in parts:
        clock.skipped.append("the layer (--parts comm): its figures inherited")
        recipes = []
    for recipe in recipes:
        for name in backends:
            if clock.left() < 0:
                clock.skipped.append(f"{name}/{recipe}: time budget")
                continue
            if name == "torch" and recipe != recipes[0]:
                continue  # the reference computes in fp32 whatever the recipe
            fmt = default_scale_fmt(recipe, device["sm_arch"].value)
            try:
                measure_layer(model, cfg, QuantConfig(recipe, fmt), name, dev, clock, fits,
                              args.quick, reps=3 if args.quick else 5, timing=args.timing)
            except (ImportError, OSError, RuntimeError, ValueError) as exc:
                clock.skipped.append(f"{name}/{recipe}: {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0][:120]}")
    kernels = finish(fits, clock, fit_ab)
    if fits.host_op_us:  # the host's speed while it issued the layer's forwards
        from epmoe.timing import HOST_OPS, HOST_REPS

        device[HOST_OP] = Figure(statistics.median(fits.host_op_us), clock.prov(
            f"{HOST_OPS} tiny eager ops (epmoe.timing.host_op_us, median of {HOST_REPS}), "
            f"measured after each size's forwards: the median of {len(fits.host_op_us)}"))
    # no quantized recipe ran through the layer: the dispatch quantizer on its own
    if "layer" in parts and "quantize" not in kernels.get("comm", {}):
        kernels.setdefault("comm", {})["quantize"] = measure_quantize(
            cfg, QuantConfig("fp8_block"), dev, clock)
    if base is not None and HOST_OP in device:  # what it inherits, at the host it records
        base, why = base.at_host(device[HOST_OP].value)
        clock.skipped += [why] if why and "layer" not in parts else []
    gemm, kern, comm, coll, mlp = merge_onto(base, fits.gemm, kernels, fits.mlp)
    prof = HardwareProfile(args.name or f"{gpu}-calibrated", gpu,
                           f"calibrated on {clock.note}", device, gemm, kern, comm, coll, mlp)
    world = args.ranks if args.ranks is not None else \
        (torch.cuda.device_count() if kind == "cuda" else 2)
    if "comm" not in parts:
        clock.skipped.append("comm (--parts layer): collectives and backends inherited")
    elif world >= 2:
        from epmoe.bench.calibrate_comm import calibrate_comm

        prof = calibrate_comm(prof, world, kind, cfg, args.quick, clock)
    else:
        clock.skipped.append("comm: one rank here (collectives and backends inherited)")
    return prof, clock


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.calibrate", description=(
        "Measure this machine (device, experts kernels, collectives and comm backends with "
        ">= 2 ranks) and write a hardware profile for python -m epmoe.plan --profile FILE."))
    p.add_argument("--out", required=True, type=writable_file, help="the profile JSON to write")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--base", default=None, help="profile to inherit unmeasured figures from "
                                                "(default: the shipped one of this GPU, or cpu)")
    p.add_argument("--name", default=None, help="profile name (default GPU-calibrated)")
    p.add_argument("--model", type=model_name, default=None,
                   help="preset (or a Hugging Face config.json) whose shapes to measure "
                        "(default deepseek-v3 on GPU, deepseek-v3-tiny on CPU)")
    p.add_argument("--ranks", type=at_least(1), default=None,
                   help="ranks for the comm part (default: GPUs here, or 2 CPU processes)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu"))
    p.add_argument("--timing", default="launched", choices=("launched", "device"),
                   help="the layer's stages as a launch times them with the same --timing "
                        "(device: GPU time, the host issuing ahead; see launch --timing)")
    p.add_argument("--recipes", default=None,
                   help="recipes whose layers to time, comma separated (default fp8_block,bf16 "
                        "on GPU, bf16 on CPU; e.g. mxfp8 for gpt-oss: a profile without a "
                        "recipe's curves prices it from fp8_block's, and the plan says so)")
    p.add_argument("--parts", default="layer,comm",
                   help="what to measure: layer (the one-rank layer's kernels), comm "
                        "(collectives and comm backends on --ranks ranks), or both; the rest "
                        "is inherited from --base")
    p.add_argument("--budget-s", type=seconds, default=170.0,
                   help="stop measuring new sizes after this many seconds (default 170)")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        prof, clock = calibrate(args, argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prof.save(args.out)
    counts = prof.provenance_counts()
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items() if v))
    for s in clock.skipped:
        print(f"  not measured: {s}")
    return 0


if __name__ == "__main__":
    run_main(main)
