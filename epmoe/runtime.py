"""One rank's runtime: builds its layers (weights, comm, experts) and runs steps.

The launcher creates one `Runtime` per rank (in-process for ep=1, a Ray actor otherwise) and
drives all of them through `call(method, *args)`. A step runs every MoE layer of the stack on
this rank's tokens; layer l+1 takes x + out of layer l (a residual stack without attention).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from epmoe.comm import make_comm
from epmoe.eplb.recorder import count_pairs_
from epmoe.config import MoEConfig, QuantConfig, get_preset
from epmoe.experts.base import Experts
from epmoe.layer import MoELayer
from epmoe.parallel import LayerPlan
from epmoe.router import ReplicaMap, Routing
from epmoe.timing import StageTimer
from epmoe.weights import synthetic_layer


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs; validated before any worker starts."""

    model: str = "deepseek-v3-tiny"
    quant: QuantConfig = field(default_factory=QuantConfig)
    form: str = "ep_dp"  # tp | ep | ep_dp
    world: int = 1
    backend: str = "auto"
    ll_max_tokens: int = 256  # auto backend: DeepEP low-latency up to this many tokens per rank
    experts: str = "auto"
    tokens: int = 64  # per rank (ep_dp) or in total (tp / ep: replicated)
    layers: int | None = None  # None = the preset's num_moe_layers
    steps: int = 4
    seed: int = 0
    routing: str = "router"  # router | uniform | zipf:S | drift:S:P | trace:FILE
    redundant_experts: int = 0
    eplb: bool = False
    eplb_window: int = 8  # steps of load history a rebalance looks at
    timeout_s: float = 120.0
    check: bool = True  # keep last-step tensors for the oracle
    model_overrides: tuple = ()  # ((field, value), ...) applied to the preset

    @property
    def cfg(self) -> MoEConfig:
        cfg = get_preset(self.model)
        if self.model_overrides:
            cfg = cfg.replace(**dict(self.model_overrides))
        return cfg

    @property
    def num_layers(self) -> int:
        n = self.cfg.num_moe_layers if self.layers is None else self.layers
        if n < 1:
            raise ValueError(f"layers ({n}) must be >= 1")
        return n

    def plan(self, rank: int, backend: str) -> LayerPlan:
        return LayerPlan(form=self.form, rank=rank, world=self.world,
                         backend=backend if self.form == "ep_dp" or self.world == 1 else "local",
                         experts=self.experts,
                         num_slots=self.cfg.num_experts + self.redundant_experts)

    def validate(self) -> None:
        if self.world < 1:
            raise ValueError(f"world ({self.world}) must be >= 1")
        if self.tokens < 1:
            raise ValueError(f"tokens ({self.tokens}) must be >= 1")
        if self.steps < 1:
            raise ValueError(f"steps ({self.steps}) must be >= 1")
        self.num_layers  # noqa: B018  (validates)
        self.plan(0, "local").validate(self.cfg, self.quant)

    def replace(self, **kw) -> "RunConfig":
        return dataclasses.replace(self, **kw)


# A rebalance keeps the incremental placement when its predicted balancedness is within this
# of the full re-placement's: moving fewer slots is worth a little balance.
INCREMENTAL_SLACK = 0.02


