"""The routing a launch is planned for (`python -m epmoe.launch --plan auto|ep|...|sweep`).

uniform: as given. The model's router: the planner routes a sample of the rows a
step draws (i.i.d. Gaussian, epmoe.step_tokens) through each layer's own gate on the host
and plans with the expert loads that gives. The gates are the run's: synthetic ones are pure
functions of (seed, layer) (epmoe.weights), a checkpoint's (--weights) are read from it (the
router tensors only, `epmoe.weights.layer_weights` with no experts). A gate is far from
uniform: DeepSeek-V3's synthetic one at seed 0 (selection bias std 0.1 on sigmoid scores) hits
165 of 256 experts with 128 tokens and 224 with 4,096, the hottest at 8x the mean; that moves
the experts' GEMMs (weights read per expert hit) and the hottest rank's rows. The launch
report predicts from the loads the run recorded (epmoe.launch.plan_report); planning from the
same gates makes the plan's and the report's predictions agree. The replayed routings: a
trace at the loads its own ids give over the steps the run replays (exact); zipf:S and
drift:S:P at the loads a sample of rows per step gives over the run's steps (the same
generator the runtime uses, seeded per step, on fewer rows): the sum over the run, as the
report reads it. (zipf:S is not planned as the bare spec: which experts are hot, and so on
which rank they sit, is the run's seeded permutation per layer, not the planner's.) Hash
layers (experts by token id) are planned as uniform, and so is a checkpoint or trace the
launching host cannot read (a cluster path: the note says why).
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.plan.routing import RoutingSpec
from epmoe.plan.run import RunConfig

SAMPLE_ROWS = 1024  # rows routed per layer: ~4 selections per expert-slot at top-8 of 256
REPLAY_STEPS = 8  # zipf / drift: the steps sampled, spread over a longer run (~0.7 s a step
# for DeepSeek-V3's 58 layers)


@dataclass(frozen=True)
class PlannedRouting:
    """label: what the plan assumed, for reports (uniform, sampled-gate, replayed-<kind>);
    loads_LE: per-layer expert loads (a tuple of tuples), or None: `spec` for every layer;
    note: one line for the launch's notes (empty: nothing to say)."""

    label: str = "uniform"
    spec: str = "uniform"
    loads_LE: tuple | None = None
    note: str = ""

    def plan_kwargs(self) -> dict:
        """plan_stack's routing keywords."""
        return dict(routing=self.spec, loads_LE=self.loads_LE)

    def layer(self, l: int) -> RoutingSpec:
        """One layer's routing (what a single-layer ranking reads)."""
        if self.loads_LE is None:
            return RoutingSpec.parse(self.spec)
        return RoutingSpec.from_load(self.loads_LE[l])


def planned_routing(run: RunConfig, rows: int = SAMPLE_ROWS) -> PlannedRouting:
    """The routing `run`'s plan is made for (see the module docstring)."""
    if run.routing.startswith(("zipf:", "drift:", "trace:")):
        return _replayed(run, rows)
    if run.routing != "router":
        return PlannedRouting()
    whose = "the checkpoint's" if run.weights else "the synthetic"
    try:
        loads = gate_loads(run, rows)
    except (OSError, ValueError, KeyError) as exc:  # e.g. a path only the cluster's nodes see
        return PlannedRouting(note=f"routing: planned as uniform ({whose} gates not read "
                                   f"here: {str(exc).splitlines()[0]})")
    return PlannedRouting("sampled-gate", loads_LE=loads,
                          note=f"routing: planned at {whose} gates' expert loads ({rows} rows "
                               f"a layer)")


def gate_loads(run: RunConfig, rows: int = SAMPLE_ROWS) -> tuple:
    """Per layer, the number of selections of each expert when `rows` Gaussian rows (the
    run's seed) go through the layer's gate (synthetic, or the checkpoint's); hash layers: all
    ones (uniform)."""
    import torch

    from epmoe.checkpoint import SafetensorsCheckpoint
    from epmoe.router import route
    from epmoe.step_tokens import StepTokens
    from epmoe.weights import layer_weights

    cfg = run.cfg
    ckpt = SafetensorsCheckpoint.open(run.weights)
    x = StepTokens(rows, cfg.hidden, run.seed, 0, torch.device("cpu")).base().float()
    out = []
    for l in range(run.num_layers):
        w = layer_weights(cfg, run.quant, l, run.seed, [], with_shared=False, checkpoint=ckpt)
        if w.tid2eid_VK is not None:
            out.append((1.0,) * cfg.num_experts)
            continue
        ids = route(x @ w.gate_ED.T, cfg, w.bias_E, backend="torch").topk_ids_TK.long().flatten()
        load = torch.bincount(ids[ids >= 0], minlength=cfg.num_experts)
        out.append(tuple(float(v) for v in load.tolist()))
    return tuple(out)


def _replayed(run: RunConfig, rows: int) -> PlannedRouting:
    kind = run.routing.partition(":")[0]
    try:
        loads = replayed_loads(run, rows)
    except (OSError, ValueError) as exc:  # e.g. a trace only the cluster's nodes see
        return PlannedRouting(note=f"routing: planned as uniform ({kind} not read here: "
                                   f"{str(exc).splitlines()[0]})")
    how = "its own ids" if kind == "trace" else \
        f"{rows} rows a step, {len(_drift_steps(run.steps))} of them"
    return PlannedRouting(f"replayed-{kind}", loads_LE=loads,
                          note=f"routing: planned at the loads {kind} gives over the run's "
                               f"{run.steps} steps ({how})")


def replayed_loads(run: RunConfig, rows: int = SAMPLE_ROWS) -> tuple:
    """Per layer, the selections of each expert that the run's replayed routing makes over
    its steps: a trace's own ids (recorded step s % S at step s), zipf / drift at `rows` rows
    a step (epmoe.eplb.routing.make_routing, the run's seed) on up to REPLAY_STEPS steps
    spread over the run."""
    import torch

    from epmoe.eplb.routing import load_trace, make_routing, trace_loads

    cfg, layers = run.cfg, run.num_layers
    if run.routing.startswith("trace:"):
        t = load_trace(run.routing.partition(":")[2])  # [S, L, T, K]
        if t.shape[1] != layers or int(t.min()) < 0 or int(t.max()) >= cfg.num_experts:
            raise ValueError(f"the trace's layers or expert ids do not fit the run "
                             f"({layers} layers, {cfg.num_experts} experts)")
        counts = trace_loads(t, cfg.num_experts, run.steps)
    else:
        counts = torch.zeros(layers, cfg.num_experts, dtype=torch.float64)
        for step in _drift_steps(run.steps):
            ids = make_routing(run.routing, layers, cfg.num_experts, cfg.top_k, rows, step,
                               run.seed)
            for l in range(layers):
                counts[l] += torch.bincount(ids[l].flatten(), minlength=cfg.num_experts)
    return tuple(tuple(row) for row in counts.tolist())


def _drift_steps(steps: int) -> list[int]:
    if steps <= REPLAY_STEPS:
        return list(range(steps))
    return sorted({round(i * (steps - 1) / (REPLAY_STEPS - 1)) for i in range(REPLAY_STEPS)})
