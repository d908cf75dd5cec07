"""A run's recorded routing, for the planner: `python -m epmoe.plan --routing FILE`.

FILE is a launch summary (`python -m epmoe.launch ... --out FILE`): its
`load.tokens_per_layer_expert` holds the (token, k) pairs each layer sent to each logical
expert over the run; an EPLB run's (`--eplb`) also holds the placement it ended with,
`eplb.final_phy2log_LR` (each physical slot's logical expert, per layer). The planner then
prices every layer at its own load (popularity: the hottest rank's rows and the experts hit
follow it) and, with a placement, at the replicas that placement gives (the hottest rank
after replication, the bytes per link). A bare JSON list of per-layer loads (or one load for
every layer) is read too, and so is a routing trace (`trace:FILE` or a .pt / .safetensors
FILE: `epmoe.eplb.routing.save_trace`'s [steps, layers, tokens, top_k] ids, what a launch
replays with `--routing trace:FILE`): its selections per layer over all its steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RecordedRouting:
    """loads_LE: per layer, per logical expert; phy2log_LR: the EPLB placement, or None."""

    source: str
    loads_LE: tuple
    phy2log_LR: tuple | None = None

    @property
    def layers(self) -> int:
        return len(self.loads_LE)

    @property
    def num_experts(self) -> int:
        return len(self.loads_LE[0])

    @property
    def redundant_experts(self) -> int:
        return 0 if self.phy2log_LR is None else len(self.phy2log_LR[0]) - self.num_experts

    def fitted(self, num_experts: int, layers: int, where: str, model: str = "the model",
               fix: str = "") -> tuple:
        """The loads per layer for a stack of `layers` layers of `num_experts` experts (one
        recorded layer stands for every layer); ValueError naming the mismatch (where: who
        named the file; fix: what the user can do about a layer count that differs)."""
        if self.num_experts != num_experts:
            raise ValueError(f"{where}: {self.num_experts} experts recorded, {model} has "
                             f"{num_experts}")
        if self.layers not in (1, layers):
            raise ValueError(f"{where}: {self.layers} recorded layers for a stack of {layers} "
                             f"MoE layers: {fix or 'record the whole stack or one layer'}")
        return self.loads_LE * (1 if self.layers == layers else layers)

    def describe(self) -> str:
        extra = f", its EPLB placement ({self.redundant_experts} redundant slots)" \
            if self.phy2log_LR is not None else ""
        return f"recorded load of {self.layers} layer(s) from {self.source}{extra}"


TRACE_SUFFIXES = (".pt", ".safetensors")


def is_recorded(spec: str) -> bool:
    """A --routing value naming a file (uniform and zipf:S are specs)."""
    return spec.startswith("trace:") or spec.endswith((".json",) + TRACE_SUFFIXES) or \
        Path(spec).is_file()


def read_recorded(path: str, what: str = "--routing",
                  num_experts: int | None = None) -> RecordedRouting:
    """The file's loads (and placement); ValueError naming what is wrong with it (each
    message starts with `what` and the path: the flag or key that named the file).
    num_experts: a trace's expert count (its ids do not say; default: its largest id + 1)."""
    path = path.removeprefix("trace:")
    p = Path(path)
    if p.suffix in TRACE_SUFFIXES:
        return _read_trace(p, f"{what} {path}", num_experts)
    try:
        doc = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path}: not JSON ({exc.msg} at line {exc.lineno})") \
            from None
    placement = None
    if isinstance(doc, dict):
        loads = (doc.get("load") or {}).get("tokens_per_layer_expert")
        if loads is None:
            raise ValueError(f"{what} {path}: no load.tokens_per_layer_expert (a launch "
                             f"summary, python -m epmoe.launch --out FILE, records it)")
        placement = (doc.get("eplb") or {}).get("final_phy2log_LR")
    else:
        loads = doc
    if loads and all(isinstance(x, (int, float)) for x in loads):
        loads = [loads]  # one load for every layer
    loads_LE = _rows(loads, f"{what} {path}", "loads", float)
    if any(x < 0 or not math.isfinite(x) for row in loads_LE for x in row) or \
            any(sum(row) <= 0 for row in loads_LE):
        raise ValueError(f"{what} {path}: every load must be finite and >= 0, and each "
                         f"layer's must sum to > 0")
    e = len(loads_LE[0])
    if any(len(row) != e for row in loads_LE):
        raise ValueError(f"{what} {path}: the layers' loads have different expert counts")
    phy2log = None
    if placement is not None:
        phy2log = _rows(placement, f"{what} {path}", "eplb.final_phy2log_LR", int)
        if len(phy2log) != len(loads_LE) or any(
                sorted(set(row)) != list(range(e)) for row in phy2log):
            raise ValueError(f"{what} {path}: eplb.final_phy2log_LR must hold every one of "
                             f"the {e} experts in each of the {len(loads_LE)} layers")
    return RecordedRouting(p.name, loads_LE, phy2log)


def _read_trace(p: Path, where: str, num_experts: int | None) -> RecordedRouting:
    from epmoe.eplb.routing import load_trace, trace_loads

    try:
        t = load_trace(p)  # [S, L, T, K]
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not t.numel():
        raise ValueError(f"{where}: the trace holds no selections")
    e = num_experts if num_experts is not None else int(t.max()) + 1
    if int(t.min()) < 0 or int(t.max()) >= e:
        raise ValueError(f"{where}: the trace's expert ids span [{int(t.min())}, "
                         f"{int(t.max())}], outside [0, {e}) for {e} experts")
    loads = tuple(tuple(row) for row in trace_loads(t, e).tolist())
    return RecordedRouting(p.name, loads)


def _rows(x, where: str, what: str, kind) -> tuple:
    if not isinstance(x, list) or not x or not all(isinstance(r, list) and r for r in x):
        raise ValueError(f"{where}: {what} must be a non-empty list of per-layer "
                         f"lists")
    try:
        return tuple(tuple(kind(v) for v in r) for r in x)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {what} holds a value that is not a number") \
            from None
