"""`python -m epmoe.plan.refresh`: bring some kernel fits of a profile up to date from a
fresh calibration, keeping everything else the profile holds.

    python -m epmoe.plan.refresh --into h100-calibrated --from fresh.json --tables router \\
        --out epmoe/plan/profiles/h100-calibrated.json

When a kernel changes (the router's split way, a new permute), its fits in a shipped profile
go stale while the rest of the profile (more sizes, other refreshed tables) stays good. This
takes the named tables' fits from `--from` (a calibration's output on the same GPU kind and
under the same `--timing`) into `--into`:
- each fit of those tables that `--from` measured replaces the one of its name; fits `--from`
  does not have are kept and listed (they may be stale too);
- `--from`'s figures are first put at `--into`'s host (`HardwareProfile.at_host`: the host's
  share of a launched-timing fit scales with the host's speed), so the profile keeps
  describing one host;
- with `--across REASON` the fits may come from another GPU kind's calibration (where the
  kernel's time does not depend on what differs, e.g. H100 for H200: the same SM and
  clocks); they are then written as `derived`, the reason in each note;
- absolute paths in the taken fits' notes are cut to their file names (a machine path is not the
  profile's business) and the description says what was refreshed, when and from what.
Exit codes: 0 written, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from epmoe.outputs import run_main, writable_file
from epmoe.plan.figures import public_note
from epmoe.plan.profile import (AlphaBeta, HardwareProfile, Provenance, from_dict,
                                load_profile, profile_document)

_TIMING = re.compile(r"--timing[ =](\w+)")


@dataclass(frozen=True)
class Refreshed:
    """The profile with the tables' fits taken from the fresh one, and what happened."""

    profile: HardwareProfile
    taken: tuple[str, ...]  # "table.name" replaced or added
    kept: tuple[str, ...]  # "table.name" left as they were (not measured, or not named)
    host_factor: float  # the fresh figures' host time was scaled by this


def timing_of(p: HardwareProfile) -> str | None:
    """The --timing a calibrated profile was measured under (its description says; the
    calibration's default is launched), None for a spec-derived one."""
    m = _TIMING.search(p.description)
    if m:
        return m.group(1)
    return "launched" if "epmoe.bench.calibrate" in p.description else None


def refresh(into: HardwareProfile, fresh: HardwareProfile,
            tables: tuple[str, ...], across: str | None = None,
            names: tuple[str, ...] = ()) -> Refreshed:
    """`into` with `tables`' fits measured in `fresh` (see the module); ValueError when the
    two do not describe the same kind of measurement. `across`: why `fresh`'s GPU stands for
    `into`'s where the two differ (the fits are then `derived`, the reason in their notes).
    `names`: only the fits so named or named below them ("combine": combine, combine.triton,
    combine.queued, ...); all of the tables' when empty."""
    if not tables:
        raise ValueError("no tables to refresh")
    if into.gpu != fresh.gpu and not across:
        raise ValueError(f"--from is a {fresh.gpu} profile, --into a {into.gpu} one (--across "
                         f"REASON takes its fits as derived, saying why they carry over)")
    if into.gpu == fresh.gpu and across:
        raise ValueError(f"--across is for another GPU's fits; both are {into.gpu} profiles")
    ti, tf = timing_of(into), timing_of(fresh)
    if ti != tf:
        raise ValueError(f"--into {into.name} was timed {ti or 'from spec sheets'}, --from "
                         f"{fresh.name} {tf or 'from spec sheets'}: their fits do not mix")
    missing = [t for t in tables if t not in fresh.kernels]
    if missing:
        raise ValueError(f"--from {fresh.name} has no {', '.join(missing)} fits (it has "
                         f"{', '.join(sorted(fresh.kernels))})")
    factor, as_measured = 1.0, fresh
    if into.host_op_us is not None and fresh.host_op_us is not None:
        factor = into.host_op_us / fresh.host_op_us
        fresh, _ = fresh.at_host(into.host_op_us)
    kern = {b: dict(t) for b, t in into.kernels.items()}
    taken, kept = [], []
    for table in tables:
        new = kern.setdefault(table, {})
        for name, fit in fresh.kernels[table].items():
            if fit.prov.source != "measured" or (names and not any(
                    name == n or name.startswith(n + ".") for n in names)):
                continue
            scaled = fit != as_measured.kernels[table][name]
            new[name] = _public(fit, factor if scaled else 1.0, into.name)
            if across:
                new[name] = replace(new[name], prov=Provenance("derived", (
                    f"{fresh.gpu}'s fit taken for {into.gpu} ({across}): measured: "
                    f"{new[name].prov.note}")))
            taken.append(f"{table}.{name}")
        kept += [f"{table}.{n}" for n in new if f"{table}.{n}" not in taken]
    if not taken:
        raise ValueError(f"--from {fresh.name} measured none of the {', '.join(tables)} fits"
                         + (f" named {', '.join(names)}" if names else ""))
    day = datetime.date.today().isoformat()
    src = f"derived from {fresh.gpu}: " if across else ""
    which = f" {', '.join(names)}" if names else ""
    what = f"the {', '.join(tables)}{which} fits refreshed {day} " \
        f"({src}{public_note(fresh.description)})"
    return Refreshed(replace(into, kernels=kern, description=f"{into.description}; {what}"),
                     tuple(taken), tuple(kept), factor)


def _public(fit: AlphaBeta, factor: float, into: str) -> AlphaBeta:
    note = public_note(fit.prov.note)
    if factor != 1.0:
        note += f" (put at {into}'s host: host time x{factor:.3f})"
    return replace(fit, prov=Provenance(fit.prov.source, note))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.plan.refresh", description=(
        "Take some kernel tables' fits from a fresh calibration into a profile."))
    p.add_argument("--into", required=True, help="the profile to refresh (name or JSON)")
    p.add_argument("--from", dest="fresh", required=True,
                   help="a calibration's output (python -m epmoe.bench.calibrate --out)")
    p.add_argument("--tables", required=True,
                   help="kernel tables to take, comma separated (e.g. router, local)")
    p.add_argument("--out", required=True, type=writable_file, help="where to write it")
    p.add_argument("--names", default="",
                   help="only these fits of the tables and those named below them, comma "
                        "separated (e.g. combine: combine.triton, combine.queued, ...)")
    p.add_argument("--across", default=None, metavar="REASON",
                   help="--from is another GPU's: why its fits stand for --into's (they are "
                        "written as derived, with this reason)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        tables = tuple(t for t in args.tables.split(",") if t)
        names = tuple(n for n in args.names.split(",") if n)
        r = refresh(load_profile(args.into), load_profile(args.fresh), tables, args.across,
                    names)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    doc = profile_document(args.into)  # patched: the rest of the file stays as written
    doc["description"] = r.profile.description
    for t in tables:
        doc.setdefault("kernels", {})[t] = {k: asdict(f) for k, f in
                                           r.profile.kernels[t].items()}
    assert from_dict(doc) == r.profile, "the patched document does not load as the refresh"
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}: took {len(r.taken)} fit(s) ({', '.join(r.taken)}), host time "
          f"x{r.host_factor:.3f}")
    if r.kept:
        print(f"  kept as they were: {', '.join(r.kept)}")
    return 0


if __name__ == "__main__":
    run_main(main)
