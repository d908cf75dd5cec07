"""Predicted vs measured in every launch report: the cost model (epmoe.plan) predicts what
ran (each layer's resolved form, comm backend and experts kernel, the run's tokens, routing and
final replica placement, on the launch's topology and profile), per runtime stage.

JSON (added to the summary's `timing`):
    predicted_ms        {stage: ms per step}, summed over layers like `stages_ms`
    predicted_ms_per_layer  {stage: [ms per step of each layer]}, like `stages_ms_per_layer`
    ratio               {stage: predicted / measured} (None where nothing was measured)
    predicted_step_ms   the layers' predicted times (+ relayouts); step_ratio = that / measured
    predicted_issue_ms  the host's time to issue a step (the profile's issue time per layer, at
                        this host's speed); issue_ratio = that / host_issue_ms_median
    noise_floor_ms      0.05: stages measured below it are listed in below_noise_floor (shown,
                        but their ratio says little)
    prediction          profile, topology, routing, tokens per rank, the layers' candidates,
                        notes; `error` (and predicted_ms None) when the model cannot predict;
                        `host`: the run's host speed against the profile's (run_op_us,
                        profile_op_us, factor) and the prediction at the profile's own host
                        (at_profile_host_step_ms, at_profile_host_ms), None where either
                        host is unmeasured
and, with --plan, `plan`: the mode, the bucket, per layer the choice and its one-line reason,
and the plan file itself (`plan.plan`, usable as `--plan FILE`).
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.plan import Candidate, Plan, SlotMap, Workload, predict_layer, routing_stats
from epmoe.plan.backlog import Backlog
from epmoe.plan.comm_cost import CommCase
from epmoe.plan.cost import STAGES
from epmoe.plan.planner import transition_us
from epmoe.plan.routing import RoutingSpec

NOISE_FLOOR_MS = 0.05
RATIO = "predicted / measured (1 = exact; > 1: the model is pessimistic)"


def layer_candidates(run, report: dict) -> list[Candidate]:
    """What each layer ran on this rank: the run's form, the resolved backend and experts."""
    backends = [b for b, _ in report.get("layer_backends", [])]
    experts = report.get("layer_experts") or [None] * run.num_layers
    out = []
    for l in range(run.num_layers):
        spec = run.layer_spec(l)
        e = experts[l] or (spec.experts if spec.experts != "auto" else
                           _chosen(report.get("experts_reason", "")))
        b = backends[l] if l < len(backends) else spec.backend
        out.append(Candidate(spec.form, b if run.world > 1 else "local", e))
    return out


def _chosen(reason: str) -> str:
    """The experts backend named "X: chosen" in make_experts' reason line."""
    for part in reason.split(";"):
        name, _, verdict = part.strip().partition(":")
        if verdict.strip() == "chosen":
            return name.strip()
    raise ValueError(f"cannot tell the experts backend from {reason!r}")


def _routing(run, reports, l: int) -> tuple[RoutingSpec, str]:
    """The run's routing for the model: uniform as given; the model's router and the
    replayed routings (zipf, drift, trace) by the layer's load as recorded over the run (the
    routing is the model's input, not its output: a synthetic gate skews the experts, e.g.
    fewer distinct experts per step than uniform, which the GEMMs' cost follows; zipf's hot
    experts are where the run's seed put them, as the plan assumed: planned_routing). A given
    routing (not the router) skips the gate: its router stage is predicted as 0."""
    if run.routing == "uniform":
        return RoutingSpec(), "uniform"
    from epmoe.launch.oracle import layer_sources

    load = sum(r["load_LE"][l] for r in layer_sources(run, reports, l))
    if float(load.sum()) <= 0:
        return RoutingSpec(), f"{run.routing} as uniform (no load recorded)"
    return RoutingSpec.from_load(load.tolist()), f"{run.routing} by its measured load"


