"""The rebalancer owns rebalancing for one rank's runtime: the placement (phy2log) and replica
maps of every layer, the load window, the topology, the placement decision, the migration.

    rebalancer = Rebalancer(cfg, quant, num_layers, num_slots, rank=, world=, group=, device=,
                            forms=, own_tokens=, token_offset=,
                            options=RebalanceOptions(enabled=True, ...),
                            make_experts=..., timer=...)   # collective when enabled, world > 1
    rebalancer.begin_step(layers)              # every step, before the layers run (collective
                                               # while an async migration is pending)
    rebalancer.record(l, topk_ids_TK, physical_ids_TK)   # after layer l ran
    event = rebalancer.rebalance(layers, step_ms, steps_until_next)   # collective

A rebalance: one all-reduce of the window's load; the placement of the run's mode (computed on
every rank, rank 0's broadcast); the incremental placement when it balances within
`incremental_slack` of the full one (fewer slots move); traffic of the old and the new placement
from the last step's routing; the cost-aware decision (`epmoe.eplb.decision`); then the
migration: sync (weights move now, the step waits) or async (a background thread stages the
new slots on the migration's own process group; `begin_step` switches all ranks at the first
step boundary where every rank is done, agreed by one small all-reduce per step).
"""

from __future__ import annotations

import contextlib

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe.config import MoEConfig, QuantConfig
from epmoe.eplb.background import BackgroundMigration
from epmoe.eplb.decision import MigrationLinks, decide
from epmoe.eplb.incremental import next_placement
from epmoe.eplb.migrate import apply_staged, bytes_to_move, migrate_layer, slot_tensors
from epmoe.eplb.placement import Placement
from epmoe.eplb.policy import MODES, ModeChoice, choose_mode
from epmoe.eplb.recorder import LoadRecorder, balancedness_per_layer
from epmoe.eplb.topology import Topology, discover
from epmoe.eplb.traffic import Traffic, routing_from_loads, tradeoff, traffic_from_routing
from epmoe.router import ReplicaMap

MIGRATIONS = ("sync", "async")


