"""The stages of one MoE layer at one rank, measured through the runtime's own code.

`measure_layer(...)` builds a one-layer `Runtime` (ep 1, the model's dims, its synthetic
weights, the local comm backend, the experts backend under test and its shared experts) and
times `MoELayer.forward` with the runtime's `StageTimer` on balanced synthetic routing at a
few token counts, so that every figure below covers exactly what the runtime's stage covers:

| figure (profile)                       | from the stages                     | over           |
|----------------------------------------|-------------------------------------|----------------|
| gemm curves (backend, recipe)          | experts.gemm1 / experts.gemm2       | aligned rows   |
| kernels[backend] permute/gather/act_q. | experts.permute / .gather / .act_q. | traffic.py     |
|   (act_quant also per recipe)          |                                     |                |
| mlp (alone)                            | shared, overlap_shared off          | tokens         |
| mlp (overlapped, CUDA)                 | shared on its side stream, as the   | tokens         |
|                                        | runtime runs it by default          |                |
| - host-bound stages, from forwards that run the layer's own router (below) -               |
| kernels["comm"]["quantize(.b(.r))"]    | dispatch.quantize (quantized recipes)| quantize_bytes |
| kernels["local"]["dispatch(.recipe)"]  | dispatch - dispatch.quantize (bf16: | id/weight bytes|
|                                        | the whole stage), pooled, per recipe|                |
| kernels["local"]["combine(.experts)"]  | combine                             | the cast       |
| kernels["router"][cfg.router]          | router (MoELayer.route_physical)    | router_bytes   |
| kernels["layer"]["tail(.backend)"]     | the whole forward minus its stages  | output bytes   |
|                                        | composed as the cost model does     |                |
| kernels["layer"]["issue(.backend)"]    | the host's time to issue a forward  | output bytes   |
| kernels["layer"]["norm" / "residual"]  | norm / residual (runtime.run_layer: | traffic.py     |
|                                        | the work between two layers)        |                |
| the quantize / local / router / tail   | the same stages, each forward       | as above       |
| rows, permute / gather / act_quant as  | behind a device hold (launched      |                |
| "<name>.queued", the overlapped mlp    | timing, CUDA), with the layer's     |                |
| curve with queued set                  | router                              |                |

The first rows come from forwards on balanced synthetic routing (every expert m rows: the
GEMM curves' x is exact). The host-bound rows come from forwards that run the layer's own
router as a launch does: a small stage's event time is its host launch time when the GPU is
idle and its GPU time when it queues behind the router's work, so it must be timed behind it.
A stack's later layers start behind the layers before (the host issues ahead of the GPU):
their host-bound stages and the shared MLP beside them are timed again behind a device hold
(the ".queued" figures; `HardwareProfile.as_queued`, the launch report's later layers).

Sizes are given in rows per expert (m); tokens = m x E / k with every expert holding m rows
(E = the model's experts, all on this one rank, as plan_accuracy's ep 1 launches run them).
GPU: m = 4 and 128 are DeepSeek-V3's 128 and 4096 tokens at ep 1 (plan_accuracy's shapes);
256 / 512 / 1024 are 4096 tokens per rank at ep 2 / 4 / 8 (E / ep local experts); 32 sits
between. GEMM points: at m = 128 .. 1024 the rows fill their aligned blocks and the curve's
x is the aligned rows per expert; m = 4 and 32 occupy one mostly-padded 128-row block per
expert, whose rate need not be a full block's: those points are keyed by the real rows per
expert (TFLOPS over the aligned rows' FLOPs), as the cost model looks them up below one
aligned group per expert (on one H200 the Triton GEMMs ran m = 4 at a full block's rate).
Each size: one warm-up forward, then `reps` forwards, each after a device synchronize (as
each runtime step starts; with --timing device, behind a device hold); on CUDA the routed
stages are timed again beside the shared MLP on its side stream (plan/beside.py).
"""

from __future__ import annotations

import math
import statistics

from epmoe.bench.layer_points import (LayerFits, Size, host_bound_points, kernel_points,
                                      routed_points)
from epmoe.plan.profile import QUEUED, GemmCurve, MlpCurve

ROWS_PER_EXPERT = {("cuda", False): (4, 32, 128, 256, 512, 1024),
                   ("cuda", True): (4, 128, 512),
                   ("cpu", False): (4, 16, 64), ("cpu", True): (4, 16, 64)}
GEMMS = (("gemm1", "2I", "D"), ("gemm2", "D", "I"))


def token_counts(cfg, rows_per_expert) -> list[int]:
    """Tokens that give each expert m rows under balanced routing (m x E / k, rounded up)."""
    e, k = cfg.num_experts, cfg.top_k
    return sorted({max(1, math.ceil(m * e / k)) for m in rows_per_expert})


