"""EPLB over time: a run's routing drifts, rebalances follow it a window late, and each one
pays for the weights it moves. `python -m epmoe.sim drift` (epmoe/sim/drift_cli.py).

A run of `steps` steps draws each step's routing as a launch would (epmoe.eplb.routing:
`drift:S:P` rotates a Zipf ranking every P steps; `trace:FILE` replays recorded steps) and
counts each expert's (token, k) pairs on `sample_tokens` tokens per step. Three placements are
priced by the planner's cost model, step by step, at the run's `tokens` per rank:

- none: no redundant slots (each rank holds its E / ep experts);
- eplb: `redundant_per_rank` extra slots per rank, first placed as the runtime places them
  (slot s holds expert s % E), then every `every` steps the rebalancer's own choice
  (`epmoe.eplb.incremental.next_placement`: incremental when within slack of a full
  re-placement) for the last `window` steps' load (since the last switch at most: the
  runtime's load window restarts there), applied only when the rebalancer's
  decision (`epmoe.eplb.decision.decide`: the gain until the next rebalance against the link
  time of the weights moved, at the profile's figures) says so; a sync move stalls its step,
  an async one lands ceil(move / step) steps later;
- ideal: the same slots placed for each block's own load, moved for free (what knowing the
  load is worth; not a strict bound on the step: a placement balances the pairs, not the
  fan-out).

Steps are priced in blocks of `block` steps (a block never spans a rebalance) at the block's
summed load, on `layers` of the model's MoE layers (each layer's own routing), scaled to the
whole stack. The candidate (form / backend / experts) is the planner's pick for the first
block at the placement EPLB aims at (placed for that block's load), held for the run and by
every series, as a launch holds its plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from epmoe.config import (RECIPES, QuantConfig, default_scale_fmt, fitting_recipe,
                          get_preset)
from epmoe.docfile import is_int
from epmoe.eplb.decision import decide, follows_load
from epmoe.eplb.incremental import next_placement
from epmoe.eplb.migrate import bytes_to_move
from epmoe.eplb.placement import Placement
from epmoe.eplb.policy import choose_mode, rebalance
from epmoe.eplb.rebalancer import RebalanceOptions
from epmoe.plan.comm_cost import migration_links
from epmoe.plan.cost import Candidate, Workload, predict_layer
from epmoe.plan.planner import candidates, rank_layer, rejections
from epmoe.plan.profile import load_profile
from epmoe.plan.routing import RoutingSpec, SlotMap, routing_stats
from epmoe.plan.topology import Topology, local_cores
from epmoe.plan.traffic import expert_weight_bytes
from epmoe.sim.layers import stack_layers_us, stack_pick
from epmoe.sim.sweep import parse_candidate

SERIES = ("none", "eplb", "ideal")
SLACK = RebalanceOptions().incremental_slack  # the rebalancer's default
RECOVERED_FLOOR = 0.02


@dataclass(frozen=True)
class DriftRun:
    model: str = "deepseek-v3"
    gpu: str = "h200"
    ep: int = 64
    gpus_per_node: int = 8
    tokens: int = 4096
    routing: str = "drift:1.2:100"
    steps: int = 400
    every: int = 100
    window: int = 100
    redundant_per_rank: int = 1
    migration: str = "sync"
    candidate: str | None = None
    quant: str | None = None  # None: the first of fp8_block, mxfp8, bf16 that fits the model
    layers: int = 4
    sample_tokens: int = 512
    block: int = 25
    seed: int = 0

    def check(self) -> None:
        cfg = get_preset(self.model)  # (an unknown model fails here, first)
        for key, low in (("ep", 1), ("gpus_per_node", 1), ("tokens", 1), ("steps", 1),
                         ("every", 1), ("window", 1), ("redundant_per_rank", 1), ("layers", 1),
                         ("sample_tokens", 1), ("block", 1), ("seed", 0)):
            v = getattr(self, key)
            if not is_int(v) or v < low:
                raise ValueError(f"{key} ({v!r}) must be an int >= {low}")
        if self.layers > cfg.num_moe_layers:
            raise ValueError(f"layers ({self.layers}) must be <= the model's "
                             f"{cfg.num_moe_layers} MoE layers")
        if cfg.num_experts % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide the {cfg.num_experts} experts of "
                             f"{self.model}: EPLB's slots are spread evenly over the ranks")
        if self.migration not in ("sync", "async"):
            raise ValueError(f"migration ({self.migration!r}) must be sync or async")
        if self.candidate is not None:
            _candidate(self.candidate)
        if self.quant is not None and self.quant not in RECIPES:
            raise ValueError(f"quant ({self.quant!r}) must be one of {', '.join(RECIPES)}")
        if not self.routing.startswith("trace:"):  # (a trace is read, and checked, once)
            from epmoe.eplb.routing import make_routing

            make_routing(self.routing, 1, cfg.num_experts, cfg.top_k, 1, 0, self.seed)

    def node_size(self) -> int:
        return max(d for d in range(1, min(self.gpus_per_node, self.ep) + 1) if self.ep % d == 0)


def _candidate(text: str) -> Candidate:
    c = parse_candidate(text)
    if c.form != "ep_dp":
        raise ValueError(f"candidate {text!r} must be ep_dp/backend/experts, e.g. "
                         f"ep_dp/deepep-ht/deepgemm (EPLB places the experts of an ep_dp layer)")
    return c


@dataclass(frozen=True)
class Block:
    """Steps [start, stop) at one placement per series: per series, the predicted ms of one
    step and balancedness (mean / max (token, k) pairs per rank, mean over layers)."""

    start: int
    stop: int
    step_ms: dict
    balancedness: dict


@dataclass(frozen=True)
class Event:
    """A rebalance after `step` steps: what it chose, what it would move, whether it did."""

    step: int
    kind: str
    slots: int
    moved_MB: float
    move_ms: float
    applied: bool
    lands: int  # the first step on the new placement (applied ones)
    reason: str


class _Model:
    """What pricing a block needs, built once for a run."""

    def __init__(self, run: DriftRun):
        self.run = run
        self.cfg = get_preset(run.model)
        self.prof = load_profile(run.gpu)
        recipe = run.quant or fitting_recipe(self.cfg)[0]
        self.quant = QuantConfig(recipe, default_scale_fmt(recipe, self.prof.fig("sm_arch")))
        g = run.node_size()
        cores = {"cores_per_node": local_cores()} if self.prof.gpu == "cpu" else {}
        self.topo = Topology.parse(f"{run.ep // g}x{g}", gpu=self.prof.gpu, **cores)
        E = self.cfg.num_experts
        self.num_slots = E + run.redundant_per_rank * run.ep
        self.groups = self.cfg.n_group if E % self.cfg.n_group == 0 else 1
        self.mode = choose_mode(self.cfg.n_group, self.cfg.topk_group,
                                self.topo.num_nodes).mode
        self.scale = self.cfg.num_moe_layers / run.layers  # priced layers -> the stack
        self.slot_bytes = expert_weight_bytes(1, self.cfg.hidden, self.cfg.moe_intermediate,
                                              self.quant)
        self.candidate = None

    def place(self, load_LE) -> Placement:
        return rebalance(load_LE, self.num_slots, self.groups, self.topo.num_nodes,
                         self.run.ep, self.mode)

    def price(self, load_LE: np.ndarray,
              placement: Placement | None) -> tuple[float, float, float]:
        """(ms of one step of the whole stack, mean balancedness over the priced layers, the ms
        of that step on the slowest rank in the stages that follow the load)."""
        layers, bal = [], []
        for l, load in enumerate(load_LE):
            spec = RoutingSpec.from_load(load)
            slots = None if placement is None else SlotMap.from_placement(placement, l)
            stats = routing_stats(self.cfg, spec, self.run.ep, self.topo.gpus_per_node, slots)
            work = Workload(self.cfg, self.quant, self.run.tokens, spec, slots)
            if self.candidate is None:
                self.candidate = self._pick(work, stats)
            layers.append((predict_layer(self.candidate, work, self.topo, self.prof, stats),
                           work, stats))
            pairs = np.asarray(stats.pairs_rank)
            bal.append(float(pairs.mean() / pairs.max()))
        stack = [layers[l % len(layers)] for l in range(self.cfg.num_moe_layers)]
        follows = sum(p.stages_us.get(k, 0.0) for p, _, _ in stack
                      for k in follows_load(self.candidate.backend))
        return (stack_layers_us(stack, self.topo, self.prof) / 1e3, float(np.mean(bal)),
                follows / 1e3)

    def _pick(self, work: Workload, stats) -> Candidate:
        """The planner's ep_dp pick, or the candidate given, if it is feasible here."""
        cands = [_candidate(self.run.candidate)] if self.run.candidate is not None else \
            [c for c in candidates(self.run.ep) if c.form == "ep_dp"]
        ranked = rank_layer(work, self.topo, self.prof, cands, self.cfg.num_moe_layers,
                            "model", stats=stats)
        preds = stack_pick([ranked], (0,))
        if preds is None:
            which = self.run.candidate or "no ep_dp candidate"
            raise ValueError(f"{which} is not feasible here ({rejections(ranked.rejected)})")
        return preds[0].candidate