def predict_run(run, reports: list[dict], planning) -> dict:
    """-> dict(predicted_ms, predicted_step_ms, prediction)."""
    topo, prof, world = planning.topology, planning.profile, run.world
    own = run.own_tokens or world == 1
    tokens = run.tokens if own else max(run.tokens // world, 1)
    info = dict(profile=prof.name, topology=topo.describe(), tokens_per_rank=tokens,
                notes=list(planning.notes), ratio=RATIO)
    if run.ranks_per_gpu > 1:  # the measured times are time slices of one GPU
        info["error"] = (f"{run.ranks_per_gpu} ranks share each GPU (time-sliced), which the "
                         f"cost model does not describe")
        return dict(predicted_ms=None, predicted_step_ms=None, prediction=info)
    if run.cuda_graph:
        info["notes"].append("steps 1.. replayed from a CUDA graph: the host issues no "
                             "launches, so a device-timed profile (GPU time) is the one to "
                             "compare with")
    if not own and run.tokens % world:
        info["notes"].append(f"{run.tokens} replicated tokens over {world} ranks modelled as "
                             f"{tokens} per rank")
    here, info["host"] = at_run_host(prof, reports)
    if info["host"]:
        info["notes"].append(info["host"]["note"])
    try:
        w = _walk(run, reports, here, topo, tokens, info)
        info["notes"] += w.notes
        if here is not prof:  # what the profile's own host would have taken
            at = _walk(run, reports, prof, topo, tokens, {})
            there = at.per_stage
            info["host"].update(at_profile_host_step_ms=at.step_us / 1e3, at_profile_host_ms={
                k: float(there[k]) for k in STAGES if k in there})
    except (KeyError, ValueError) as exc:
        info["error"] = str(exc).strip('"')
        return dict(predicted_ms=None, predicted_step_ms=None, prediction=info)
    total = w.per_stage
    return dict(predicted_ms={k: float(total[k]) for k in STAGES if k in total},
                predicted_ms_per_layer={k: [float(st.get(k, 0.0)) for st in w.per_layer]
                                        for k in STAGES if k in total},
                predicted_step_ms=float(w.step_us) / 1e3, prediction=info,
                predicted_issue_ms=w.issue_us / 1e3 if w.issue_us else None)


def at_run_host(prof, reports: list[dict]):
    """(the profile scaled to this run's host, what was scaled or None). A run measures its
    host's time per tiny eager op between its steps (`host_op_us`: the median of probes
    after step 0, the middle step and the last; the slowest rank's); a profile that recorded
    its own calibrating host's is scaled by the ratio (`HardwareProfile.at_host_speed`: the
    host's issue time of a layer, and what the stages timed on an idle GPU took beyond their
    GPU time): hosts differ by 2x between leases of the same GPU machine."""
    from epmoe.launch.report import run_host_op_us

    run_us, cal_us = run_host_op_us(reports), prof.host_op_us
    if not run_us or not cal_us:
        return prof, None
    f = run_us / cal_us
    return prof.at_host_speed(f), dict(
        run_op_us=run_us, profile_op_us=cal_us, factor=f,
        note=f"this host issues a tiny op in {run_us:.2f} us, the profile's in {cal_us:.2f}: "
             f"its host time (layer issue, idle-GPU stages beyond their GPU time) x{f:.2f}")


@dataclass
class _Walk:
    """A stack predicted layer by layer: {stage: ms} of each layer, the step (us), notes,
    the host's issue time of the step (us)."""

    per_layer: list
    step_us: float
    notes: list
    issue_us: float

    @property
    def per_stage(self) -> dict:
        """{stage: ms per step}, summed over the layers."""
        out: dict = {}
        for st in self.per_layer:
            for k, v in st.items():
                out[k] = out.get(k, 0.0) + v
        return out


def _walk(run, reports, prof, topo, tokens: int, info: dict) -> _Walk:
    """Predict each layer of the run's stack with `prof`; sets info's layers and routing."""
    cfg, quant, world = run.cfg, run.quant, run.world
    cands = layer_candidates(run, reports[0])
    info["layers"] = [c.label for c in cands]
    case = CommCase(cfg, quant, topo, prof, None, tokens, tokens)
    per_layer, step_us, prev, stats, how = [], 0.0, None, {}, set()
    e = cfg.num_experts
    # device timing or a replayed graph: every layer's stages are GPU time (queued)
    behind = Backlog(prof, run.timing == "device" or run.cuda_graph, tokens * cfg.hidden * 2.0)
    for l, c in enumerate(cands):
        spec, label = _routing(run, reports, l)
        how.add(label)
        p2l = reports[0].get("phy2log")
        slots = SlotMap.from_placement(p2l, l) if p2l and list(p2l[l]) != list(range(e)) \
            else None
        key = (spec, slots)
        if key not in stats and c.form != "tp":
            stats[key] = routing_stats(cfg, spec, world, topo.gpus_per_node, slots)
        pred = predict_layer(c, Workload(cfg, quant, tokens, spec, slots), topo,
                             behind.profile(l), stats.get(key))
        behind.ran(pred.total_us, c.experts, c.backend)
        relayout = transition_us(prev, c.form, case) if world > 1 else 0.0
        st = {**pred.stages_us, "relayout": relayout}
        if run.routing != "router":  # routing given: the router stage only looks it up
            st["router"] = 0.0
        per_layer.append({k: v / 1e3 for k, v in st.items()})
        step_us += pred.total_us - pred.stages_us["router"] + st["router"] + relayout
        prev = c.form
    info["routing"] = "; ".join(sorted(how))
    return _Walk(per_layer, step_us, [behind.note()] if behind.note() else [],
                 sum(behind.issued))


def compare(measured: dict, predicted: dict | None) -> tuple[dict, list[str]]:
    """({stage: predicted / measured or None}, stages measured below the noise floor)."""
    names = list(measured) + [k for k, v in (predicted or {}).items()
                              if k not in measured and v > 0]
    ratio = {}
    for k in names:
        m, p = measured.get(k), (predicted or {}).get(k)
        ratio[k] = p / m if p is not None and m else None
    low = [k for k in names if (measured.get(k) or 0.0) < NOISE_FLOOR_MS]
    return ratio, low


def attach(summary: dict, run, reports: list[dict], planning) -> None:
    """Add the predictions (and the plan, with --plan) to a launch summary."""
    t = summary["timing"]
    pred = predict_run(run, reports, planning)
    ratio, low = compare(t["stages_ms"], pred["predicted_ms"])
    step, issue = pred["predicted_step_ms"], pred.get("predicted_issue_ms")
    t.update(pred, ratio=ratio if pred["predicted_ms"] is not None else None,
             step_ratio=step / t["step_ms_median"] if step and t["step_ms_median"] else None,
             issue_ratio=issue / t["host_issue_ms_median"]
             if issue and t.get("host_issue_ms_median") else None,
             noise_floor_ms=NOISE_FLOOR_MS, below_noise_floor=low)
    if planning.plan is not None:
        summary["plan"] = plan_summary(planning)


def plan_summary(planning) -> dict:
    plan, bucket = planning.plan, planning.bucket
    layers = []
    for e in plan.layers:
        c = e.choice(planning.tokens)
        layers.append(dict(layer=e.layer, choice=c.label, predicted_ms=c.predicted_us / 1e3,
                           why=c.why, runner_up=c.runner_up,
                           runner_up_ms=None if c.runner_up_us is None
                           else c.runner_up_us / 1e3))
    return dict(mode=planning.mode, tokens_per_rank=planning.tokens, bucket=bucket,
                profile=planning.profile.name, topology=planning.topology.describe(),
                notes=list(planning.notes), layers=layers, plan=plan.to_dict())


# ---------------------------------------------------------------------------------- rendering
def render_plan(p: dict, console) -> None:
    """The plan the run followed: per run of equal layers, the choice and its reason."""
    from epmoe.plan.__main__ import render

    console.print(f"plan: --plan {p['mode']}, {p['tokens_per_rank']} tokens/rank -> bucket "
                  f"{p['bucket']}", markup=False)
    for note in p.get("notes", []):  # where the profile and topology came from, re-plans
        console.print(f"  {note}", markup=False)
    console.print(render(Plan.from_dict(p["plan"]), buckets=[p["bucket"]]), markup=False,
                  soft_wrap=True)