@dataclass(frozen=True)
class RebalanceOptions:
    """enabled: record load and allow rebalance(); window: steps of load history; migration:
    sync | async; mode: None = `choose_mode`'s default; links: the run's link figures for the
    move (None: decision.py's defaults); link_gbps: one bandwidth for every link, over links;
    incremental_slack: keep the incremental placement when its balancedness is within this of
    the full one's; warmup_moves: how many first moves the move scale ignores."""

    enabled: bool = False
    window: int = 8
    migration: str = "sync"
    mode: str | None = None
    link_gbps: float | None = None
    incremental_slack: float = 0.02
    links: MigrationLinks | None = None
    warmup_moves: int = 1  # moves not learnt from: the first pays one-off costs (NCCL's lazy
    #                        point-to-point connections, kernels built for the new layout)

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"load window ({self.window}) must be >= 1 step")
        if self.migration not in MIGRATIONS:
            raise ValueError(f"eplb migration ({self.migration!r}) must be one of {MIGRATIONS}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"eplb mode ({self.mode!r}) must be one of {MODES} or None")
        if self.link_gbps is not None and not self.link_gbps > 0:
            raise ValueError(f"link_gbps ({self.link_gbps}) must be > 0 GB/s")
        if self.warmup_moves < 0:
            raise ValueError(f"warmup_moves ({self.warmup_moves}) must be >= 0")


def token_bytes(hidden: int, quant: QuantConfig) -> int:
    """Bytes a token moves per destination: its dispatched row (data + scales) and the bf16
    row combine sends back."""
    from epmoe.quant import quantize_act

    q = quantize_act(torch.zeros(1, hidden), quant)
    scale = 0 if q.scale is None else q.scale.numel() * q.scale.element_size()
    return q.data.numel() * q.data.element_size() + scale + 2 * hidden


class Rebalancer:
    def __init__(self, cfg: MoEConfig, quant: QuantConfig, num_layers: int, num_slots: int, *,
                 rank: int, world: int, group, device, forms: tuple[str, ...], own_tokens: bool,
                 token_offset: int, options: RebalanceOptions, make_experts, timer=None,
                 topology: Topology | None = None):
        """forms: each layer's parallel form (a tp layer holds every slot: one "GPU" for its
        replica map); own_tokens: every rank routes its own tokens (loads and traffic are
        summed over ranks); token_offset: the global index of this rank's first token;
        make_experts(weights, experts_name): the runtime's experts factory; topology: None =
        learned by an all-gather (collective)."""
        self.cfg, self.rank, self.world, self.group = cfg, rank, world, group
        self.device, self.own_tokens = torch.device(device), own_tokens
        self.token_offset = token_offset
        self.options, self.make_experts, self.timer = options, make_experts, timer
        self.num_gpus = world
        self.grouped = group is not None and world > 1
        E = cfg.num_experts
        self.phy2log = [[s % E for s in range(num_slots)] for _ in range(num_layers)]
        self._map_gpus = [world if f != "tp" else 1 for f in forms]
        self.replica_maps = [self._replica_map(p, g) for p, g in zip(self.phy2log, self._map_gpus)]
        self.recorder = None
        self.topology = topology or Topology.single_node(world)
        self.migration_group = None
        self.mode = ModeChoice("global", "EPLB is off")
        if options.enabled:
            self.recorder = LoadRecorder(num_layers, num_slots, options.window, self.device)
            if topology is None and self.grouped:
                self.topology = discover(group, world, self.device)
            self.mode = self._choose_mode()
            if options.migration == "async" and self.grouped:
                self.migration_group = dist.new_group(dist.get_process_group_ranks(group),
                                                      backend=dist.get_backend(group))
        self.token_bytes = token_bytes(cfg.hidden, quant)
        self._ids: list[torch.Tensor | None] = [None] * num_layers
        self._pending: BackgroundMigration | None = None
        self._pending_since = 0
        # the last move's measured time / its link time (decision.py), and the link time of
        # the move under way
        self._move_scale: float | None = None
        self._pending_link_ms = 0.0
        self._moves = 0  # moves measured so far
        self.step_index = 0
        self.last_switch: dict | None = None

    # ---------------------------------------------------------------- placement state
    def _replica_map(self, phy2log_R: list[int], num_gpus: int) -> ReplicaMap | None:
        e = self.cfg.num_experts
        if phy2log_R == list(range(e)):
            return None  # identity: logical id == physical slot
        p = Placement.from_phy2log([phy2log_R], e, num_gpus)
        return ReplicaMap(p.log2phy[0].to(self.device), p.logcnt[0].to(self.device))

    def _choose_mode(self) -> ModeChoice:
        topo = self.topology
        if self.options.mode is not None:
            return ModeChoice(self.options.mode, "set by the run's options")
        if topo.num_nodes > 1 and topo.ranks_per_node is None:
            return ModeChoice("global", f"nodes hold unequal rank counts "
                                        f"({list(topo.node_of_rank)}): no even split by node")
        return choose_mode(self.cfg.n_group, self.cfg.topk_group, topo.num_nodes)

    def _switch_layer(self, layer, l: int, new_R: list[int]) -> None:
        if new_R == self.phy2log[l]:
            return
        self.phy2log[l] = new_R
        layer.experts = self.make_experts(layer.weights.experts, layer.plan.experts)
        layer.experts.timer = self.timer
        layer.replica_map = self.replica_maps[l] = self._replica_map(new_R, self._map_gpus[l])

    # ---------------------------------------------------------------- per step
    def begin_step(self, layers) -> None:
        if self._pending is not None:
            self._maybe_switch(layers, self.step_index)
        self.step_index += 1
        if self.recorder is not None:
            self.recorder.begin_step()

    def record(self, l: int, topk_ids_TK: torch.Tensor, physical_ids: torch.Tensor) -> None:
        """Count a layer's routed (token, k) pairs (no host sync); keep its logical routing."""
        if self.recorder is not None:
            self.recorder.record(l, physical_ids)
            self._ids[l] = topk_ids_TK

    def _maybe_switch(self, layers, next_step: int) -> None:
        """Switch to the staged placement when every rank's staging is done (one all-reduce);
        `next_step` is the first step that will run with it."""
        p = self._pending
        flags = torch.tensor([0 if p.done else 1, 1 if p.failed else 0], dtype=torch.int64,
                             device=self.device)
        if self.grouped:
            dist.all_reduce(flags, group=self.group)
        not_done, failed = flags.tolist()
        if failed:
            self._pending = None
            mine = f"this rank: {p.error!r}" if p.failed else "not this rank"
            raise RuntimeError(f"background migration failed on {failed} rank(s) ({mine}); "
                               f"the placement stays as it was")
        if not_done:
            return
        t0 = time.perf_counter()
        staged = p.result()
        for l, layer in enumerate(layers):
            apply_staged(layer.weights.experts, staged[l])
            self._switch_layer(layer, l, p.new_LR[l])
        self.recorder.clear()
        self._pending = None
        self.last_switch = dict(step=next_step, steps_waited=next_step - self._pending_since,
                                stage_ms=p.stage_ms, switch_ms=(time.perf_counter() - t0) * 1e3)
        self._learn_move(p.stage_ms + self.last_switch["switch_ms"])

    def _learn_move(self, measured_ms: float) -> None:
        """The move scale of the next decision: this move's measured time / its link time
        (after the warm-up moves)."""
        self._moves += 1
        if self._moves > self.options.warmup_moves and self._pending_link_ms > 0 \
                and measured_ms > 0:
            self._move_scale = measured_ms / self._pending_link_ms

    def finish(self, layers) -> None:
        """Wait for a pending migration and switch (collective: every rank calls it)."""
        while self._pending is not None:
            self._pending.result()
            self._maybe_switch(layers, self.step_index)

    # ---------------------------------------------------------------- rebalancing
    def _window(self) -> torch.Tensor:
        return self.recorder.window_load(self.group if self.grouped else None,
                                         reduce=self.own_tokens).cpu()

    def window_balancedness(self) -> float:
        """Measured balancedness of the steps recorded since the last switch (all ranks)."""
        return float(balancedness_per_layer(self._window(), self.world).mean())

    def status(self) -> dict:
        return dict(pending=self._pending is not None, last_switch=self.last_switch,
                    placement_mode=self.mode.mode, mode_reason=self.mode.reason,
                    topology=self.topology.summary())

    def rebalance(self, layers, step_ms: list[float], steps_until_next: int | None = None,
                  follows_ms: float | None = None) -> dict:
        """Decide on and start (or apply) a new placement from the window; collective.
        follows_ms: this rank's time per step in the stages that follow its load
        (`decision.follows_load`; the decision credits the slowest rank's; None: the whole
        step)."""
        if self.recorder is None:
            raise RuntimeError("rebalance needs RunConfig(eplb=True)")
        t0 = time.perf_counter()
        ev = dict(placement_mode=self.mode.mode, mode_reason=self.mode.reason,
                  migration=self.options.migration, topology=self.topology.summary())
        if self._pending is not None:  # the same on every rank: switches are agreed
            return dict(ev, decision="busy", reason="the previous migration is still staging",
                        slots_moved=0, rebalance_ms=(time.perf_counter() - t0) * 1e3)
        load = self._window()
        t_load = time.perf_counter()
        E, G = self.cfg.num_experts, self.num_gpus
        weight_LE = torch.zeros(load.shape[0], E, dtype=torch.float64)
        for l, p in enumerate(self.phy2log):
            weight_LE[l].index_add_(0, torch.tensor(p), load[l].double())
        topo, mode = self.topology, self.mode.mode
        nodes = topo.num_nodes if topo.ranks_per_node is not None else 1
        ng = self.cfg.n_group
        old = Placement.from_phy2log(topo.to_gpu_order(torch.tensor(self.phy2log)), E, G)
        new, kind = next_placement(weight_LE, old, ng, nodes, G, mode,
                                   self.options.incremental_slack)
        new_gpu = new.phy2log.clone()
        step = torch.tensor([_median(step_ms), self._move_scale or 0.0, follows_ms or 0.0],
                            dtype=torch.float64)
        if self.grouped:  # rank 0's placement; the slowest rank's step, move scale, follows
            new_gpu = new_gpu.to(self.device)
            dist.broadcast(new_gpu, 0, group=self.group)
            step = step.to(self.device)
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.group)
            new_gpu, step = new_gpu.cpu(), step.cpu()
        new = Placement.from_phy2log(new_gpu, E, G)
        new_LR = topo.to_rank_order(new_gpu).tolist()
        t_place = time.perf_counter()
        bal_old, bal_new = old.balancedness(weight_LE), new.balancedness(weight_LE)
        traffic = self._traffic([old, new], weight_LE, nodes)
        intra, inter, slots = self._bytes_to_move(layers, new_LR)
        horizon = self.options.window if steps_until_next is None else steps_until_next
        scale = float(step[1]) or None  # the same on every rank (all-reduced)
        dec = decide(float(step[0]), float((1 / bal_old).sum()), float((1 / bal_new).sum()),
                     horizon, intra, inter, self.options.migration, self.options.link_gbps,
                     self.options.links, scale, float(step[2]) or None)
        t_decide = time.perf_counter()
        ev["timing_ms"] = dict(load=(t_load - t0) * 1e3, placement=(t_place - t_load) * 1e3,
                               decision=(t_decide - t_place) * 1e3)
        ev.update(kind=kind, balancedness_before=float(balancedness_per_layer(
            load, self.world).mean()), balancedness_old_predicted=float(bal_old.mean()),
            balancedness_predicted=float(bal_new.mean()), step_ms=float(step[0]), move_scale=scale,
            follows_ms=float(step[2]) or None, **dec.summary())
        if traffic is not None:
            ev.update(traffic_before=traffic[0].summary(), traffic_after=traffic[1].summary(),
                      tradeoff=tradeoff(float(bal_old.mean()), float(bal_new.mean()),
                                        *traffic))
        if slots == 0:
            ev.update(decision="skip", reason="the placement does not change")
        if ev["decision"] == "skip":
            return dict(ev, slots_moved=0, balancedness_predicted=float(bal_old.mean()),
                        rebalance_ms=(time.perf_counter() - t0) * 1e3)
        self._pending_link_ms = dec.link_ms
        if self.options.migration == "async":
            self._pending = BackgroundMigration([ly.weights.experts for ly in layers],
                                                self.phy2log, new_LR, self.rank, self.world,
                                                self.migration_group, self.device)
            self._pending_since = self.step_index
        else:
            mark = self.timer.stage("eplb.migrate", record=False) if self.timer is not None \
                else contextlib.nullcontext()  # heartbeats and fault injection see it
            with mark:
                for l, layer in enumerate(layers):
                    migrate_layer(layer.weights.experts, self.phy2log[l], new_LR[l], self.rank,
                                  self.world, self.group if self.grouped else None)
                    self._switch_layer(layer, l, new_LR[l])
            self.recorder.clear()
        ev["timing_ms"]["migration"] = (time.perf_counter() - t_decide) * 1e3
        if self.options.migration != "async":  # the move's time as reported sets the scale
            self._learn_move(ev["timing_ms"]["migration"])
        return dict(ev, slots_moved=slots, rebalance_ms=(time.perf_counter() - t0) * 1e3)

    def _bytes_to_move(self, layers, new_LR):
        """Per rank, bytes received from its own node and from other nodes; slots changed."""
        per_slot = sum(t[0].numel() * t.element_size()
                       for t in slot_tensors(layers[0].weights.experts))
        return bytes_to_move(self.phy2log, new_LR, self.topology.node_of_rank, per_slot)

    def _traffic(self, placements: list[Placement], weight_LE, nodes: int) -> list[Traffic] | None:
        """Traffic of each placement (GPU order) on the last step's routing of every rank
        (its own tokens, summed by one all-reduce), else (no step yet, or layers that saw
        different token counts) on a sample drawn from the loads."""
        if self.topology.num_nodes > 1 and nodes == 1:
            return None  # unequal nodes: no node numbering of the GPUs
        cfg, kw = self.cfg, dict(token_bytes=self.token_bytes)
        if any(ids is None for ids in self._ids) or len({i.shape for i in self._ids}) > 1:
            ids = routing_from_loads(weight_LE, cfg.top_k, cfg.n_group, cfg.topk_group,
                                     num_tokens=256, seed=0)
            return [traffic_from_routing(p, ids, nodes, **kw) for p in placements]
        ids = torch.stack([i.long().cpu() for i in self._ids])
        T = ids.shape[1]
        shared = not self.own_tokens or not self.grouped
        src = None if not self.own_tokens else \
            torch.full((T,), self.topology.gpu_of_rank[self.rank])
        trs = [traffic_from_routing(p, ids, nodes, src_rank_T=src, token_offset=self.token_offset,
                                    **kw) for p in placements]
        if shared:
            return trs
        sums = torch.stack([torch.stack([t.ranks_per_token_L, t.nodes_per_token_L,
                                         t.remote_nodes_per_token_L]) * T for t in trs])
        flat = torch.cat([sums.flatten(), torch.tensor([float(T)], dtype=torch.float64)])
        flat = flat.to(self.device)
        dist.all_reduce(flat, group=self.group)
        flat = flat.cpu()
        total = float(flat[-1])
        sums = flat[:-1].view(sums.shape) / total
        return [Traffic(s[0], s[1], s[2], float(s[2].sum()) * total * self.token_bytes)
                for s in sums]


def _median(xs: list[float]) -> float:
    return statistics.median(xs[-8:]) if xs else 0.0
