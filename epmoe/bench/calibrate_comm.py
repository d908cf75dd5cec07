"""The multi-rank part of `python -m epmoe.bench.calibrate`: collectives and comm backends,
measured on `world` spawned ranks of this machine (gloo on CPU, NCCL on GPUs).

Collectives: all_gather / reduce_scatter / all_reduce / all_to_all at a few sizes -> alpha-
beta on the bytes each rank moves over its link (comm_cost.collective_us's counts).
Backends (through epmoe.comm, the runtime's classes): dispatch and combine stage times at a few
token counts with uniform routing. NCCL backends: the measured time minus this model's
prediction is their fixed extra cost; DeepEP: the time minus the modelled non-kernel terms,
fitted alpha-beta against the modelled bottleneck bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time

from epmoe.outputs import dump_json
from epmoe.plan.profile import HardwareProfile, LinkFit
from epmoe.plan.topology import LINK_SPECS

SIZES = {("cpu", True): (1 << 14, 1 << 20), ("cpu", False): (1 << 14, 1 << 18, 1 << 22),
         ("cuda", True): (1 << 20, 1 << 26), ("cuda", False): (1 << 18, 1 << 22, 1 << 26,
                                                               1 << 28)}
TOKENS = {("cpu", True): (16, 64), ("cpu", False): (16, 64, 256),
          ("cuda", True): (256, 4096), ("cuda", False): (128, 1024, 4096)}
LL_TOKENS = (32, 128)
TIMEOUT_S = 240.0


# ------------------------------------------------------------------------------ on each rank
def _make_comm(name, cfg, quant, expert_map, group, rank, world, tokens, device):
    """The runtime's comm class with its own context -> (comm, context to close)."""
    from epmoe.comm import CommContext, make_comm

    ctx = CommContext(group, rank, world, device, max_tokens_per_rank=tokens)
    return make_comm(name, cfg, quant, expert_map, ctx), ctx


