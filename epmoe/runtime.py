"""One rank's runtime: builds its layers (weights, comm, experts) and runs steps.

The launcher creates one `Runtime` per rank (in-process for ep=1, a Ray actor otherwise) and
drives all of them through `call(method, *args)`. A step runs every MoE layer of the stack on
this rank's tokens: a pre-norm residual stack without attention (layer l runs on
rms_norm(x_l), x_l+1 = x_l + its output; without the norm a SwiGLU stack's activations grow
doubly exponentially and overflow bf16 within ~8 layers).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from epmoe.checkpoint import SafetensorsCheckpoint
from epmoe.comm import CommContext, make_comm
from epmoe.eplb.decision import measured_follows_ms
from epmoe.eplb.rebalancer import RebalanceOptions, Rebalancer
from epmoe.eplb.recorder import count_pairs_
from epmoe.experts.base import Experts
from epmoe.layer import MoELayer
from epmoe.memory import check_rank_fits
from epmoe.plan.forms import LayerPlan
from epmoe.plan.run import RunConfig
from epmoe.router import Routing, TokenIds
from epmoe.step_tokens import StepTokens
from epmoe.timing import DeviceSleep, StageTimer, host_op_us
from epmoe.weights import layer_weights

PRE_NORM_EPS = 1e-6


def pre_norm(x: torch.Tensor) -> torch.Tensor:
    """A layer's input: its residual rows RMS-normalized (no weight), as a pre-norm block
    feeds its MoE; bf16 in and out."""
    return F.rms_norm(x, (x.shape[-1],), eps=PRE_NORM_EPS)


def run_layer(layer, x: torch.Tensor, routing=None, token_offset: int = 0):
    """Layer l of a step on its residual rows x -> (its input h, its output, the next layer's
    residual rows): the pre-norm, the forward and the residual add, the two between the
    layers timed as the layer's stages "norm" and "residual" (on the layer's timer)."""
    with layer.timer.stage("norm"):
        h = pre_norm(x)
    out = layer.forward(h, routing, token_offset=token_offset)
    with layer.timer.stage("residual"):
        return h, out, residual_add(x, out)


def residual_add(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The next layer's residual rows: x + the layer's output. bf16 + bf16 adds in fp32 and
    rounds once (torch's opmath): the bits of the explicit fp32 sum, in one kernel, not four
    (bench.kernels "residual")."""
    return torch.add(x, out).to(torch.bfloat16)