def _device_for(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


class Runtime:
    def __init__(self, run: RunConfig, rank: int = 0, group=None, device=None,
                 backend: str | None = None):
        run.validate()
        self.run, self.rank, self.group = run, rank, group
        self.world = run.world
        self.device = torch.device(device) if device is not None else _device_for(rank)
        self.cfg = run.cfg
        self.timer = StageTimer(enabled=True, device=self.device)
        from epmoe.comm import resolve_backend

        self.backend, self.backend_reason = resolve_backend(
            backend or run.backend, run, self.device)
        self.plan = run.plan(rank, self.backend)
        # placement: slot s of layer l holds logical expert phy2log[l][s]; initially s mod E
        slots = self.plan.slots(self.cfg)
        self.phy2log = [[s % self.cfg.num_experts for s in range(slots)]
                        for _ in range(run.num_layers)]
        self.replica_maps = [self._replica_map(p) for p in self.phy2log]
        self.layers = [self._build_layer(l, self.phy2log[l]) for l in range(run.num_layers)]
        self.recorder = None
        if run.eplb:
            from epmoe.eplb.recorder import LoadRecorder

            self.recorder = LoadRecorder(run.num_layers, slots, run.eplb_window, self.device)
        self.experts_reason = getattr(self, "_experts_reason", "")
        self.step_ms: list[float] = []
        self._last: list[dict] = []  # last step's per-layer tensors, still on the device
        self._last_host: list[dict] | None = None
        # (token, k) pairs routed by this rank's tokens: per physical slot and per logical expert
        # (kept on the device, counted without host syncs; moved to the host by report())
        self.load_LS = torch.zeros(run.num_layers, slots, dtype=torch.long, device=self.device)
        self.load_LE = torch.zeros(run.num_layers, self.cfg.num_experts, dtype=torch.long,
                                   device=self.device)

    # ---------------------------------------------------------------- building
    def _replica_map(self, phy2log_R: list[int]) -> ReplicaMap | None:
        e = self.cfg.num_experts
        if phy2log_R == list(range(e)):
            return None  # identity: logical id == physical slot
        from epmoe.eplb.placement import Placement

        p = Placement.from_phy2log([phy2log_R], e, self.world if self.plan.form != "tp" else 1)
        return ReplicaMap(p.log2phy[0].to(self.device), p.logcnt[0].to(self.device))

    def _make_experts(self, weights) -> Experts:
        try:
            from epmoe.experts.select import make_experts
        except ImportError:  # pragma: no cover (select ships with the package)
            from epmoe.experts.torch_experts import TorchExperts

            self._experts_reason = "torch: selector unavailable"
            return TorchExperts(weights, self.cfg, self.run.quant)
        experts, reason = make_experts(self.run.experts, weights, self.cfg, self.run.quant,
                                       self.device)
        self._experts_reason = reason
        return experts

    def _build_layer(self, l: int, slot_to_logical=None) -> MoELayer:
        run, cfg, plan = self.run, self.cfg, self.plan
        slots = plan.local_slots(cfg)
        logical = [slot_to_logical[s] if slot_to_logical is not None else s % cfg.num_experts
                   for s in slots]
        with_shared, sslice = plan.shared_slice(cfg, run.quant)
        w = synthetic_layer(cfg, run.quant, l, run.seed, logical, plan.inter_slice(cfg),
                            sslice, with_shared, self.device)
        w = dataclasses.replace(w, experts=dataclasses.replace(
            w.experts, expert_ids_E=torch.as_tensor(slots, dtype=torch.long, device=self.device)))
        experts = self._make_experts(w.experts)
        shared = self._make_experts(w.shared) if w.shared is not None else None
        comm = make_comm(self.backend, cfg, run.quant, plan.expert_map(cfg).to(self.device),
                         group=self.group, rank=self.rank, world=self.world, run=run,
                         device=self.device)
        return MoELayer(cfg, run.quant, w, plan, comm, experts, shared,
                        replica_map=self.replica_maps[l], group=self.group, timer=self.timer)

    # ---------------------------------------------------------------- stepping
    def tokens_for(self, step: int) -> torch.Tensor:
        """This rank's input tokens: own tokens under ep_dp, the shared batch under tp/ep."""
        src = self.rank if self.run.form == "ep_dp" else 0
        g = torch.Generator().manual_seed(self.run.seed * 7919 + step * 131 + src + 1)
        x = torch.randn(self.run.tokens, self.cfg.hidden, generator=g)
        return x.to(torch.bfloat16).to(self.device)

    def routing_for(self, step: int, l: int, x: torch.Tensor) -> Routing | None:
        """Synthetic / replayed routing (None = the model's router). One global stream per step
        over every rank's tokens (generated once for all layers), so replicas, the oracle and
        EPLB see the same routing whatever the rank count; each rank takes its own rows."""
        if self.run.routing == "router":
            return None
        cfg = self.cfg
        if getattr(self, "_routing_step", None) != step:
            from epmoe.eplb.routing import make_routing

            n = self.run.tokens * (self.world if self.run.form == "ep_dp" else 1)
            self._routing_ids = make_routing(self.run.routing, self.run.num_layers,
                                             cfg.num_experts, cfg.top_k, n, step, self.run.seed)
            self._routing_step = step
        ids = self._routing_ids[l]
        g = torch.Generator().manual_seed(self.run.seed + step * 17 + l)
        w = torch.softmax(torch.randn(ids.shape[0], cfg.top_k, generator=g), -1)
        own = slice(self.token_offset, self.token_offset + self.run.tokens)
        return Routing(ids[own].to(torch.int32).to(self.device),
                       (w[own] * cfg.routed_scaling_factor).to(self.device))

    @property
    def token_offset(self) -> int:
        return self.rank * self.run.tokens if self.run.form == "ep_dp" else 0

    def step(self, step: int) -> float:
        """Run all layers once; returns this rank's step time in ms."""
        x = self.tokens_for(step)
        keep = []
        if self.recorder is not None:
            self.recorder.begin_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.group is not None:
            with self.timer.stage("barrier", record=False):  # a heartbeat shows who waits here
                dist.barrier(group=self.group)
        t0 = time.perf_counter()
        for l, layer in enumerate(self.layers):
            r = self.routing_for(step, l, x)
            out = layer.forward(x, r, token_offset=self.token_offset)
            if self.recorder is not None:
                self.recorder.record(l, layer.last_physical_ids)
            count_pairs_(self.load_LS[l], layer.last_physical_ids)
            count_pairs_(self.load_LE[l], layer.last_routing.topk_ids_TK)
            if self.run.check:  # device tensors; report() moves them to the host
                keep.append(dict(x=x, out=out, ids=None if r is None else r.topk_ids_TK,
                                 w=None if r is None else r.topk_weights_TK,
                                 phys=layer.last_physical_ids))
            x = (x.float() + out.float()).to(torch.bfloat16)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ms = (time.perf_counter() - t0) * 1e3
        self.step_ms.append(ms)
        self._last = keep
        self._last_host = None
        return ms

    # ---------------------------------------------------------------- reporting
    @property
    def last(self) -> list[dict]:
        """The last step's x / out / routing per layer, on the host (moved once, on demand)."""
        if self._last_host is None:
            self._last_host = [{k: None if v is None else v.cpu() for k, v in rec.items()}
                               for rec in self._last]
        return self._last_host

    def report(self) -> dict:
        """This rank's timings, loads and (if check) last-step tensors."""
        stages = self.timer.collect()
        return dict(rank=self.rank, device=str(self.device), step_ms=self.step_ms,
                    stages_ms=stages, last=self.last, load_LS=self.load_LS.cpu().clone(),
                    load_LE=self.load_LE.cpu().clone(), phy2log=[list(p) for p in self.phy2log],
                    backend=self.backend, backend_reason=self.backend_reason,
                    experts_reason=self.experts_reason)

    # ---------------------------------------------------------------- EPLB
    def rebalance(self, policy: str = "auto") -> dict:
        """Re-place replicas from the recorded window: one all-reduce of the load, placement on
        rank 0 (broadcast), weight migration of the changed slots, new replica maps."""
        from epmoe.eplb.migrate import migrate_layer
        from epmoe.eplb.placement import Placement, rebalance, rebalance_incremental
        from epmoe.eplb.recorder import balancedness_per_layer

        if self.recorder is None:
            raise RuntimeError("rebalance needs RunConfig(eplb=True)")
        t0 = time.perf_counter()
        grouped = self.group is not None and self.world > 1
        load = self.recorder.window_load(self.group if grouped else None,
                                         reduce=self.run.form == "ep_dp").cpu()
        before = balancedness_per_layer(load, self.world)
        e, slots = self.cfg.num_experts, load.shape[1]
        weight_LE = torch.zeros(load.shape[0], e, dtype=torch.float64)
        for l, p in enumerate(self.phy2log):
            weight_LE[l].index_add_(0, torch.tensor(p), load[l].double())
        groups = self.cfg.n_group if e % self.cfg.n_group == 0 else 1
        full = rebalance(weight_LE, slots, groups, 1, self.world, policy=policy)
        # Prefer the incremental placement (fewer slots move) when it balances nearly as well.
        old = Placement.from_phy2log(self.phy2log, e, self.world)
        incr, _ = rebalance_incremental(weight_LE, old, groups, 1, self.world)
        bal_full = float(full.balancedness(weight_LE).mean())
        bal_incr = float(incr.balancedness(weight_LE).mean())
        mode = "incremental" if bal_incr >= bal_full - INCREMENTAL_SLACK else "full"
        new = (incr if mode == "incremental" else full).phy2log
        if grouped:  # rank 0's placement is the one everybody applies
            new = new.to(self.device)
            dist.broadcast(new, 0, group=self.group)
            new = new.cpu()
        predicted = self._predicted_balancedness(weight_LE, new)
        moved = 0
        for l, layer in enumerate(self.layers):
            new_R = new[l].tolist()
            with self.timer.stage("eplb.migrate", record=False):  # heartbeat / fault point
                moved += migrate_layer(layer.weights.experts, self.phy2log[l], new_R,
                                       self.rank, self.world, self.group if grouped else None)
            if new_R != self.phy2log[l]:
                self.phy2log[l] = new_R
                layer.experts = self._make_experts(layer.weights.experts)
                layer.experts.timer = self.timer
                layer.replica_map = self.replica_maps[l] = self._replica_map(new_R)
        self.recorder.clear()
        return dict(balancedness_before=float(before.mean()),
                    balancedness_predicted=float(predicted), slots_moved=moved, mode=mode,
                    rebalance_ms=(time.perf_counter() - t0) * 1e3,
                    window_steps=int(load.sum() > 0) and self.run.eplb_window)

    def _predicted_balancedness(self, weight_LE, phy2log_LR) -> float:
        from epmoe.eplb.placement import Placement

        p = Placement.from_phy2log(phy2log_LR, self.cfg.num_experts, self.world)
        return float(p.balancedness(weight_LE).mean())

    def window_balancedness(self) -> float:
        """Measured balancedness of the steps recorded since the last rebalance (all ranks)."""
        from epmoe.eplb.recorder import balancedness_per_layer

        grouped = self.group is not None and self.world > 1
        load = self.recorder.window_load(self.group if grouped else None,
                                         reduce=self.run.form == "ep_dp").cpu()
        return float(balancedness_per_layer(load, self.world).mean())

    def call(self, method: str, *args, **kwargs):
        """The one entry the driver uses (Ray actors forward to it)."""
        return getattr(self, method)(*args, **kwargs)
