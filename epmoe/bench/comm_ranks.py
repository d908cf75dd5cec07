"""Real ranks for `python -m epmoe.bench.comm`: every backend on the same inputs, one GPU per
rank (NCCL), or gloo ranks on CPU (the portable backends: a check of this harness).

A job is one spawned world (`epmoe.ranks.run_ranks`) that runs some backends, one after
another, at one recipe and one mode's token counts. NVSHMEM has one owner per process, so the
backends that start it themselves (deepep-ll) and ours (symm-*) never share a job; HT and LL
sizes are separate jobs (their buffers are sized for the job's largest token count). Each rank
draws the same tokens and routing for every backend (seeded by rank and token count), so every
row of a (recipe, tokens) measures the same problem.

Per case: a warm-up dispatch + combine through identity experts (each expert returns its
rows; TokenBatch experts weight them by their tokens' local top-k weights), checked against
x (as the wire recipe quantizes it) x sum_k w_k within the recipe's tolerance, then `iters`
timed dispatch / combine pairs after a barrier. Timing "device" (the default): the GPU's time,
as DeepEP's own tests report it: a ~1 ms device sleep lets the host enqueue the pair behind it
and a one-element NCCL all-reduce right before the first event lines the ranks' GPUs up, so
neither the host's launch time nor the ranks' host skew is counted; "launched": the pair
issued on an idle GPU, the host's launch time included (what an eager step without CUDA graphs
sees). A phase's time per iteration is its slowest rank's; the row reports the median.
The round trip's reference quantizes x as the backend's wire does: ours (epmoe.quant) for
every backend but deepep-ll, whose kernel quantizes fp8 with its own arithmetic (x * (448 /
amax), scale amax * (1 / 448), each an IEEE fp32 operation: a code can differ from ours where
the two roundings part).
Traffic: rows a rank sends, averaged over ranks (each token once per destination rank for HT,
once per (token, k) for LL), all of them and only those that cross to another rank.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

HT_BACKENDS = ("all2all", "deepep-ht", "symm-ht")
LL_BACKENDS = ("all2all", "deepep-ll", "symm-ll")
NVSHMEM_OWNERS = ("deepep-ll", "symm-ht", "symm-ll")  # who initializes NVSHMEM in a process
WARMUP = 3
DEEPEP_SMS = 24  # deepep-ht's SMs unless --num-sms says (DeepEP's README figures: 24)
TIMINGS = ("device", "launched")
SLEEP_CYCLES = 2_000_000  # ~1 ms at an H200's ~2 GHz: longer than the host takes to issue a pair


@dataclass(frozen=True)
class RankJob:
    """One spawned world: `backends` in turn at `recipe`, for each of `tokens` per rank."""

    mode: str  # ht | ll
    backends: tuple[str, ...]
    recipe: str
    tokens: tuple[int, ...]
    world: int
    device: str  # cuda (one GPU per rank, NCCL) | cuda-shared (every rank on cuda:0, gloo;
    # symm-* only: the real-rank path on one GPU, time-sliced) | cpu (gloo)
    iters: int
    hidden: int
    num_experts: int
    top_k: int
    num_sms: int  # symm-*: SymmOptions.num_sms (0: theirs); deepep-ht: Buffer.set_num_sms
    # (0: DEEPEP_SMS)
    timing: str = "device"  # device | launched (the module's docstring)
    knobs: tuple[tuple[str, int], ...] = ()  # symm-*: SymmOptions knobs of bench.comm's
    # --sweep ((name, value) pairs; 0: the default), over num_sms
    breakdown: bool = False  # CUDA: each kernel's device time (torch.profiler, 3 pairs with
    # the ranks lined up as for device timing), rank 0's; a kernel that waits for a peer
    # counts the wait, and symm-ht's send and receive launches share one kernel name

    @property
    def label(self) -> str:
        """The knobs set away from their defaults, "name=value ..." ("" if none)."""
        return " ".join(f"{k}={v}" for k, v in self.knobs if v)

    def __post_init__(self):
        if self.mode not in ("ht", "ll"):
            raise ValueError(f"mode ({self.mode!r}) must be ht or ll")
        if self.device not in ("cuda", "cuda-shared", "cpu"):
            raise ValueError(f"device ({self.device!r}) must be cuda, cuda-shared or cpu")
        theirs = [b for b in self.backends if not b.startswith("symm")]
        if self.device == "cuda-shared" and theirs:
            raise ValueError(f"backends {theirs} need one GPU per rank; ranks sharing one GPU "
                             f"run symm-* only")
        owners = [b for b in self.backends if b in NVSHMEM_OWNERS]
        if "deepep-ll" in owners and len(owners) > 1:
            raise ValueError(f"backends {owners} each start NVSHMEM: they need separate jobs")
        if self.timing not in TIMINGS:
            raise ValueError(f"timing ({self.timing!r}) must be one of {TIMINGS}")
        if self.num_experts % self.world:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by the ranks "
                             f"({self.world})")


def plan_jobs(backends, mode: str, recipes, tokens, **kw) -> list[RankJob]:
    """The jobs that run `backends` of `mode`: symm-* in a job of their own, the rest
    together, per recipe."""
    ours = tuple(b for b in backends if b.startswith("symm"))
    rest = tuple(b for b in backends if not b.startswith("symm"))
    return [RankJob(mode, group, r, tuple(tokens), **kw) for r in recipes
            for group in (rest, ours) if group]


def _inputs(t: int, job: RankJob, rank: int, device):
    import torch

    gen = torch.Generator().manual_seed(7919 * rank + t)
    x = torch.randn(t, job.hidden, generator=gen).to(torch.bfloat16)
    ids = torch.rand(t, job.num_experts, generator=gen).topk(job.top_k, dim=1).indices
    w = torch.rand(t, job.top_k, generator=gen) + 0.1
    return x.to(device), ids.to(torch.int32).to(device), w.to(device)


def identity_experts(batch):
    """Each expert returns its own rows (as the batch type's contract asks: TokenBatch rows
    weighted by the token's local top-k weights, fp32; the others unweighted bf16)."""
    import torch

    from epmoe.comm.base import TokenBatch
    from epmoe.quant import dequantize_act

    if isinstance(batch, TokenBatch):
        local = (batch.topk_ids_NK >= 0).float()
        return dequantize_act(batch.x) * (batch.topk_weights_NK.float() * local).sum(
            1, keepdim=True)
    return dequantize_act(batch.copied()).to(torch.bfloat16)


def wire_reference(x, backend: str, quant):
    """x as `backend`'s wire carries it, dequantized to fp32 (DeepEP's low-latency fp8 kernel
    with fp32 scales quantizes by its own arithmetic, csrc/kernels/utils.cuh
    calculate_fp8_scales; everything else by epmoe.quant's)."""
    import torch

    from epmoe.kernels.quantize import quantize_tokens
    from epmoe.quant import FP8_DTYPE, FP8_MAX, dequantize_act

    if backend == "deepep-ll" and quant.recipe == "fp8_block" and quant.scale_fmt == "fp32":
        # on the CPU in fp32: each step rounded once, as the kernel's IEEE operations are
        xg = x.detach().cpu().float().unflatten(-1, (-1, 128))
        amax = xg.abs().amax(-1, keepdim=True).clamp(min=1e-4)
        # 448 / amax as a division of two tensors: torch computes `448.0 / amax` (a Python
        # number over a tensor) as amax.reciprocal() * 448, an ulp away from the kernel's
        # division in about a quarter of the groups; with that scale a few codes per row
        # came out one fp8 step off (BENCHMARKS.md 20: taken for a DeepEP bug until then)
        scale = torch.full_like(amax, FP8_MAX) / amax
        codes = (xg * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        inv = torch.tensor(1 / FP8_MAX, dtype=torch.float32)
        return (codes.float() * (amax * inv)).flatten(-2).to(x.device)
    return dequantize_act(quantize_tokens(x, quant)).float()


def sends_once_per_rank(comm) -> bool:
    """An LL backend that sends a token once per destination rank (symm-ll with ll_dedup: the
    receiver fills its experts' rows); the others send one row per (token, expert)."""
    return bool(getattr(getattr(comm, "options", None), "ll_dedup", False))


def sent_rows(ids, world: int, num_experts: int, rank: int, ll: bool,
              dedup_link: bool = False) -> tuple[int, int]:
    """Rows `rank` sends for routing `ids` (experts in contiguous blocks per rank): (all, its
    own included; only those to other ranks). HT: a token once per destination rank; LL: once
    per (token, k) (DeepEP's convention), except the link rows of a backend that sends a token
    once per rank (`dedup_link`: what crosses)."""
    owner = ids.long().cpu() // (num_experts // world)
    all_rows = link = 0
    for d in range(world):
        hit = owner == d
        n = int(hit.sum()) if ll else int(hit.any(1).sum())
        all_rows += n
        if d != rank:
            link += int(hit.any(1).sum()) if dedup_link else n
    return all_rows, link


def rank_device(device: str, rank: int):
    """A job's device for `rank`: cuda:rank, cuda:0 when the ranks share one GPU, or the CPU."""
    import torch

    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank if device == "cuda" else 0)


def _kwargs(name: str, job: RankJob) -> dict:
    if name.startswith("symm"):
        from epmoe.bench.comm_loopback import _options

        return {"options": _options({"num_sms": job.num_sms, **dict(job.knobs)})}
    if name == "deepep-ht":
        return {"num_sms": job.num_sms or DEEPEP_SMS}
    return {}


def bench_rank(rank: int, world: int, group, job: RankJob) -> list[dict]:
    """One rank of a job (a module-level function: run_ranks pickles it)."""
    import torch
    import torch.distributed as dist

    from epmoe.comm import backend_class
    from epmoe.comm.context import CommContext
    from epmoe.config import MoEConfig, QuantConfig
    from epmoe.reference import TOLERANCE, max_rel_err

    dev = rank_device(job.device, rank)
    cuda = dev.type == "cuda"
    cfg = MoEConfig("bench-comm", hidden=job.hidden, moe_intermediate=2048,
                    num_experts=job.num_experts, top_k=job.top_k)
    quant = QuantConfig(job.recipe)
    e_l = job.num_experts // world
    emap = torch.full((job.num_experts,), -1, dtype=torch.int32)
    emap[rank * e_l:(rank + 1) * e_l] = torch.arange(e_l, dtype=torch.int32)
    ctx = CommContext(group, rank, world, dev, max_tokens_per_rank=max(job.tokens))
    align = torch.zeros(1, device=dev)  # device timing: the all-reduce that lines the GPUs up
    out = []

    def clock():
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def line_up(device_timing: bool) -> None:
        """Before a timed pair: a barrier; with device timing a ~1 ms device sleep (the host
        gets ahead) and a one-element all-reduce (the ranks' GPUs start the pair together)."""
        dist.barrier(group=group)
        if cuda:
            torch.cuda.synchronize(dev)
            if device_timing:
                torch.cuda._sleep(SLEEP_CYCLES)
                if job.device == "cuda":  # (ranks sharing a GPU: gloo, no align)
                    dist.all_reduce(align, group=group)

    def us(a, b) -> float:
        return a.elapsed_time(b) * 1e3 if cuda else (b - a) * 1e6

    try:
        for name in job.backends:
            cls = backend_class(name)
            why = cls.supports(cfg, quant, dev, world)
            if why is not None:
                out.append(dict(backend=name, status="skipped", error=why))
                continue
            comm = cls(cfg, quant, emap.to(dev), ctx, **_kwargs(name, job))
            for t in job.tokens:
                x, ids, w = _inputs(t, job, rank, dev)
                batch, h = comm.dispatch(x, ids, w)
                y = identity_experts(batch)
                res = comm.combine(y, h)
                ref = wire_reference(x, name, quant) * w.float().sum(1, keepdim=True)
                err = max_rel_err(res.float().cpu(), ref.cpu())
                lay = _layout_pass(batch, e_l) if cuda else None
                disp, comb, perm = [], [], []
                for it in range(WARMUP + job.iters):
                    line_up(job.timing == "device")
                    t0 = clock()
                    batch, h = comm.dispatch(x, ids, w)
                    t1 = clock()
                    if lay is not None:
                        lay(batch)
                    t1b = clock()
                    comm.combine(y, h)
                    t2 = clock()
                    if cuda:
                        torch.cuda.synchronize(dev)
                    if it >= WARMUP:
                        disp.append(us(t0, t1))
                        perm.append(us(t1, t1b))
                        comb.append(us(t1b, t2))
                comm.check_errors()
                rows, link = sent_rows(ids, world, job.num_experts, rank, job.mode == "ll",
                                       sends_once_per_rank(comm))
                kern = None
                if cuda and job.breakdown:
                    from epmoe.bench.comm_loopback import kernel_breakdown

                    def pair(c=comm):  # the ranks lined up first, as in the timed loop
                        line_up(True)
                        c.combine(y, c.dispatch(x, ids, w)[1])

                    kern = {k: v for k, v in kernel_breakdown(pair, 3, 1).items()
                            if not any(a in k.lower() for a in ("nccl", "sleep"))}
                out.append(dict(backend=name, status="ok", error=None, tokens=t,
                                dispatch_us=disp, combine_us=comb, rows=rows, link_rows=link,
                                max_rel_err=err, passed=err <= TOLERANCE[job.recipe],
                                sms=_sms(comm, job), permute_us=perm if lay else None,
                                kernels=kern))
            del comm
    finally:
        if cuda:
            torch.cuda.synchronize(dev)
        ctx.close()
    return out


def run_job(job: RankJob, timeout_s: float) -> list[dict]:
    """-> one merged row per (backend, tokens): the slowest rank per iteration, median over
    iterations; a job whose ranks fail or time out gives a failed row per backend."""
    from epmoe.ranks import RankError, RankTimeout, run_ranks

    try:
        per_rank = run_ranks(bench_rank, job.world, job, timeout=timeout_s,
                             backend="nccl" if job.device == "cuda" else "gloo")
    except (RankError, RankTimeout) as exc:
        msg = str(exc).strip().splitlines()
        why = next((ln for ln in reversed(msg) if ln.strip()), "failed")[:200]
        return [dict(backend=b, recipe=job.recipe, mode=job.mode, status="failed",
                     error=why) for b in job.backends]
    rows = []
    for i, first in enumerate(per_rank[0]):
        base = dict(backend=first["backend"], recipe=job.recipe, mode=job.mode,
                    world=job.world, knobs=job.label if first["backend"].startswith("symm")
                    else "")
        if first["status"] != "ok":
            rows.append({**base, "status": first["status"], "error": first["error"]})
            continue
        recs = [r[i] for r in per_rank]
        worst = lambda key: [max(v) for v in zip(*(r[key] for r in recs))]  # noqa: E731
        rows.append({**base, "status": "ok", "error": None, "tokens": first["tokens"],
                     "dispatch_us": statistics.median(worst("dispatch_us")),
                     "combine_us": statistics.median(worst("combine_us")),
                     "rows": statistics.mean(r["rows"] for r in recs),
                     "link_rows": statistics.mean(r["link_rows"] for r in recs),
                     "max_rel_err": max(r["max_rel_err"] for r in recs),
                     "passed": all(r["passed"] for r in recs), "sms": first["sms"],
                     "permute_us": statistics.median(worst("permute_us"))
                     if first.get("permute_us") else None, "kernels": first.get("kernels")})
    return rows


def _layout_pass(batch, num_local: int):
    """For a TokenBatch (rows per received token): the permute the runtime runs next to put
    them in the experts' contiguous layout (Triton, worst-case rows: no host sync), so the
    bench can set symm-ht's dispatch, which writes that layout itself, against DeepEP's
    dispatch plus this pass. None for batches already in a layout."""
    from epmoe.comm.base import TokenBatch

    if not isinstance(batch, TokenBatch):
        return None
    from epmoe.kernels.permute import triton_permute
    from epmoe.layout import contiguous_rows_upper_bound

    def run(b):
        n, k = b.topk_ids_NK.shape
        return triton_permute(b.x, b.topk_ids_NK, num_local, 128,
                              num_rows=contiguous_rows_upper_bound(n * k, num_local, 128))
    return run


def _sms(comm, job: RankJob) -> str | None:
    """SMs the backend's kernels take, "send/receive" for symm-* (None: NCCL decides)."""
    if hasattr(comm, "ctas"):
        return "/".join(str(n) for n in comm.ctas())
    return str(job.num_sms or DEEPEP_SMS) if comm.name == "deepep-ht" else None


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each ok row with vs_deepep_dispatch / _combine: its time over DeepEP's (deepep-ht for
    HT, deepep-ll for LL) at the same recipe and tokens, measured in the same run; symm-ht
    rows also vs_deepep_layout: its dispatch (which writes the experts' layout) over DeepEP's
    dispatch plus the permute that writes the same layout (timed in the same iterations)."""
    base = {(r["mode"], r["recipe"], r["tokens"]): r for r in rows
            if r["status"] == "ok" and r["backend"] == f"deepep-{r['mode']}"}
    out = []
    for r in rows:
        b = base.get((r.get("mode"), r.get("recipe"), r.get("tokens")))
        if r["status"] == "ok" and b is not None:
            r = {**r, "vs_deepep_dispatch": r["dispatch_us"] / b["dispatch_us"],
                 "vs_deepep_combine": r["combine_us"] / b["combine_us"]}
            if r["backend"] == "symm-ht" and b.get("permute_us"):
                r["vs_deepep_layout"] = r["dispatch_us"] / (b["dispatch_us"] + b["permute_us"])
        out.append(r)
    return out
