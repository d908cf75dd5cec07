"""`python -m epmoe.launch` — flags, validation before any worker starts, run, report.

Exit codes: 0 the run passed (or was not checked), 1 correctness failed (the output differs
from the float64 oracle by more than the recipe's tolerance), 2 bad input found before anything
started (flags, files, shapes, an address nothing answers at, a cluster too small), 3 a rank
failed or hung (named with its stage, and the ranks that were only waiting).
"""

from __future__ import annotations

import argparse
import sys

from epmoe.comm import CHOICES as BACKENDS
from epmoe.config import DEFAULT_PRESET, PRESETS, RECIPES, SCALE_FMTS
from epmoe.launch.checks import build_run  # noqa: F401  (the flags -> RunConfig rules)
from epmoe.outputs import json_text

EXIT_OK, EXIT_INCORRECT, EXIT_INPUT, EXIT_FAILED = 0, 1, 2, 3


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every default shown, in the help's own words where it states it (flags whose None means
    "not given": refused beside flags they mean nothing with: checks._check_paired)."""

    def _get_help_string(self, action):
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m epmoe.launch", formatter_class=_Help,
        description="Run a model's MoE stack on N ranks and report correctness (vs a float64 "
                    "oracle), time and balance. One rank runs in this process; more run as Ray "
                    "actors on a private local Ray cluster (loopback only, token auth) unless "
                    "--address. Exit codes: 0 ok, 1 correctness failed, 2 bad input (nothing "
                    "started), 3 a rank failed or hung.")
    g = p.add_argument_group("parallelism")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel ranks")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (form tp)")
    g.add_argument("--dp", action=argparse.BooleanOptionalAction, default=True,
                   help="with --ep > 1: each rank its own tokens (EP+DP); --no-dp replicates "
                        "tokens and all-reduces (form ep)")
    g.add_argument("--backend", default="auto", choices=BACKENDS, help="comm backend")
    g.add_argument("--ll-max-tokens", type=int, default=None,
                   help="with --backend auto on CUDA: DeepEP low-latency up to this many tokens "
                        "per rank, high-throughput above (default: 256)")
    g.add_argument("--comm-option", action="append", default=[], metavar="KNOB=VALUE",
                   help="a symm-ht / symm-ll tuning knob (SymmOptions; repeatable), e.g. "
                        "ll_dedup=1 (symm-ll sends a token once per rank), num_sms=32")
    g.add_argument("--experts", default="auto", choices=("auto", "torch", "triton", "deepgemm"),
                   help="experts backend")
    g.add_argument("--micro-batches", type=int, default=1, choices=(1, 2),
                   help="2: split each layer's tokens in two so that one half's dispatch / "
                        "combine overlaps the other half's expert GEMMs (meant for ep >= 2)")
    g.add_argument("--timing", default="launched", choices=("launched", "device"),
                   help="launched: step and stages as a synchronized step runs them (the "
                        "host's launch time included); device: the GPU's time, the host "
                        "issuing the step ahead of it (its issue time reported beside)")
    g.add_argument("--cuda-graph", action="store_true",
                   help="replay steps 1.. from one CUDA graph per rank, captured after the "
                        "eager step 0 (ep_dp layers; --backend local, symm-ht or symm-ll; "
                        "--experts triton or deepgemm; --plan keeps to those; with --eplb "
                        "captured again after each placement switch)")
    m = p.add_argument_group("model and data")
    m.add_argument("--model", default=DEFAULT_PRESET,
                   help=f"preset ({', '.join(PRESETS)}), or a Hugging Face config.json "
                        f"(or the folder holding it)")
    m.add_argument("--weights", default=None, metavar="DIR",
                   help="read the layers' weights from this Hugging Face checkpoint folder "
                        "(safetensors + config.json; every rank reads it: on a cluster, a path "
                        "every node sees) instead of synthetic ones; --model defaults to it")
    m.add_argument("--quant", default="bf16", help=f"recipe: {', '.join(RECIPES)}")
    m.add_argument("--scale-fmt", default="fp32", help=f"fp8_block scales: {', '.join(SCALE_FMTS)}")
    m.add_argument("--tokens", type=int, default=64,
                   help="tokens per rank (EP+DP) or in total (replicated forms)")
    m.add_argument("--layers", type=int, default=None, help="MoE layers (None: the preset's)")
    m.add_argument("--steps", type=int, default=4, help="steps (step 0 is warm-up)")
    m.add_argument("--seed", type=int, default=0, help="seed of weights, tokens and routing")
    m.add_argument("--routing", default="router",
                   help="router (the model's gate) | uniform | zipf:S | drift:S:P | trace:FILE")
    m.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with the float64 oracle")
    e = p.add_argument_group("EPLB")
    e.add_argument("--eplb", action="store_true", help="record load and rebalance replicas")
    e.add_argument("--redundant-experts", type=int, default=0, help="extra physical slots")
    e.add_argument("--rebalance-every", type=int, default=None,
                   help="steps between rebalances (default: 2)")
    e.add_argument("--eplb-window", type=int, default=None,
                   help="load window in steps (default: 8)")
    e.add_argument("--eplb-migration", default=None, choices=("sync", "async"),
                   help="sync: weights move while steps wait; async: staged in the "
                        "background, all ranks switch at one step boundary (default: sync)")
    r = p.add_argument_group("cluster and output")
    r.add_argument("--address", default=None,
                   help="join this Ray cluster (host:port of the head's GCS, or ray://host:port) "
                        "with its own authentication; None: a private local cluster")
    r.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the ranks run (auto: CUDA if the machine/cluster has GPUs)")
    r.add_argument("--ranks-per-gpu", type=int, default=1,
                   help="ranks sharing each GPU (time-sliced by the driver; gloo process "
                        "group; --backend symm-ht or symm-ll): checks a multi-rank run on "
                        "fewer GPUs; its times are not speeds")
    r.add_argument("--timeout", type=float, default=120.0,
                   help="seconds any stage (connecting, start, build, a step, a rebalance) may "
                        "take before the run is declared hung")
    r.add_argument("--start-timeout", type=float, default=None,
                   help="seconds starting the ranks (placement, actors up, process group) may "
                        "take before the run is declared hung (default: the larger of "
                        "--timeout and 300: imports and CUDA init on a cold cluster are slow)")
    r.add_argument("--out", default=None, help="write the JSON summary here (also on failure)")
    r.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNG plots here: load heatmap, EPLB balancedness, stage times")
    r.add_argument("--json", action="store_true", help="print the JSON summary to stdout")
    r.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    from epmoe.launch.planning import add_args

    add_args(p)  # --plan, --topology, --profile, --sweep-budget-s
    return p


def main(argv=None) -> int:
    from epmoe.launch.errors import stop_signals_interrupt

    with stop_signals_interrupt() as stop:  # unwind like Ctrl-C: the private cluster stops
        try:
            return _main(argv)
        except KeyboardInterrupt:  # the driver's context stopped what it started
            return stop.exit()


def _main(argv) -> int:
    a = parser().parse_args(argv)
    if a.plan == "sweep":
        from epmoe.launch.sweep import main as sweep

        return sweep(a)
    from epmoe.launch.checks import check_launch, check_runnable, local_device
    from epmoe.launch.errors import LaunchError
    from epmoe.launch.planning import prepare
    from epmoe.memory import check_fits_here

    try:
        launch = prepare(a, build_run)  # the flags' run, or the planner's with --plan
        run = launch.run
        address = check_launch(a, run)
        device = local_device(a)
        if device is not None:
            check_runnable(run, device)
        if address is None and device is not None:  # every rank on this machine
            check_fits_here(run, device)
    except ValueError as e:  # InputError is a ValueError
        return _error(e, EXIT_INPUT)
    from epmoe.launch.console import Phases
    from epmoe.launch.driver import driver_for
    from epmoe.launch.report import summarize

    phases = Phases(quiet=a.quiet)
    use_gpu = {"auto": None, "cpu": False, "cuda": True}[a.device]
    precheck = None if device is not None else (lambda d: check_runnable(run, d))
    try:
        with driver_for(run, address, phases=phases, use_gpu=use_gpu, precheck=precheck,
                        on_where=launch.at_where) as d:
            if a.eplb:
                from epmoe.launch.eplb_run import execute_eplb

                reports, where, extra = execute_eplb(d, run, a)
            else:
                (reports, where), extra = d.execute(), None
            run = d.run  # as built: at_where may re-plan for the cluster's topology
            phases("checking against the float64 oracle" if run.check else "summarizing")
            summary = summarize(run, reports, where, extra, d.solve_checks,
                                phases.counter("layers checked"))
            launch.attach(summary, run, reports)  # predicted vs measured (and the plan)
            summary["timing"]["launch_s"] = dict(d.seconds)
            if d.on_ray:  # while connected: Ray's metrics go through this process
                from epmoe.launch.metrics import RunMetrics

                RunMetrics().record(summary)
    except ValueError as e:  # found after connecting, before any rank started
        return _error(e, EXIT_INPUT)
    except LaunchError as e:
        _write(a.out, dict(failure=e.failure.to_json() if e.failure else dict(message=str(e)),
                           exit_code=EXIT_FAILED))
        return _error(e, EXIT_FAILED)
    except Exception as e:  # a bug of ours: one line, and never exit 1 (that means incorrect)
        return _error(f"{type(e).__name__}: {e} (an internal error of the launcher; "
                      f"EPMOE_LOG_LEVEL=DEBUG shows the traceback)", EXIT_FAILED, trace=True)
    return _finish(a, summary, phases)


def _finish(a, summary: dict, phases) -> int:
    from epmoe.launch.render import render

    c = summary["correctness"]
    code = EXIT_INCORRECT if c.get("checked") and not c["passed"] else EXIT_OK
    summary["exit_code"] = code
    if a.json:  # first: the results are on screen even if a file below cannot be written
        print(json_text(summary, indent=2))
    else:
        render(summary)
    try:  # checked up front; a disk that fills or a folder removed meanwhile lands here
        if a.plot:
            from epmoe.launch.plots import write_plots

            for path in write_plots(summary, a.plot):
                phases(f"wrote {path}")
        _write(a.out, summary)
    except OSError as e:
        return _error(f"the run finished, but writing its outputs failed: {e}", EXIT_FAILED)
    return code


def _write(path: str | None, obj: dict) -> None:
    if path:
        with open(path, "w") as f:
            f.write(json_text(obj, indent=2) + "\n")


def _error(e, code: int, trace: bool = False) -> int:
    from epmoe.env import logger

    if trace:
        logger.debug("traceback", exc_info=True)
    print(f"error: {e}", file=sys.stderr)
    return code
