"""`python -m epmoe.sim`: the planner's cost model at scales we cannot run.

    python -m epmoe.sim [SWEEP.toml|SWEEP.json] [--out DIR] [--json]
        a sweep (default: the packaged DeepSeek-V3 one) -> table, DIR/sim.json, DIR/*.png
    python -m epmoe.sim validate [--table FILE ...] [--profile P] [--json]
        predict published tables (default: the shipped ones in epmoe/sim/published/, DeepEP
        v1 on H800 and on H100) from the spec profiles; print the error per row

Exit codes: 0 done, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

DEFAULT_SWEEP = Path(__file__).parent / "sweeps" / "deepseek-v3.toml"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.sim", description=(
        "Predict MoE step time, comm share and bytes per link over a sweep of GPUs and EP "
        "sizes (a model, not a measurement), or validate against DeepEP's published tables."))
    p.add_argument("sweep", nargs="?", default=str(DEFAULT_SWEEP),
                   help="sweep file (.toml or .json), or 'validate'")
    p.add_argument("--out", default=None, help="directory for sim.json and the PNG plots")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--profile", default=None,
                   help="validate: predict every row with this profile (default: each table's "
                        "GPU's spec profile)")
    p.add_argument("--table", action="append", default=None,
                   help="validate: a published-table TOML file (repeatable; default: the "
                        "shipped tables; the format is in epmoe/sim/validate.py)")
    return p


def _validate(args) -> int:
    from epmoe.sim.validate import table, validate

    res = validate(args.table, args.profile)
    if args.json:
        print(json.dumps([{**asdict(r.row), "predicted": r.predicted, "error": r.error,
                           "kernel_us": r.kernel_us, "limit": r.limit} for r in res], indent=1))
    else:
        print(table(res, args.profile))
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.sweep == "validate":
            return _validate(args)
        from epmoe.sim.sweep import Sweep, run, table

        sweep = Sweep.load(args.sweep)
        rows = run(sweep)
    except (ValueError, KeyError) as exc:
        print(f"error: {str(exc).strip(chr(34))}", file=sys.stderr)
        return 2
    doc = {"sweep": asdict(sweep), "rows": rows,
           "note": "predicted by epmoe.plan.cost from the named profiles; not measured"}
    if args.out:
        from epmoe.sim.plots import plot

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sim.json").write_text(json.dumps(doc, indent=1) + "\n")
        paths = plot(rows, out, sweep.name)
        print(f"wrote {out / 'sim.json'} and {', '.join(p.name for p in paths)}",
              file=sys.stderr)
    print(json.dumps(doc, indent=1) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