def balanced_routing(n: int, cfg, device, seed: int = 0):
    """Routing of n tokens: token t takes experts (t k + j) mod E (distinct when k <= E), rows
    shuffled so that consecutive tokens do not share experts; weights 1 / k."""
    import torch

    from epmoe.router import Routing

    e, k = cfg.num_experts, cfg.top_k
    ids = (torch.arange(n)[:, None] * k + torch.arange(k)[None, :]) % e
    g = torch.Generator().manual_seed(seed)
    ids = ids[torch.randperm(n, generator=g)]
    return Routing(ids.to(torch.int32).to(device), torch.full((n, k), 1.0 / k, device=device))


def _stage_us(timer, reps: int) -> dict[str, float]:
    """Per stage: median call x calls per forward, in us (the run report's rule)."""
    return {s: statistics.median(v) * len(v) / reps * 1e3 for s, v in timer.collect().items()
            if v}


def _forward_stages(layer, x, routing, dev, reps: int, overlapped: bool,
                    hold=None) -> dict[str, float]:
    """Stage times of `reps` forwards, and "forward": the median whole forward (us). Each
    forward is one layer of a runtime step (runtime.run_layer: the pre-norm and the residual
    add around it, stages "norm" and "residual"). hold (a `DeviceSleep`, device timing): the
    GPU is held while the host issues each forward, as `--timing device` runs a step
    (runtime.py's HOLD_* rule), so events time GPU work only."""
    import time

    import torch

    from epmoe.runtime import HOLD_FACTOR, HOLD_MAX_MS, run_layer

    layer.overlap_shared = overlapped
    timer = layer.timer
    t0 = time.perf_counter()
    run_layer(layer, x, routing)  # warm-up (compiles at a new shape)
    issue_ms = (time.perf_counter() - t0) * 1e3
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    timer.collect()
    timer.reset()
    whole, issued = [], []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            if hold is not None:
                hold.hold(min(HOLD_MAX_MS, HOLD_FACTOR * issue_ms))
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            run_layer(layer, x, routing)
            issued.append((time.perf_counter() - t0) * 1e3)
            issue_ms = min(issue_ms, issued[-1])
            b.record()
            b.synchronize()
            whole.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            run_layer(layer, x, routing)
            whole.append((time.perf_counter() - t0) * 1e6)
            issued.append(whole[-1] / 1e3)  # the CPU's forward is all host
    out = _stage_us(timer, reps)
    out["forward"] = statistics.median(whole)
    out["issue"] = statistics.median(issued) * 1e3  # the host's issue of a whole forward
    timer.reset()
    return out


def _build(model: str, quant, experts: str, tokens: int, dev):
    """A one-layer Runtime at ep 1 -> (its layer, the experts backend it really built). A
    model whose first layers route by token id (DeepSeek-V4) is timed as its scoring layers
    (the same experts; its router the top-k one, which the hash layers' lookup undercuts)."""
    from epmoe.config import get_preset
    from epmoe.plan.run import RunConfig
    from epmoe.runtime import Runtime

    plain = (("hash_layers", ()), ("vocab_size", 0)) if get_preset(model).hash_layers else ()
    run = RunConfig(model=model, quant=quant, experts=experts, tokens=tokens, layers=1,
                    steps=1, check=False, model_overrides=plain)
    rt = Runtime(run, device=dev)
    layer = rt.layers[0]
    return rt, layer, layer.experts.name