def _once(fn, dev) -> tuple[float, object]:
    """One call of fn on every rank at once: barrier, synchronize, time."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    r = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return (time.perf_counter() - t) * 1e6, r


def _timed(fn, dev, reps):
    """Median of reps calls after one warm-up call -> (us, last result)."""
    out, r = [], None
    for i in range(reps + 1):
        us, r = _once(fn, dev)
        if i:
            out.append(us)
    return statistics.median(out), r


def _max(x: float, dev) -> float:
    """The slowest rank's figure."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64 if dev.type == "cpu" else torch.float32,
                     device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _collectives(world, dev, sizes, reps):
    import torch
    import torch.distributed as dist

    from epmoe.comm.wire import all_gather_single, reduce_scatter_single

    out = {k: [] for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    for n in sizes:
        a = torch.ones(n // 4, dtype=torch.float32, device=dev)
        big = torch.ones(world * (n // 4), dtype=torch.float32, device=dev)
        big2 = torch.empty_like(big)
        calls = {"all_gather": lambda: all_gather_single(big, a),
                 "reduce_scatter": lambda: reduce_scatter_single(a, big),
                 "all_reduce": lambda: dist.all_reduce(big),
                 "all_to_all": lambda: dist.all_to_all_single(big2, big)}
        for k, fn in calls.items():
            us, _ = _timed(fn, dev, reps)
            nbytes = n if k in ("all_gather", "reduce_scatter") else world * (n // 4) * 4
            out[k].append((nbytes, _max(us, dev)))
    return out


def _backends(rank, world, dev, cfg, quick, reps):
    import torch
    import torch.distributed as dist

    from epmoe.comm import TokenBatch
    from epmoe.comm.base import rows_shape
    from epmoe.config import QuantConfig

    quant = QuantConfig("fp8_block" if dev.type == "cuda" else "bf16")
    per = cfg.num_experts // world
    emap = torch.full((cfg.num_experts,), -1, dtype=torch.int32)
    emap[rank * per:(rank + 1) * per] = torch.arange(per, dtype=torch.int32)
    names = ["all2all", "allgather"]
    if dev.type == "cuda":
        names += ["deepep-ht", "deepep-ll"]
    out, notes = {}, {}
    for name in names:
        tokens = LL_TOKENS if name == "deepep-ll" else TOKENS[(dev.type, quick)]
        try:
            comm, ctx = _make_comm(name, cfg, quant, emap.to(dev), dist.group.WORLD, rank,
                                   world, max(tokens), dev)
        except (ImportError, OSError, RuntimeError, ValueError, TypeError) as exc:
            notes[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        res = {"dispatch": [], "combine": []}
        for t in tokens:
            g = torch.Generator().manual_seed(rank * 1000 + t)
            ids = torch.rand(t, cfg.num_experts, generator=g).topk(cfg.top_k).indices
            ids = ids.to(torch.int32).to(dev)
            w = torch.full((t, cfg.top_k), 1.0 / cfg.top_k, device=dev)
            x = torch.randn(t, cfg.hidden, generator=g).to(torch.bfloat16).to(dev)
            # fresh routing tensors per call: no backend may reuse a cached layout (a step's
            # routing is new every step)
            d_us, (batch, _) = _timed(lambda: comm.dispatch(x, ids.clone(), w.clone()), dev,
                                      reps)
            y = torch.zeros((*rows_shape(batch), cfg.hidden), device=dev,
                            dtype=torch.float32 if isinstance(batch, TokenBatch)
                            else torch.bfloat16)
            c_us = []
            for i in range(reps + 1):  # a fresh handle per combine
                _, handle = comm.dispatch(x, ids.clone(), w.clone())
                us, _ = _once(lambda: comm.combine(y, handle), dev)
                if i:
                    c_us.append(us)
            res["dispatch"].append((t, _max(d_us, dev)))
            res["combine"].append((t, _max(statistics.median(c_us), dev)))
        out[name] = res
        ctx.close()
    return out, notes


def _rank_main(rank, world, port, kind, cfg, quick, path):
    import torch
    import torch.distributed as dist

    from epmoe.env import SAFETY_ENV

    os.environ.update(SAFETY_ENV)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if kind == "cuda":
        from epmoe.env import use_single_node_nvshmem

        use_single_node_nvshmem()  # as the Runtime does, before DeepEP LL starts NVSHMEM
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    try:
        reps = 3 if quick else 10
        res = {"collectives": _collectives(world, dev, SIZES[(kind, quick)], reps)}
        res["backends"], res["notes"] = _backends(rank, world, dev, cfg, quick, reps)
        if rank == 0:
            with open(path, "w") as f:
                dump_json(res, f)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ in the parent
def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(world: int, kind: str, cfg, quick: bool, timeout_s: float) -> dict:
    """Run _rank_main on `world` spawned processes; rank 0's results. Never hangs: ranks
    still running after timeout_s are killed."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "comm.json")
        ctx = mp.start_processes(_rank_main, args=(world, _free_port(), kind, cfg, quick,
                                                   path), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"comm calibration ranks did not finish in "
                                       f"{timeout_s:.0f} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        with open(path) as f:
            return json.load(f)


def _linkfit(points, link_bytes, link_GBps, prov) -> LinkFit:
    from epmoe.bench.calibrate import fit_ab

    alpha, beta = fit_ab([(link_bytes(n), us) for n, us in points])
    return LinkFit(alpha, beta, link_GBps, prov)


def calibrate_comm(prof: HardwareProfile, world: int, kind: str, cfg, quick: bool,
                   clock) -> HardwareProfile:
    """The profile with this machine's collectives and comm backends (one node)."""
    try:
        raw = _spawn(world, kind, cfg, quick, min(TIMEOUT_S, max(clock.left(), 30.0)))
    except (RuntimeError, OSError, FileNotFoundError) as exc:
        clock.skipped.append(f"comm: {exc}")
        return prof
    cls = "nvlink" if kind == "cuda" else "tcp"
    spec = LINK_SPECS.get(prof.gpu, {}).get(cls)
    link = spec.GBps if spec else 1.0
    g = world
    per_link = {"all_gather": lambda n: (g - 1) * n, "reduce_scatter": lambda n: (g - 1) * n,
                "all_reduce": lambda n: 2 * (g - 1) * n / g,
                "all_to_all": lambda n: (g - 1) * n / g}
    coll = {k: dict(v) for k, v in prof.collectives.items()}
    for k, pts in raw["collectives"].items():
        coll.setdefault(k, {})[cls] = _linkfit(pts, per_link[k], link, clock.prov(
            f"{k} on {world} ranks, bytes each rank moves over its link"))
    prof = dataclasses.replace(prof, collectives=coll)
    for name, why in raw.get("notes", {}).items():
        clock.skipped.append(f"{name}: {why}")
    comm = {b: {l: dict(t) for l, t in lt.items()} for b, lt in prof.comm.items()}
    for name, res in raw["backends"].items():
        comm.setdefault(name, {})[cls] = _fit_backend(prof, name, res, world, kind, cfg, clock,
                                                      cls, link)
        prof = dataclasses.replace(prof, comm=comm)
    return prof


def _fit_backend(prof, name, res, world, kind, cfg, clock, cls, link) -> dict:
    from epmoe.bench.calibrate import fit_ab
    from epmoe.config import QuantConfig
    from epmoe.plan.comm_cost import NCCL_CALLS, CommCase, combine_cost, dispatch_cost
    from epmoe.plan.routing import RoutingSpec, routing_stats
    from epmoe.plan.topology import Topology

    quant = QuantConfig("fp8_block" if kind == "cuda" else "bf16")
    topo = Topology(1, world, prof.gpu, cls)
    stats = routing_stats(cfg.replace(n_group=1, topk_group=1), RoutingSpec(), world, world)
    old = prof.comm.get(name, {}).get(cls, {})
    out = {}
    for direction, cost_fn in (("dispatch", dispatch_cost), ("combine", combine_cost)):
        what = clock.prov(f"epmoe {name} {direction} on {world} ranks, tokens "
                          f"{[t for t, _ in res[direction]]}")
        if name in NCCL_CALLS:  # fixed extra cost beyond the modelled NCCL calls and copies
            base = dataclasses.replace(prof, comm={**prof.comm, name: {}})
            extra = [us - cost_fn(name, CommCase(cfg, quant, topo, base, stats, t, t)).us
                     for t, us in res[direction]]
            out[direction] = LinkFit(max(statistics.median(extra), 0.0), 1.0, link, what)
            continue
        if direction not in old:
            continue
        f = old[direction]
        sm_driven = f.per_sm_GBps is not None and f.sms
        # SM-driven: the fit is the SM-limited rate over every row the SMs copy (own rows too)
        key = f"{direction}.sm_bytes" if sm_driven else f"{direction}.{cls}_bytes"
        pts = []
        for t, us in res[direction]:
            c = cost_fn(name, CommCase(cfg, quant, topo, prof, stats, t, t))
            pts.append((c.notes.get(key, 0.0), us - (c.us - c.kernel_us)))
        alpha, beta = fit_ab(pts)
        if sm_driven:
            out[direction] = dataclasses.replace(f, alpha_us=alpha, per_sm_GBps=beta / f.sms,
                                                 prov=what)
        else:
            out[direction] = dataclasses.replace(f, alpha_us=alpha,
                                                 beta_GBps=beta * f.link_GBps / link, prov=what)
    return out
