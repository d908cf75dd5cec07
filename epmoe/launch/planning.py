"""`launch --plan / --topology / --profile`: the planner inside a launch.

| --plan      | every MoE layer runs                                                        |
|-------------|-----------------------------------------------------------------------------|
| (absent)    | the flags' form (--ep / --tp / --no-dp), --backend and --experts            |
| auto        | the planner's pick per layer for the run's tokens per rank (its bucket)      |
| tp, ep,     | that form; the planner picks the comm backend and experts kernel per layer   |
| ep_dp       |                                                                             |
| FILE        | a plan file (python -m epmoe.plan --out FILE), validated before any worker   |
| sweep       | every feasible uniform stack, one launch each (epmoe.launch.sweep)           |

With --plan, --tokens is per rank (the planner's unit) and --ep N is the rank count. --tp N
is accepted only with --plan tp and --no-dp only with --plan ep (they say the same); other
combinations exit 2. --backend / --experts other than auto restrict the planner's choice;
--eplb keeps it to the expert-parallel forms. A plan file's model, recipe, rank count and
layer count are taken from the file when those flags are left at their defaults, and must
agree with it otherwise (exit 2).

Topology: --topology NxG|FILE, else where the ranks land: the Ray driver's node id per rank
(`at_where`, which re-plans when that differs from the one node assumed before the start);
one node of one rank in-process. Profile: --profile NAME|FILE, else by device: h200 on an
H200, cpu on CPU ranks, the named GPU's spec profile (h100, h800, h20, b200, gb200), else the
nearest one by compute capability, with a warning. Every launch predicts with them
(epmoe.launch.plan_report), with or without --plan.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

from epmoe.config import DEFAULT_PRESET
from epmoe.launch.device_profile import device_and_arch, profile_for_device, timing_kind
from epmoe.launch.planned_routing import PlannedRouting, planned_routing
from epmoe.plan import Candidate, HardwareProfile, Plan, Topology, load_profile, plan_stack
from epmoe.plan.comm_cost import migration_links
from epmoe.plan.planner import rule_violation
from epmoe.plan.run import RunConfig
from epmoe.plan.topology import LINK_SPECS, local_cores

MODES = ("auto", "tp", "ep", "ep_dp", "sweep")


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("planning (README 'Planning')")
    g.add_argument("--plan", default=None, metavar="auto|tp|ep|ep_dp|sweep|FILE",
                   help="auto: the planner picks each layer's form, backend and experts; "
                        "tp|ep|ep_dp: that form everywhere, the planner picks the rest; FILE: "
                        "a plan file; sweep: launch every feasible uniform stack and compare "
                        "with the planner. --tokens is then per rank, --ep N the rank count")
    g.add_argument("--topology", default=None, metavar="NxG|FILE",
                   help="nodes x GPUs per node for the planner and the predictions "
                        "(default: where the ranks land)")
    g.add_argument("--profile", default=None, metavar="NAME|FILE",
                   help="hardware profile (default by device: h200 on an H200, cpu on CPU, "
                        "else the nearest spec profile)")
    g.add_argument("--sweep-budget-s", type=float, default=600.0,
                   help="--plan sweep: no new launch after this many seconds (default 600)")


def _timing(run: RunConfig) -> str:
    return timing_kind(run.timing, run.cuda_graph)


def _setup(run: RunConfig, nodes: int) -> str:
    return f"{run.world} rank(s) on {nodes} node(s), {_timing(run)} timing"


def _topology_gpu(prof: HardwareProfile) -> str:
    return prof.gpu if prof.gpu in LINK_SPECS else "h200"


def _cores(gpu: str, cores: int) -> dict:
    """CPU ranks share their node's cores (Topology.cores_per_node); device ranks do not."""
    return {"cores_per_node": cores} if gpu == "cpu" else {}


def _where_cores(where: list[dict]) -> int:
    """The fewest cores any rank's node has (ranks report theirs; else this machine's)."""
    return min(int(w.get("cpus") or local_cores()) for w in where)


def _with_links(run: RunConfig, planning: "Planning") -> RunConfig:
    """An EPLB run's migration links: its profile's figures on its topology."""
    if not run.eplb:
        return run
    return run.replace(eplb_links=migration_links(planning.profile, planning.topology))