def _build_fitting(model: str, cfg, quant, experts: str, ns: list[int], dev, clock):
    """`_build` for the largest of the sizes `ns` that fits the device's memory (an 80 GB GPU
    does not hold DeepSeek-V3's largest calibration size in every backend), then a warm-up
    forward at the middle size (Triton's autotuner picks its config at the first call): on
    out-of-memory in either, the largest size is dropped (named in clock.skipped) and both
    are tried again; -> (rt, layer, built, the sizes kept). Raises when even the smallest
    size does not fit."""
    import gc

    import torch

    from epmoe.memory import DoesNotFit

    for keep in range(len(ns), 0, -1):
        if dev.type == "cuda":  # what an earlier backend built (or failed to) goes first
            gc.collect()
            torch.cuda.empty_cache()
        try:
            rt, layer, built = _build(model, quant, experts, ns[keep - 1], dev)
            mid = ns[:keep][keep // 2]
            x_mid = torch.randn(mid, cfg.hidden, device=dev, dtype=torch.bfloat16)
            layer.forward(x_mid, balanced_routing(mid, cfg, dev))
            return rt, layer, built, ns[:keep]
        except (torch.cuda.OutOfMemoryError, DoesNotFit):  # the real thing, or the Runtime's
            rt = layer = None  # floor on it (epmoe.memory)
            if keep == 1 or clock.left() < 0:
                raise
            clock.skipped.append(f"{experts}/{quant.recipe} tokens>={ns[keep - 1]}: out of "
                                 f"device memory")
    raise ValueError("no calibration sizes")


def measure_layer(model: str, cfg, quant, experts: str, dev, clock, fits: LayerFits,
                  quick: bool, reps: int, timing: str = "launched",
                  beside_shared: bool | None = None) -> None:
    """Times one (experts backend, recipe) and adds its curves and points to `fits`
    (timing "device": every forward behind a device hold, the GPU's time only).
    beside_shared: also time the routed stages with the shared MLP on its side stream (the
    ".overlapped" fits); default on CUDA when the model has shared experts."""
    import torch

    from epmoe.timing import DeviceSleep, host_op_us

    kind = dev.type
    ns = token_counts(cfg, ROWS_PER_EXPERT[(kind, quick)])
    rt, layer, built, ns = _build_fitting(model, cfg, quant, experts, ns, dev, clock)
    hold = DeviceSleep(dev) if timing == "device" and kind == "cuda" else None
    if built != experts:
        raise RuntimeError(f"asked for experts {experts!r}, the runtime built {built!r}")
    e, d, inter = cfg.num_experts, cfg.hidden, cfg.moe_intermediate
    align = layer.experts.alignment
    recipe = "bf16" if experts == "torch" else quant.recipe
    what = (f"{experts} experts, {quant.recipe}, {cfg.name} at ep 1 (E={e}, D={d}, I={inter}), "
            f"MoELayer.forward stages ({timing} timing), balanced routing")
    if beside_shared is None:
        beside_shared = kind == "cuda"
    modes = (False, True) if beside_shared and layer.shared_experts is not None else (False,)
    gemm = {(g, side): {} for g, _, _ in GEMMS for side in modes}
    shared = {(m, False): [] for m in modes}  # (overlapped, queued) -> points
    # launched timing on CUDA: the host-bound stages again behind a device hold, as a
    # stack's later layers see them (queued behind the layer before; HardwareProfile.as_queued)
    queue = DeviceSleep(dev) if timing == "launched" and kind == "cuda" else None
    if queue is not None:
        shared[(modes[-1], True)] = []
    for n in ns:
        if clock.left() < 0:
            clock.skipped.append(f"{experts}/{quant.recipe} tokens>={n}: time budget")
            break
        try:
            x = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
            routing = balanced_routing(n, cfg, dev)
            size = Size.of(routing.topk_ids_TK, e, align, experts)
            # the routed stages alone, then (CUDA, a shared MLP) beside the shared MLP on its side
            # stream, as a launch runs them by default: contention slows what overlaps it
            for side in modes:
                st = _forward_stages(layer, x, routing, dev, reps, side, hold)
                if not side and st.get("shared"):
                    shared[(False, False)].append((float(n), st["shared"]))
                routed_points(fits, gemm, st, size, cfg, quant, experts, recipe, side)
            # the stages a launch's host and queue shape (small GPU work behind the router's):
            # timed in forwards that run the layer's own router, as a launch does by default;
            # so is the shared MLP on its side stream: what it overlaps is the launch's path
            for q in (False, True) if queue is not None else (False,):
                st = _forward_stages(layer, x, None, dev, reps, modes[-1], queue if q else hold)
                if modes[-1] and st.get("shared"):
                    shared[(True, q)].append((float(n), st["shared"]))
                host_bound_points(fits, st, n, cfg, quant, experts, modes[-1], q)
                if q:  # the routed stages too, as a later layer runs them (the router's rows)
                    size_r = Size.of(layer.last_routing.topk_ids_TK, e, align, experts)
                    kernel_points(fits, st, size_r, cfg, quant, experts, recipe, QUEUED)
            # the host's speed as it issued these forwards (hosts drift within a machine's lease;
            # the issue time's fit and the profile's host_op_us must come from the same host)
            fits.host_op_us.append(host_op_us(dev))
        except torch.cuda.OutOfMemoryError:  # what this size measured before stays
            clock.skipped.append(f"{experts}/{quant.recipe} tokens>={n}: out of device memory")
            break
    for (g, side), pts in gemm.items():
        nn, kk = (2 * inter, d) if g == "gemm1" else (d, inter)
        pts = tuple(sorted((m, t) for m, (_, t) in pts.items()))
        if pts:
            beside = ", beside the shared MLP on its side stream" if side else ""
            fits.gemm.append(GemmCurve(experts, recipe, "contiguous", nn, kk, pts, clock.prov(
                f"{what}, aligned rows per expert (real rows below one aligned group)"
                f"{beside}"), side))
    width = cfg.shared_intermediate
    for (overlapped, queued), pts in shared.items():
        if pts:
            side = "on its side stream with the routed path running" if overlapped \
                else "alone (overlap_shared off)"
            side += ", behind a device hold (queued)" if queued else ""
            fits.mlp.append(MlpCurve(experts, recipe, width, d, overlapped, tuple(sorted(pts)),
                                     clock.prov(f"{what}: the shared stage {side}"), queued))
    del layer, rt
    if kind == "cuda":
        torch.cuda.empty_cache()
