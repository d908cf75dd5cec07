"""Comm backends behind one contract (`epmoe.comm.base.Comm`), chosen by name.

| name      | tokens travel by                           | runs on         |
|-----------|--------------------------------------------|-----------------|
| local     | nothing (one rank, or tokens replicated)   | anywhere        |
| allgather | all-gather tokens+routing, reduce-scatter  | gloo, NCCL      |
| all2all   | all_to_all_single with split sizes         | gloo, NCCL      |
| deepep-ht | DeepEP high-throughput (contiguous)        | CUDA + DeepEP   |
| deepep-ll | DeepEP low-latency (masked, CUDA graphs)   | CUDA + DeepEP   |
| symm-ht   | ours: symmetric arena, rows straight into  | CUDA + nvshmem4py, one node |
|           | the contiguous layout (comm.symm)          |                 |
| symm-ll   | ours: masked, fp8 fused, CUDA graphs       | CUDA + nvshmem4py, one node |
"""

from __future__ import annotations

import importlib

from epmoe.comm.base import Batch, Comm, LayoutBatch, MaskedBatch, TokenBatch  # noqa: F401
from epmoe.comm.context import CommContext

BACKENDS = {
    "local": "epmoe.comm.local:LocalComm",
    "allgather": "epmoe.comm.allgather:AllGatherComm",
    "all2all": "epmoe.comm.all2all:All2AllComm",
    "deepep-ht": "epmoe.comm.deepep:DeepEPHighThroughputComm",
    "deepep-ll": "epmoe.comm.deepep:DeepEPLowLatencyComm",
    "symm-ht": "epmoe.comm.symm.ht:SymmHighThroughputComm",
    "symm-ll": "epmoe.comm.symm.ll:SymmLowLatencyComm",
}
# what `auto` may pick from a measured table (epmoe.comm.auto), fastest first when measured
AUTO_CANDIDATES = ("symm-ll", "symm-ht", "deepep-ll", "deepep-ht", "all2all")
CHOICES = ("auto", *BACKENDS)


def backend_class(name: str) -> type[Comm]:
    if name not in BACKENDS:
        raise ValueError(f"unknown comm backend {name!r}; choose one of {', '.join(CHOICES)}")
    mod, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def _unavailable(name, run, device) -> str | None:
    try:
        cls = backend_class(name)
    except (ImportError, OSError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return cls.supports(run.cfg, run.quant, device, run.world)


def resolve_backend(name: str, run, device) -> tuple[str, str]:
    """-> (backend, one-line reason). `auto`: local when tokens do not travel; on CUDA the
    fastest available backend at this token count in the measured table (`comm.auto`), else
    the DeepEP low-latency path for small per-rank batches, high-throughput for large ones,
    else all2all (the portable reference)."""
    if run.world == 1 or run.form != "ep_dp":
        if name not in ("auto", "local"):
            raise ValueError(f"backend {name!r} moves tokens between ranks, but form "
                             f"{run.form!r} at world {run.world} replicates them: use "
                             f"--backend local/auto, or --dp with ep > 1")
        return "local", "tokens do not travel (one rank or replicated tokens)"
    if name != "auto":
        why = _unavailable(name, run, device)
        if why is not None:
            raise ValueError(f"backend {name!r} cannot run here: {why}")
        return name, "requested"
    tried = []
    if getattr(device, "type", str(device)) == "cuda":
        from epmoe.comm.auto import load_table, pick

        table = load_table()
        ok = [n for n in AUTO_CANDIDATES if _unavailable(n, run, device) is None]
        chosen = pick(ok, run.quant.recipe, run.world, run.tokens, table)
        if chosen is not None:
            return chosen
        tried.append("no measured table for this world/recipe/token count" if table else
                     "no measured table (python -m epmoe.bench.comm --auto-table)")
        ll_max = run.ll_max_tokens
        first = "deepep-ll" if run.tokens <= ll_max else "deepep-ht"
        why = _unavailable(first, run, device)
        if why is None:
            return first, (f"auto: {first} ({run.tokens} tokens/rank vs LL threshold {ll_max}; "
                           f"{tried[0]})")
        tried.append(f"{first}: {why}")
    why = _unavailable("all2all", run, device)
    assert why is None, why
    return "all2all", "auto: all2all" + (f" ({'; '.join(tried)})" if tried else "")


SYMM = ("symm-ht", "symm-ll")  # ours: tuned by SymmOptions


def make_comm(name: str, cfg, quant, expert_map_E, ctx: CommContext | None = None,
              options=None) -> Comm:
    """The backend `name` for one layer on this rank; `ctx` is the rank's shared context (a
    one-rank CPU context when None); `options`: a symm backend's SymmOptions (None: its
    defaults; the other backends take none)."""
    kw = {"options": options} if options is not None and name in SYMM else {}
    return backend_class(name)(cfg, quant, expert_map_E, ctx, **kw)
