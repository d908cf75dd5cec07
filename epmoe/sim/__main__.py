"""`python -m epmoe.sim`: the planner's cost model at scales we cannot run.

    python -m epmoe.sim [SWEEP.toml|SWEEP.json] [--out DIR] [--json]
        a sweep (default: the packaged DeepSeek-V3 one) -> table, DIR/sim.json, DIR/*.png
    python -m epmoe.sim SWEEP --run GPU [--address A] [--run-steps N] [--run-timeout S]
        also launch the sweep's GPU rows for real (python -m epmoe.launch per row, on the
        --address Ray cluster or a private one each) and put the measurement beside the
        prediction (table, sim.json, the step plot)
    python -m epmoe.sim validate [--table FILE ...] [--profile P] [--json]
        predict published tables (default: the shipped ones in epmoe/sim/published/, DeepEP
        v1 on H800 and on H100) from the spec profiles; print the error per row
    python -m epmoe.sim drift [--routing drift:S:P] [--every N] [--ep N] ... [--out DIR]
        EPLB over a run whose routing drifts: step time without redundancy, with a
        rebalance every N steps (and the moves it pays for), and placed for its own load
        (epmoe/sim/drift.py; --help lists the options)

Exit codes: 0 done, 2 bad input (one line on stderr); with --run also 1 a launch failed its
oracle check, 3 no launch succeeded.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

from epmoe.argtypes import at_least, given_flags, seconds
from epmoe.outputs import json_text, run_main, writable_dir

DEFAULT_SWEEP = Path(__file__).parent / "sweeps" / "deepseek-v3.toml"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.sim", description=(
        "Predict MoE step time, comm share and bytes per link over a sweep of GPUs and EP "
        "sizes (a model, not a measurement), or validate against DeepEP's published tables."))
    p.add_argument("sweep", nargs="?", default=str(DEFAULT_SWEEP),
                   help="sweep file (.toml or .json), 'validate', or 'drift' (python -m "
                        "epmoe.sim drift --help: EPLB over a drifting run)")
    p.add_argument("--out", default=None, type=writable_dir,
                   help="directory for sim.json and the PNG plots")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--profile", default=None,
                   help="validate: predict every row with this profile (default: each table's "
                        "GPU's spec profile)")
    p.add_argument("--table", action="append", default=None,
                   help="validate: a published-table TOML file (repeatable; default: the "
                        "shipped tables; the format is in epmoe/sim/validate.py)")
    run = p.add_argument_group("running the sweep for real (--run)")
    run.add_argument("--run", metavar="GPU", default=None,
                     help="launch the rows of this sweep gpu (the cluster's profile: cpu, "
                          "h200, ...) with python -m epmoe.launch and report the measurement")
    run.add_argument("--address", default=None,
                     help="the Ray cluster to launch on (default: a private one per launch)")
    run.add_argument("--run-steps", type=at_least(2), default=None,
                     help="steps per launch (default 4; step 0 is warm-up)")
    run.add_argument("--run-timeout", type=seconds, default=None,
                     help="seconds per launch before it is stopped (default 600)")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                     help="the launches' --device (default auto)")
    return p


def _validate(args) -> int:
    from epmoe.sim.validate import table, validate

    res = validate(args.table, args.profile)
    if args.json:
        print(json_text([{**asdict(r.row), "predicted": r.predicted, "error": r.error,
                          "kernel_us": r.kernel_us, "limit": r.limit} for r in res]))
    else:
        print(table(res, args.profile))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["drift"]:
        from epmoe.sim.drift_cli import main as drift_main

        return drift_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        _check_modes(args)
        if args.sweep == "validate":
            return _validate(args)
        from epmoe.sim.sweep import Sweep, run, table

        sweep = Sweep.load(args.sweep)
        opts = _measure_options(args, sweep)
        from epmoe.launch.console import Phases

        rows = run(sweep, Phases().counter("points predicted"))
    except (ValueError, KeyError) as exc:
        print(f"error: {str(exc).strip(chr(34))}", file=sys.stderr)
        return 2
    code = 0
    if opts is not None:
        from epmoe.launch.errors import stop_signals_interrupt
        from epmoe.sim import measure

        with stop_signals_interrupt() as stop:
            try:
                rows = measure.measure(rows, sweep, opts)
            except KeyboardInterrupt:  # the launch under way is killed; its reaper cleans up
                return stop.exit()
        code = measure.exit_code(rows)
    recipe, why = sweep.recipe()
    note = textwrap.fill(f"note: {why}; planned as {recipe} (quant = ... in the sweep file to "
                         f"choose)", 80, subsequent_indent="  ") if why else ""
    doc = {"sweep": asdict(sweep), "recipe": recipe, "rows": rows,
           "note": "step_ms etc. predicted by epmoe.plan.cost from the named profiles; "
                   "rows[].measured (with --run) measured by python -m epmoe.launch"}
    if args.out:
        from epmoe.sim.plots import plot

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sim.json").write_text(json_text(doc) + "\n")
        paths = plot(rows, out, sweep.name)
        print(f"wrote {out / 'sim.json'} and {', '.join(p.name for p in paths)}",
              file=sys.stderr)
    if args.json:
        print(json_text(doc))
        if note:  # stdout stays one JSON document
            print(note, file=sys.stderr)
    else:
        print(table(rows) + (f"\n{note}" if note else ""))
        if opts is not None:
            print("\n" + measure.table(rows))
    return code


RUN_ONLY = ("address", "run_steps", "run_timeout", "device")  # --run's options


def _check_modes(args) -> None:
    """Options of the other mode are refused, not ignored (a sweep given --profile h100 would
    otherwise be predicted with its file's gpus, silently)."""
    if args.sweep == "validate":
        if given := given_flags(args, ("run", *RUN_ONLY)):
            raise ValueError(f"{', '.join(given)}: validate predicts the published tables; "
                             f"--run and its options apply to a sweep file")
        return
    if given := given_flags(args, ("table", "profile")):
        raise ValueError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to "
                         f"`python -m epmoe.sim validate`; a sweep file names its gpus "
                         f"(profiles) itself")
    if args.run is None and (given := given_flags(args, RUN_ONLY)):
        raise ValueError(f"{', '.join(given)} need{'' if len(given) > 1 else 's'} --run GPU "
                         f"(which sweep rows to launch)")


def _measure_options(args, sweep):
    """--run's options, checked before anything is predicted or launched."""
    if args.run is None:
        return None
    from epmoe.sim.measure import MeasureOptions

    if args.run not in sweep.gpus:
        raise ValueError(f"--run {args.run!r} is not one of the sweep's gpus {list(sweep.gpus)}")
    if args.address:
        from epmoe.launch.cluster import parse_address

        parse_address(args.address)
    defaults = MeasureOptions(args.run)
    return MeasureOptions(args.run, args.address, args.run_steps or defaults.steps,
                          args.run_timeout or defaults.timeout_s, args.device or defaults.device)


if __name__ == "__main__":
    run_main(main)