def step_loads(run: DriftRun, cfg, step: int, trace=None) -> np.ndarray:
    """float64 [layers, E]: each expert's (token, k) pairs in one step of the run's routing."""
    from epmoe.eplb.routing import make_routing

    E = cfg.num_experts
    if trace is not None:
        ids = trace[step % trace.shape[0], :run.layers]
    else:
        ids = make_routing(run.routing, run.layers, E, cfg.top_k, run.sample_tokens, step,
                           run.seed)
    return np.stack([torch.bincount(ids[l].flatten(), minlength=E).double().numpy()
                     for l in range(ids.shape[0])])


def _trace(run: DriftRun, cfg):
    if not run.routing.startswith("trace:"):
        return None
    from epmoe.eplb.routing import load_trace

    t = load_trace(run.routing.removeprefix("trace:"))
    if t.shape[1] < run.layers:
        raise ValueError(f"trace {run.routing!r} holds {t.shape[1]} layer(s); layers "
                         f"({run.layers}) must be <= that")
    if t.numel() and (t.min() < 0 or t.max() >= cfg.num_experts):
        raise ValueError(f"trace expert ids span [{int(t.min())}, {int(t.max())}], outside "
                         f"[0, {cfg.num_experts}) for {run.model}")
    return t


def simulate(run: DriftRun, progress=None, phase=None) -> tuple[list[Block], list[Event], str]:
    """(blocks, rebalances, the candidate's label). progress(done, total): per block priced;
    phase(text): what starts (a long run says how far it is)."""
    run.check()
    m = _Model(run)
    cfg, E = m.cfg, m.cfg.num_experts
    trace = _trace(run, cfg)
    if run.candidate is not None:  # one that cannot run here fails before the draw
        m.candidate = m._pick(Workload(cfg, m.quant, run.tokens, RoutingSpec()), None)
    if phase is not None:
        phase(f"drawing {run.steps} steps of routing ({run.sample_tokens} tokens, "
              f"{run.layers} layers each)")
    loads = [step_loads(run, cfg, s, trace) for s in range(run.steps)]
    start = [[s % E for s in range(m.num_slots)] for _ in range(run.layers)]
    current = Placement.from_phy2log(torch.tensor(start), E, run.ep)
    pending: tuple[int, Placement] | None = None  # (step it lands, placement): async moves
    blocks, events = [], []
    total = len(set(range(0, run.steps, run.block)) | set(range(0, run.steps, run.every)))
    a, last = 0, None  # (step ms, follows ms) of the last block under the eplb placement
    since = 0  # the load window restarts where a placement takes effect (the runtime's clear)
    while a < run.steps:
        stall = 0.0
        if pending is not None and pending[0] <= a:
            current, pending, since = pending[1], None, a
        if a and a % run.every == 0:
            if pending is not None:  # the runtime's answer while a move is under way
                events.append(Event(a, "busy", 0, 0.0, 0.0, False, -1,
                                    "the previous migration is still staging"))
            else:
                ev, new = _rebalance(m, run, loads[max(since, a - run.window):a], a, current,
                                     *last)
                events.append(ev)
                if ev.applied and run.migration == "sync":
                    current, stall, since = new, ev.move_ms, a
                elif ev.applied:
                    pending = (ev.lands, new)
                    total += 1
        b = min(run.steps, (a // run.block + 1) * run.block, (a // run.every + 1) * run.every,
                *([pending[0]] if pending is not None and pending[0] > a else []))
        load = np.sum(loads[a:b], axis=0)
        ms, bal = {}, {}
        for name, p in (("ideal", m.place(load)), ("none", None), ("eplb", current)):
            ms[name], bal[name], follows = (float(x) for x in m.price(load / (b - a), p))
        last = (ms["eplb"], follows)
        ms["eplb"] += stall / (b - a)  # a sync move's stall, spread over its block's steps
        blocks.append(Block(a, b, {k: ms[k] for k in SERIES}, {k: bal[k] for k in SERIES}))
        if progress is not None:
            progress(len(blocks), total)
        a = b
    return blocks, events, m.candidate.label


def _rebalance(m: _Model, run: DriftRun, window: list, step: int, current: Placement,
               step_ms: float, follows_ms: float) -> tuple[Event, Placement]:
    """The rebalancer's choice and decision after `step` steps for the `window` of step loads
    recorded since the last switch (at most run.window), scaled to the whole stack (the gain
    credited to the stages that follow the load, as the runtime's timer measures)."""
    if not window:
        return Event(step, "skip", 0, 0.0, 0.0, False, -1, "no load recorded since the last "
                     "switch"), current
    weight = np.sum(window, axis=0)
    new, kind = next_placement(weight, current, m.groups, m.topo.num_nodes, run.ep, m.mode,
                               SLACK)
    intra, inter, slots = bytes_to_move(current.phy2log.tolist(), new.phy2log.tolist(),
                                        m.topo.node_of_rank, m.slot_bytes * m.scale)
    inv_old = float((1 / current.balancedness(weight)).sum()) * m.scale
    inv_new = float((1 / new.balancedness(weight)).sum()) * m.scale
    dec = decide(step_ms, inv_old, inv_new, run.every, intra, inter, run.migration,
                 links=migration_links(m.prof, m.topo), follows_ms=follows_ms)
    applied = dec.rebalance and slots > 0
    land = step if run.migration == "sync" else \
        step + max(1, math.ceil(dec.move_ms / step_ms)) if step_ms > 0 else step + 1
    reason = dec.reason if slots else "the placement does not change"
    return Event(step, kind, slots, dec.bytes_moved / 1e6, float(dec.move_ms), applied,
                 land if applied else -1, reason), new


def summary(blocks: list[Block]) -> dict:
    """Per series: mean step ms over the run (eplb with its stalls) and mean balancedness; how
    much of the gap from none to ideal the rebalances recover (None where that gap is under
    RECOVERED_FLOOR of the step: a share of nothing says nothing)."""
    n = sum(b.stop - b.start for b in blocks)
    out = {}
    for s in SERIES:
        out[s] = {"step_ms": sum(b.step_ms[s] * (b.stop - b.start) for b in blocks) / n,
                  "balancedness": sum(b.balancedness[s] * (b.stop - b.start)
                                      for b in blocks) / n}
    gap = out["none"]["step_ms"] - out["ideal"]["step_ms"]
    out["recovered"] = float((out["none"]["step_ms"] - out["eplb"]["step_ms"]) / gap) \
        if gap > RECOVERED_FLOOR * out["none"]["step_ms"] else None
    return out


__all__ = ["Block", "DriftRun", "Event", "SERIES", "simulate", "step_loads", "summary"]