# ---------------------------------------------------------------------------- the launch's plan
@dataclass(frozen=True)
class Planning:
    """What a launch plans and predicts with.

    mode      None (the flags decide), auto, tp, ep, ep_dp or file
    tokens    tokens per rank: the plan's bucket key
    plan      the Plan the run follows (None without --plan)
    notes     one line each: where the profile and topology came from, warnings, re-plans
    restrict  plan_stack keywords (forms, backends, experts, available) for a re-plan
    routing   the routing the planner plans for (epmoe.launch.planned_routing)
    """

    mode: str | None
    profile: HardwareProfile
    topology: Topology
    tokens: int
    plan: Plan | None = None
    notes: tuple[str, ...] = ()
    given_profile: bool = False
    given_topology: bool = False
    restrict: dict = field(default_factory=dict)
    routing: PlannedRouting = field(default_factory=PlannedRouting)

    @property
    def bucket(self) -> int | None:
        if self.plan is None:
            return None
        return next((b for b in self.plan.buckets if self.tokens <= b), self.plan.buckets[-1])


class PlannedLaunch:
    """A launch's run and planning; `at_where` is the driver's hook between the ranks'
    start and their build (the run may be re-planned there), `attach` the report's."""

    def __init__(self, run: RunConfig, planning: Planning):
        self.run, self.planning = _with_links(run, planning), planning

    def at_where(self, where: list[dict]) -> RunConfig:
        """The ranks' node ids and device -> topology and profile; re-plan if they changed."""
        p = self.planning
        topo, prof, notes = p.topology, p.profile, list(p.notes)
        if not p.given_topology:
            topo = Topology.from_node_ids([w["node_id"] for w in where], gpu=topo.gpu,
                                          intra=topo.intra,
                                          **_cores(topo.gpu, _where_cores(where)))
        name, warn = profile_for_device(where[0]["device"], 0, self.run.world, topo.num_nodes,
                                        _timing(self.run))
        if not p.given_profile and name != prof.name:
            prof = load_profile(name)
            notes += [f"profile {name}: by the ranks' device ({where[0]['device']}), "
                      f"{_setup(self.run, topo.num_nodes)}"]
            notes += [warn] if warn else []
            topo = replace(topo, gpu=_topology_gpu(prof), links={},
                           intra="tcp" if prof.gpu == "cpu" else "nvlink",
                           cores_per_node=_cores(prof.gpu, _where_cores(where)).get(
                               "cores_per_node", 0))
        if topo == p.topology and prof is p.profile:
            return self.run
        notes.append(f"topology {topo.describe()}: where the ranks landed")
        plan = p.plan
        if p.mode not in (None, "file"):
            from epmoe.launch.driver import ClusterTooSmall

            try:
                plan = make_plan(self.run, topo, prof, p.tokens, p.restrict, p.routing)
            except ValueError as exc:
                raise ClusterTooSmall(f"--plan {p.mode} on the cluster's topology: {exc}") \
                    from None
            notes.append(f"re-planned for {topo.describe()}")
            self.run = planned_run(self.run, plan, p.tokens)
        self.planning = replace(p, topology=topo, profile=prof, plan=plan, notes=tuple(notes))
        self.run = _with_links(self.run, self.planning)
        return self.run

    def attach(self, summary: dict, run: RunConfig, reports: list[dict]) -> None:
        from epmoe.launch.plan_report import attach

        attach(summary, run, reports, self.planning)


def prepare(a: argparse.Namespace, build_run) -> PlannedLaunch:
    """Flags -> the run and its planning, every rule checked before any worker exists
    (ValueError: exit 2). build_run: the CLI's flags -> RunConfig."""
    if a.plan is None:
        run = build_run(a)
        return PlannedLaunch(run, context(a, run, None, run.tokens))
    mode = a.plan if a.plan in MODES else "file"
    if mode == "sweep":
        raise ValueError("--plan sweep runs through epmoe.launch.sweep, not a single launch")
    world, file_plan, over = _check_combination(a, mode)
    base = build_run(argparse.Namespace(**{**vars(a), **over, "ep": 1, "tp": 1, "dp": True,
                                           "backend": "auto"}))
    base = base.replace(world=world)
    ctx = context(a, base, mode, a.tokens)
    if world == 1 and mode in ("tp", "ep"):  # one rank: the forms are one computation
        ctx = replace(ctx, notes=ctx.notes + (f"one rank: {mode} computes what ep_dp does; "
                                              f"planned as ep_dp",))
        mode = "ep_dp"
    restrict = planner_scope(a, base, mode)
    if file_plan is not None:
        check_plan_file(file_plan, base, ctx, a.plan)
        plan = file_plan
    else:
        plan = make_plan(base, ctx.topology, ctx.profile, a.tokens, restrict, ctx.routing)
    return PlannedLaunch(planned_run(base, plan, a.tokens),
                         replace(ctx, plan=plan, restrict=restrict))


