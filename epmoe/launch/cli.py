"""`python -m epmoe.launch` — flags, validation before any worker starts, run, report.

Exit codes: 0 run passed (or was not checked), 1 correctness failed, 2 bad flags / impossible
shapes (including more ranks than the cluster holds), 3 a rank failed or hung (LaunchError).
"""

from __future__ import annotations

import argparse
import json
import sys

from epmoe.comm import CHOICES as BACKENDS
from epmoe.config import DEFAULT_PRESET, PRESETS, RECIPES, SCALE_FMTS, QuantConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m epmoe.launch",
        description="Run a model's MoE stack on N ranks and report correctness (vs a float64 "
                    "oracle), time and balance. One rank runs in-process; more run as Ray actors "
                    "(a local Ray cluster unless --address).")
    g = p.add_argument_group("parallelism")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (default 1)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (form tp)")
    g.add_argument("--dp", action=argparse.BooleanOptionalAction, default=True,
                   help="with --ep > 1: each rank its own tokens (EP+DP, default); --no-dp "
                        "replicates tokens and all-reduces (form ep)")
    g.add_argument("--backend", default="auto", choices=BACKENDS, help="comm backend")
    g.add_argument("--ll-max-tokens", type=int, default=256,
                   help="with --backend auto on CUDA: DeepEP low-latency up to this many tokens "
                        "per rank, high-throughput above (default 256)")
    g.add_argument("--experts", default="auto", choices=("auto", "torch", "triton", "deepgemm"),
                   help="experts backend")
    m = p.add_argument_group("model and data")
    m.add_argument("--model", default=DEFAULT_PRESET, help=f"preset: {', '.join(PRESETS)}")
    m.add_argument("--quant", default="bf16", help=f"recipe: {', '.join(RECIPES)}")
    m.add_argument("--scale-fmt", default="fp32", help=f"fp8_block scales: {', '.join(SCALE_FMTS)}")
    m.add_argument("--tokens", type=int, default=64,
                   help="tokens per rank (EP+DP) or in total (replicated forms)")
    m.add_argument("--layers", type=int, default=None, help="MoE layers (default: the preset's)")
    m.add_argument("--steps", type=int, default=4)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--routing", default="router",
                   help="router (the model's gate) | uniform | zipf:S | drift:S:P | trace:FILE")
    m.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with the float64 oracle (default on)")
    e = p.add_argument_group("EPLB")
    e.add_argument("--eplb", action="store_true", help="record load and rebalance replicas")
    e.add_argument("--redundant-experts", type=int, default=0, help="extra physical slots")
    e.add_argument("--rebalance-every", type=int, default=2, help="steps between rebalances")
    e.add_argument("--eplb-window", type=int, default=8, help="load window in steps")
    e.add_argument("--eplb-migration", default="sync", choices=("sync", "async"),
                   help="sync: weights move while steps wait; async: staged in the background, "
                        "all ranks switch at one step boundary")
    r = p.add_argument_group("cluster and output")
    r.add_argument("--address", default=None, help="join an existing Ray cluster (ray://... or "
                                                   "host:port); default: start a local one")
    r.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    r.add_argument("--timeout", type=float, default=120.0,
                   help="seconds any stage may take before the run is declared hung")
    r.add_argument("--out", default=None, help="write the JSON summary here")
    r.add_argument("--json", action="store_true", help="print the JSON summary to stdout")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    from epmoe.launch.planning import add_args

    add_args(p)  # --plan, --topology, --profile
    return p


def build_run(a: argparse.Namespace):
    """Flags -> RunConfig, with every rule checked here, before any worker exists."""
    from epmoe.config import get_preset
    from epmoe.plan.run import RunConfig

    if a.ep < 1 or a.tp < 1:
        raise ValueError(f"--ep ({a.ep}) and --tp ({a.tp}) must be >= 1")
    if a.ep > 1 and a.tp > 1:
        raise ValueError(f"--ep {a.ep} with --tp {a.tp}: one parallel form per run (the planner "
                         f"mixes them per layer); pick --ep or --tp")
    get_preset(a.model)
    if a.quant not in RECIPES:
        raise ValueError(f"--quant {a.quant!r} is not a recipe; choose one of {', '.join(RECIPES)}")
    quant = QuantConfig(a.quant, a.scale_fmt)
    if a.tp > 1:
        form, world = "tp", a.tp
    elif a.ep > 1:
        form, world = ("ep_dp" if a.dp else "ep"), a.ep
    else:
        form, world = "ep_dp", 1
    if a.redundant_experts and not a.eplb:
        raise ValueError("--redundant-experts needs --eplb (replicas are placed by EPLB)")
    if a.eplb and form == "tp":
        raise ValueError("--eplb places experts across EP ranks: use --ep, not --tp")
    if a.ll_max_tokens < 1:
        raise ValueError(f"--ll-max-tokens ({a.ll_max_tokens}) must be >= 1")
    if a.timeout <= 0:
        raise ValueError(f"--timeout ({a.timeout}) must be > 0 seconds")
    if a.rebalance_every < 1:
        raise ValueError(f"--rebalance-every ({a.rebalance_every}) must be >= 1")
    run = RunConfig(model=a.model, quant=quant, form=form, world=world, backend=a.backend,
                    experts=a.experts, tokens=a.tokens, layers=a.layers, steps=a.steps,
                    seed=a.seed, routing=a.routing, redundant_experts=a.redundant_experts,
                    timeout_s=a.timeout, check=a.check, ll_max_tokens=a.ll_max_tokens,
                    eplb=a.eplb, eplb_window=a.eplb_window, eplb_migration=a.eplb_migration)
    run.validate()
    if run.routing != "router":
        from epmoe.eplb.routing import make_routing

        make_routing(run.routing, 1, run.cfg.num_experts, run.cfg.top_k, 2, 0, run.seed)
    if (form != "ep_dp" or world == 1) and a.backend not in ("auto", "local"):
        raise ValueError(f"--backend {a.backend} moves tokens between ranks, which form {form} "
                         f"on {world} rank(s) does not do: use --ep > 1 with --dp, or "
                         f"--backend auto")
    return run


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.plan == "sweep":
        from epmoe.launch.sweep import main as sweep

        return sweep(a)
    from epmoe.launch.planning import prepare

    try:
        launch = prepare(a, build_run)  # build_run, or the planner's run with --plan
        run = launch.run
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from epmoe.launch.driver import ClusterTooSmall, LaunchError, driver_for
    from epmoe.launch.report import render, summarize

    use_gpu = {"auto": None, "cpu": False, "cuda": True}[a.device]
    try:
        with driver_for(run, a.address, quiet=a.quiet, use_gpu=use_gpu,
                        on_where=launch.at_where) as d:
            if a.eplb:
                from epmoe.launch.eplb_run import execute_eplb

                reports, where, extra = execute_eplb(d, run, a)
            else:
                reports, where = d.execute()
                extra = None
            run = d.run  # as built: at_where may re-plan for the cluster's topology
    except ClusterTooSmall as e:  # impossible shape for this cluster, found before any worker
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    summary = summarize(run, reports, where, extra)
    launch.attach(summary, run, reports)  # predicted vs measured (and the plan)
    if not a.json:
        render(summary)
    text = json.dumps(summary, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    if a.json:
        print(text)
    c = summary["correctness"]
    return 1 if c.get("checked") and not c["passed"] else 0