# device timing (RunConfig.timing): the GPU is held for HOLD_FACTOR x the fastest issue time
# of the steps so far (the first step: HOLD_FIRST_MS; never above HOLD_MAX_MS)
HOLD_FACTOR, HOLD_FIRST_MS, HOLD_MAX_MS = 1.5, 20.0, 500.0


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
        self.device_timed = run.timing == "device" and self.device.type == "cuda"
        self.sleep = DeviceSleep(self.device) if self.device_timed else None
        self.host_ms: list[float] = []  # the host's time to issue each step
        self.held_ms: list[float] = []  # device timing: how long the GPU was held first
        self.host_probes: list[float] = []  # this host's speed: after steps 0 and mid, report
        # each step's input (tokens_for): a rank's own rows when the stack has ep_dp layers
        self._tokens = StepTokens(run.tokens, self.cfg.hidden, run.seed,
                                  rank if run.own_tokens else 0, self.device)
        self._probed_at_report = False
        from epmoe.comm import resolve_backend

        # per layer: (backend, one-line reason) and the LayerPlan; `backend` overrides the run's
        self.layer_backends = []
        for l in range(run.num_layers):
            spec = run.layer_spec(l)
            self.layer_backends.append(resolve_backend(
                backend or spec.backend, run.replace(form=spec.form, stack=()), self.device))
        self.plans = [run.layer_plan(l, rank, b) for l, (b, _) in enumerate(self.layer_backends)]
        self.backend, self.backend_reason = self._summary_backend()
        if self.device.type == "cuda":
            from epmoe.env import use_single_node_nvshmem

            use_single_node_nvshmem()  # before any NVSHMEM (DeepEP LL, symmetric arena) starts
        # shared by every layer's comm: the group, the worst case that sizes preallocated
        # buffers, and the buffers themselves (freed collectively by close())
        self.comm_ctx = CommContext(group, rank, self.world, self.device,
                                    max_tokens_per_rank=run.tokens)
        # the rebalancer owns the placement (slot s of layer l holds logical expert
        # phy2log[l][s]; initially s mod E), the replica maps and, with run.eplb, rebalancing
        slots = self.plans[0].slots(self.cfg)
        # run.weights, opened once (its files are read per layer); None: synthetic weights
        self.checkpoint = SafetensorsCheckpoint.open(run.weights)
        self.rebalancer = Rebalancer(
            self.cfg, run.quant, run.num_layers, slots, rank=rank,
            world=self.world, group=group, device=self.device, forms=run.forms,
            own_tokens=run.own_tokens, token_offset=self.token_offset,
            options=RebalanceOptions(enabled=run.eplb, window=run.eplb_window,
                                     migration=run.eplb_migration, link_gbps=run.eplb_link_gbps,
                                     links=run.eplb_links),
            make_experts=self._make_experts, timer=self.timer)
        check_rank_fits(run, rank, self.device)  # a clear error, not the OOM killer
        self.layers = [self._build_layer(l, self.rebalancer.phy2log[l])
                       for l in range(run.num_layers)]
        self.experts_reason = getattr(self, "_experts_reason", "")
        self.step_ms: list[float] = []
        self._last: list[dict] = []  # last step's per-layer tensors, still on the device
        self._last_host: list[dict] | None = None
        # (token, k) pairs routed by this rank's tokens: per physical slot and per logical expert
        # (kept on the device, counted without host syncs; moved to the host by report())
        self.load_LS = torch.zeros(run.num_layers, slots, dtype=torch.long, device=self.device)
        self.load_LE = torch.zeros(run.num_layers, self.cfg.num_experts, dtype=torch.long,
                                   device=self.device)
        # run.cuda_graph: the captured step (epmoe/graph.py), the placement it was captured
        # with, and how many captures the run made (one, plus one per placement switch)
        self.graph, self.graph_placement, self.captures = None, None, 0
        if run.cuda_graph:
            self._check_capturable()

    def _check_capturable(self) -> None:
        """--cuda-graph with the backends this rank resolved ("auto" included)."""
        from epmoe.graph import capture_violation

        if self.device.type != "cuda":
            raise ValueError(f"--cuda-graph needs CUDA; this rank runs on {self.device}")
        for l, layer in enumerate(self.layers):
            why = capture_violation(self.plans[l].form, self.layer_backends[l][0],
                                    layer.experts.name)
            if why:
                raise ValueError(f"--cuda-graph: layer {l}: {why}")

    @property
    def plan(self) -> LayerPlan:
        """Layer 0's plan (every layer's unless the stack mixes forms)."""
        return self.plans[0]

    def _summary_backend(self) -> tuple[str, str]:
        names = [b for b, _ in self.layer_backends]
        if len(set(names)) == 1:
            return self.layer_backends[0]
        return "mixed", ", ".join(f"layer {l}: {b}" for l, b in enumerate(names))

    # ---------------------------------------------------------------- building
    def _symm_options(self):
        """The symm layers' SymmOptions from --comm-option (None: their defaults)."""
        if not self.run.comm_options:
            return None
        from epmoe.comm.symm.options import SymmOptions

        return SymmOptions(**dict(self.run.comm_options))

    def _make_experts(self, weights, name: str | None = None, cfg=None) -> Experts:
        """The experts backend `name` (default: the run's) for these weights (computing with
        `cfg`, default the model's)."""
        from epmoe.experts.select import make_experts

        experts, reason = make_experts(name or self.run.experts, weights, cfg or self.cfg,
                                       self.run.quant, self.device)
        self._experts_reason = reason
        return experts

    def _build_layer(self, l: int, slot_to_logical=None) -> MoELayer:
        run, cfg, plan = self.run, self.cfg, self.plans[l]
        slots = plan.local_slots(cfg)
        logical = [slot_to_logical[s] if slot_to_logical is not None else s % cfg.num_experts
                   for s in slots]
        with_shared, sslice = plan.shared_slice(cfg, run.quant)
        w = layer_weights(cfg, run.quant, l, run.seed, logical, plan.inter_slice(cfg), sslice,
                          with_shared, self.device, self.checkpoint)
        w = dataclasses.replace(w, experts=dataclasses.replace(
            w.experts, expert_ids_E=torch.as_tensor(slots, dtype=torch.long, device=self.device)))
        experts = self._make_experts(w.experts, plan.experts)
        shared = None if w.shared is None else \
            self._make_experts(w.shared, plan.experts, cfg.shared_mlp_cfg)
        comm = make_comm(plan.backend, cfg, run.quant, plan.expert_map(cfg).to(self.device),
                         self.comm_ctx, self._symm_options())
        comm.set_alignment(experts.alignment)
        return MoELayer(cfg, run.quant, w, plan, comm, experts, shared,
                        replica_map=self.rebalancer.replica_maps[l], group=self.group,
                        timer=self.timer, micro_batches=run.micro_batches)

    # ---------------------------------------------------------------- stepping
    def tokens_for(self, step: int) -> torch.Tensor:
        """This rank's input tokens: its own rows when the stack has ep_dp layers, else the one
        batch every rank holds (generated from the same seed everywhere)."""
        return self._tokens(step)  # (epmoe/step_tokens.py: why not a fresh draw per step)

    def routing_for(self, step: int, l: int) -> Routing | TokenIds | None:
        """Synthetic / replayed routing (None = the model's router; a hash layer's router:
        its rows' TokenIds). One global stream per step over every rank's tokens (generated
        once for all layers), so replicas, the oracle and EPLB see the same routing whatever
        the rank count; each layer takes the rows it runs."""
        cfg = self.cfg
        first = self.run.token_offset(l, self.rank)
        rows = slice(first, first + self.run.layer_tokens(l))
        if self.run.routing == "router":
            return TokenIds(self._token_ids(step)[rows].to(self.device)) \
                if l in cfg.hash_layers else None
        if getattr(self, "_routing_step", None) != step:
            from epmoe.eplb.routing import make_routing

            self._routing_ids = make_routing(self.run.routing, self.run.num_layers,
                                             cfg.num_experts, cfg.top_k, self.run.global_tokens,
                                             step, self.run.seed)
            self._routing_step = step
        ids = self._routing_ids[l]
        g = torch.Generator().manual_seed(self.run.seed + step * 17 + l)
        w = torch.softmax(torch.randn(ids.shape[0], cfg.top_k, generator=g), -1)
        return Routing(ids[rows].to(torch.int32).to(self.device),
                       (w[rows] * cfg.routed_scaling_factor).to(self.device))

    def _token_ids(self, step: int) -> torch.Tensor:
        """The step's token ids over every rank's rows (uniform over the vocabulary; the hash
        layers route by them), one stream per step like the synthetic routing's."""
        if getattr(self, "_tokens_step", None) != step:
            g = torch.Generator().manual_seed(self.run.seed * 7919 + step * 131 + 104729)
            self._token_stream = torch.randint(0, self.cfg.vocab_size, (self.run.global_tokens,),
                                               generator=g)
            self._tokens_step = step
        return self._token_stream

    @property
    def token_offset(self) -> int:
        """Global index of this rank's first own row (layer 0's view)."""
        return self.run.token_offset(0, self.rank)

    def _relayout(self, x: torch.Tensor, gathered: bool) -> torch.Tensor:
        """Between layers of different forms: own rows -> every rank's rows (all-gather, rank
        order) or back (this rank's slice of the gathered batch, no communication)."""
        with self.timer.stage("relayout"):
            if gathered:
                from epmoe.comm.wire import all_gather_rows

                return all_gather_rows(x, self.world, self.group)
            n = self.run.tokens
            return x[self.rank * n:(self.rank + 1) * n]

    def step(self, step: int) -> float:
        """Run all layers once; returns this rank's step time in ms. With run.cuda_graph,
        steps after the first are replayed from one captured graph (epmoe/graph.py)."""
        x = self.tokens_for(step)
        routes = [self.routing_for(step, l) for l in range(len(self.layers))]
        self.timer.step = step  # tags each stage call (step, layer): the report's per-layer
        self.rebalancer.begin_step(self.layers)  # (may switch to a staged EPLB placement)
        graphed = self.run.cuda_graph and step > 0
        placement = tuple(map(tuple, self.rebalancer.phy2log)) if graphed else None
        if graphed and (self.graph is None or self.graph_placement != placement):
            # captured before the timed step (nothing runs); again after a rebalance, whose
            # new experts and replica maps the old graph does not hold
            from epmoe.graph import StepGraph

            self.graph = None
            with self.timer.stage("capture", record=False):
                self.graph = StepGraph.capture(self._issue, x, routes, self.timer)
            self.graph_placement = placement
            self.captures += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.group is not None:
            with self.timer.stage("barrier", record=False):  # a heartbeat shows who waits here
                dist.barrier(group=self.group)
        if self.device_timed:  # the GPU busy while the host issues the step: events = GPU time
            held = min(HOLD_MAX_MS, HOLD_FACTOR * min(self.host_ms)) if self.host_ms \
                else HOLD_FIRST_MS
            self.sleep.hold(held)
            self.held_ms.append(held)
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
        t0 = time.perf_counter()
        if graphed:
            with self.timer.stage("graph replay", record=False):
                keep = self.graph.replay(x, routes)
        else:
            keep = self._issue(x, routes)
        self.host_ms.append((time.perf_counter() - t0) * 1e3)
        if self.device_timed:
            end.record()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ms = start.elapsed_time(end) if self.device_timed else (time.perf_counter() - t0) * 1e3
        if graphed:
            self.timer.replayed()
        for layer in self.layers:  # after the sync the step already has: device-side timeouts
            layer.comm.check_errors()
        self.step_ms.append(ms)
        if step in (0, self.run.steps // 2):  # hosts drift within a run: probe more than once
            self._probe_host()
        if step == 0 and self.run.steps > 1:  # warm-up (compiles, first arena calls): its
            self.timer.reset()                # stages would skew the per-stage medians
        self._last = keep
        self._last_host = None
        return ms

    def _issue(self, x: torch.Tensor, routes: list) -> list[dict]:
        """Issue every layer on x with the given routings (None: the layer's router); returns
        the per-layer records the oracle checks (empty lists unless run.check)."""
        run = self.run
        gathered = not run.own_tokens  # x holds every rank's rows (replicated forms)
        keep = []
        for l, layer in enumerate(self.layers):
            self.timer.layer = l  # (a relayout counts to the layer it feeds)
            want = not run.holds_own_rows(l)
            if self.world > 1 and want != gathered:
                x, gathered = self._relayout(x, want), want
            r = routes[l]
            h, out, nxt = run_layer(layer, x, r, run.token_offset(l, self.rank))
            self.rebalancer.record(l, layer.last_routing.topk_ids_TK, layer.last_physical_ids)
            count_pairs_(self.load_LS[l], layer.last_physical_ids)
            count_pairs_(self.load_LE[l], layer.last_routing.topk_ids_TK)
            if run.check:  # device tensors; report() moves them to the host
                # the routing the layer used (its own router's when r is None): the oracle
                # replays it, and checks the router separately (routed=True)
                used, by_id = layer.last_routing, isinstance(r, TokenIds)
                keep.append(dict(x=h, out=out, ids=used.topk_ids_TK, w=used.topk_weights_TK,
                                 routed=torch.tensor(r is None or by_id),
                                 tok=r.token_ids_T if by_id else None,
                                 phys=layer.last_physical_ids))
            x = nxt
        self.timer.layer = None
        return keep

    # ---------------------------------------------------------------- reporting
    @property
    def last(self) -> list[dict]:
        """The last step's x / out / routing per layer, on the host (moved once, on demand)."""
        if self._last_host is None:
            self._last_host = [{k: None if v is None else v.cpu() for k, v in rec.items()}
                               for rec in self._last]
        return self._last_host

    def _probe_host(self) -> None:
        """The host's speed now (`epmoe.timing.host_op_us`, between steps: the GPU idle); a
        device that failed gives NaN (the report goes on without it)."""
        try:
            self.host_probes.append(host_op_us(self.device))
        except RuntimeError:
            self.host_probes.append(float("nan"))

    def report(self) -> dict:
        """This rank's timings, loads and (if check) last-step tensors."""
        stages = self.timer.collect()
        if not self._probed_at_report:  # once more, after the steps
            self._probe_host()
            self._probed_at_report = True
        ok = [v for v in self.host_probes if v == v]
        return dict(rank=self.rank, device=str(self.device), step_ms=self.step_ms,
                    host_op_us=statistics.median(ok) if ok else None,
                    stages_ms=stages, stages_at=self.timer.collect_where(),
                    timing="device" if self.device_timed else "launched",
                    host_ms=self.host_ms, held_ms=self.held_ms, last=self.last,
                    load_LS=self.load_LS.cpu().clone(),
                    load_LE=self.load_LE.cpu().clone(),
                    phy2log=[list(p) for p in self.rebalancer.phy2log],
                    backend=self.backend, backend_reason=self.backend_reason,
                    layer_backends=[list(b) for b in self.layer_backends],
                    layer_experts=[layer.experts.name for layer in self.layers],
                    fp8_mma=any(layer.experts.fp8_mma for layer in self.layers),
                    forms=list(self.run.forms), experts_reason=self.experts_reason)

    # ---------------------------------------------------------------- EPLB
    def rebalance(self, steps_until_next: int | None = None) -> dict:
        # step 0 warms up (the stage timer dropped it), as in the launch report
        timed = self.step_ms[1:] if self.run.steps > 1 and len(self.step_ms) > 1 \
            else self.step_ms
        follows = measured_follows_ms(self.timer.collect(), self.timer.collect_where(),
                                      [plan.backend for plan in self.plans])
        return self.rebalancer.rebalance(self.layers, timed, steps_until_next, follows)

    def window_balancedness(self) -> float:
        return self.rebalancer.window_balancedness()

    def eplb_status(self) -> dict:
        return self.rebalancer.status()

    def close(self) -> None:
        """Free the comm buffers (collective: every rank calls it)."""
        self.comm_ctx.close()

    def call(self, method: str, *args, **kwargs):
        """The one entry the driver uses (Ray actors forward to it)."""
        return getattr(self, method)(*args, **kwargs)