def _check_combination(a, mode: str):
    """-> (world, the plan file or None, flag overrides from the file)."""
    if a.ep > 1 and a.tp > 1:
        raise ValueError(f"--ep {a.ep} with --tp {a.tp}: give the rank count once (--ep N)")
    if a.tp > 1 and mode != "tp":
        raise ValueError(f"--tp {a.tp} asks every layer to run tp, but --plan {a.plan} decides "
                         f"the forms: give the rank count with --ep {a.tp} (or use --plan tp)")
    if not a.dp and mode != "ep":
        raise ValueError(f"--no-dp asks every layer to run ep, but --plan {a.plan} decides the "
                         f"forms: drop --no-dp (or use --plan ep)")
    world = max(a.ep, a.tp)
    if mode != "file":
        return world, None, {}
    plan = Plan.load(a.plan)
    over = {}
    for flag, mine, theirs, default in (
            ("--model", a.model, plan.model, DEFAULT_PRESET),
            ("--quant", a.quant, plan.quant.recipe, "bf16"),
            ("--scale-fmt", a.scale_fmt, plan.quant.scale_fmt, "fp32"),
            ("--layers", a.layers, len(plan.layers), None),
            ("--ep", world, plan.world, 1)):
        if mine != default and mine != theirs:
            raise ValueError(f"{flag} {mine} disagrees with the plan file {a.plan!r} "
                             f"({theirs}): drop {flag} (the file decides) or write the plan "
                             f"again with python -m epmoe.plan ... --out {a.plan}")
    over.update(model=plan.model, quant=plan.quant.recipe, scale_fmt=plan.quant.scale_fmt,
                layers=len(plan.layers))
    return plan.world, plan, over


def context(a, run: RunConfig, mode: str | None, tokens: int) -> Planning:
    """The profile and the topology (given, or assumed: one node of the run's ranks)."""
    notes = []
    if a.profile:
        prof = load_profile(a.profile)
        notes.append(f"profile {prof.name}: given")
    else:
        dev, arch = device_and_arch(getattr(a, "device", "auto"))
        name, warn = profile_for_device(dev, arch, run.world, 1, _timing(run))
        prof = load_profile(name)
        notes += [f"profile {name}: by device ({dev}), {_setup(run, 1)}"] + \
            ([warn] if warn else [])
    gpu = _topology_gpu(prof)
    if a.topology:
        topo = Topology.resolve(a.topology, gpu)
        if topo.world != run.world:
            raise ValueError(f"--topology {a.topology} holds {topo.world} ranks but the run has "
                             f"{run.world}: give a topology of {run.world} ranks (e.g. "
                             f"1x{run.world}) or change --ep")
        notes.append(f"topology {topo.describe()}: given")
    else:
        topo = Topology.parse(f"1x{run.world}", gpu, **_cores(gpu, local_cores()))
    routing = planned_routing(run) if mode not in (None, "file") else PlannedRouting()
    notes += [routing.note] if routing.note else []
    return Planning(mode, prof, topo, tokens, None, tuple(notes), bool(a.profile),
                    bool(a.topology), routing=routing)


def planner_scope(a, run: RunConfig, mode: str) -> dict:
    """plan_stack keywords: the forms the mode allows, the flags' restrictions, and what this
    machine can run (checked only with local CUDA and a local cluster)."""
    forms = (mode,) if mode in ("tp", "ep", "ep_dp") else ("ep", "ep_dp") if run.eplb else None
    backends = None if a.backend == "auto" else (a.backend, "local")
    experts = None if a.experts == "auto" else (a.experts,)
    if run.cuda_graph:  # only what a captured step can run (epmoe/graph.py)
        forms, backends, experts = _capturable(mode, forms, backends, experts)
    available = None
    if getattr(a, "address", None) is None:
        available, runnable = runnable_here(run, getattr(a, "device", "auto"), a.experts)
        if runnable is not None:
            keep = tuple(e for e in experts or runnable if e in runnable)
            if not keep:
                raise ValueError(f"--experts {a.experts} cannot run on this machine (it runs "
                                 f"{', '.join(runnable)}): pick one of those or auto")
            experts = keep
    return dict(forms=forms, backends=backends, experts=experts, available=available)


def _capturable(mode: str, forms, backends, experts):
    """The planner's choices narrowed to what --cuda-graph captures; ValueError when the
    mode allows no form that can be captured."""
    from epmoe.graph import CAPTURABLE_BACKENDS, CAPTURABLE_EXPERTS

    if forms is not None and "ep_dp" not in forms:
        raise ValueError(f"--plan {mode} with --cuda-graph: a captured step runs ep_dp layers "
                         f"only; use --plan auto or ep_dp")
    return (("ep_dp",), tuple(b for b in backends or CAPTURABLE_BACKENDS
                              if b in CAPTURABLE_BACKENDS),
            tuple(e for e in experts or CAPTURABLE_EXPERTS if e in CAPTURABLE_EXPERTS))


def runnable_here(run: RunConfig, device_flag: str = "auto", experts_flag: str = "auto"):
    """(comm backends, experts kernels) the ranks of a local run can run: on this machine's
    first GPU, or on its CPUs (--device cpu, or no CUDA: a GPU profile given with --profile
    must not plan a CUDA backend for CPU ranks; Triton there is its interpreter, planned only
    when --experts triton asks for it)."""
    import torch

    from epmoe.comm import BACKENDS, backend_class

    cuda = device_flag != "cpu" and torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    comm = {"local"}
    for name in BACKENDS:
        try:
            if backend_class(name).supports(run.cfg, run.quant, dev, run.world) is None:
                comm.add(name)
        except (ImportError, OSError, RuntimeError):
            pass
    experts = ["torch", "triton"] if cuda or experts_flag == "triton" else ["torch"]
    try:
        from epmoe.experts.deepgemm_experts import DeepGemmExperts

        if cuda and DeepGemmExperts.supports(run.cfg, run.quant, dev) is None:
            experts.append("deepgemm")
    except (ImportError, OSError, RuntimeError):
        pass
    return frozenset(comm), tuple(experts)


def make_plan(run: RunConfig, topo: Topology, prof: HardwareProfile, tokens: int,
              restrict: dict, routing: PlannedRouting) -> Plan:
    return plan_stack(run.cfg, run.quant, topo, prof, (tokens,), num_layers=run.num_layers,
                      redundant_experts=run.redundant_experts, model=run.model,
                      **routing.plan_kwargs(), **restrict)


def planned_run(base: RunConfig, plan: Plan, tokens: int) -> RunConfig:
    """The run following `plan` at `tokens` per rank (validated)."""
    stack = plan.stack(tokens)
    run = base.replace(stack=stack, form=stack[0].form, tokens=plan.run_tokens(tokens))
    run.validate()
    return run


def gather_conflict(backend: str, experts: str, comm_options) -> str | None:
    """Why a layer of `backend` and `experts` cannot run under these comm options (a gather
    knob of its backend with experts that do not gather), else None."""
    from epmoe.comm.symm.options import GATHER_KNOBS

    for knob, tuned in GATHER_KNOBS.items():
        if dict(comm_options).get(knob) and backend == tuned and experts != "triton":
            return (f"--comm-option {knob} leaves the rows for an expert GEMM that reads them "
                    f"through an index, which only the triton experts do")
    return None


def check_plan_file(plan: Plan, run: RunConfig, ctx: Planning, path: str) -> None:
    """Every entry of every bucket names a candidate the runtime can run here."""
    if plan.scope != "runtime":
        raise ValueError(f"plan file {path!r} has scope {plan.scope!r} (mechanisms epmoe does "
                         f"not run); write it with python -m epmoe.plan --scope runtime")
    slots = run.cfg.num_experts + run.redundant_experts
    if plan.num_slots != slots:
        extra = plan.num_slots - run.cfg.num_experts
        fix = f"plan with --redundant-experts {run.redundant_experts} or give " \
              f"--redundant-experts {extra} here" if extra >= 0 else \
              f"fewer than the model's {run.cfg.num_experts} experts: plan again"
        raise ValueError(f"plan file {path!r} has {plan.num_slots} expert slots but the run has "
                         f"{slots} (experts + --redundant-experts): {fix}")
    topo = Topology.parse(f"1x{run.world}", ctx.topology.gpu) if not ctx.given_topology \
        else ctx.topology
    arch = int(ctx.profile.fig("sm_arch"))
    for i, e in enumerate(plan.layers):
        if e.layer != i:
            raise ValueError(f"plan file {path!r}: entry {i} is layer {e.layer}; list layers "
                             f"0..{len(plan.layers) - 1} in order")
        for bucket, c in e.choices:
            where = f"plan file {path!r}, layer {e.layer}, bucket {bucket}"
            try:
                cand = Candidate(c.form, c.backend, c.experts)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            why = gather_conflict(c.backend, c.experts, run.comm_options)
            if why:
                raise ValueError(f"{where}: {cand.label}: {why}; fix the entry or drop the "
                                 f"option")
            why = rule_violation(cand, run.cfg, run.quant, topo, arch, slots)
            if why:
                raise ValueError(f"{where}: {cand.label} cannot run here: {why}; fix the "
                                 f"entry or plan again with python -m epmoe.plan --out FILE")
