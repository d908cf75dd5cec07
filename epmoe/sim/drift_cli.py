"""`python -m epmoe.sim drift`: EPLB over a run whose routing drifts (epmoe/sim/drift.py).

    python -m epmoe.sim drift [--model M] [--gpu P] [--ep N] [--tokens T]
        [--routing drift:S:P|zipf:S|uniform|trace:FILE] [--steps N] [--every N] [--window N]
        [--redundant-per-rank R] [--migration sync|async] [--candidate ep_dp/BACKEND/EXPERTS]
        [--out DIR] [--json]

Prints a table per block of steps (predicted step ms and balancedness without redundant
slots, with the rebalances, and with a placement that always knows its load), one line per
rebalance, and the run's means; --out writes drift.json and drift.png. Exit 0, or 2 on bad
input (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

from epmoe.argtypes import at_least
from epmoe.outputs import json_text, writable_dir
from epmoe.sim.drift import SERIES, DriftRun, simulate, summary

D = DriftRun()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.sim drift", description=(
        "Predict a run's step time as its routing drifts and EPLB rebalances every N steps "
        "(a model, not a measurement): no redundancy, the rebalances, and a placement that "
        "always knows its load."))
    p.add_argument("--model", default=D.model, help="preset name (default %(default)s)")
    p.add_argument("--gpu", default=D.gpu, help="profile (default %(default)s)")
    p.add_argument("--ep", type=at_least(1), default=D.ep, help="ranks (default %(default)s)")
    p.add_argument("--gpus-per-node", type=at_least(1), default=D.gpus_per_node)
    p.add_argument("--tokens", type=at_least(1), default=D.tokens,
                   help="tokens per rank a step prices (default %(default)s)")
    p.add_argument("--routing", default=D.routing,
                   help="uniform | zipf:S | drift:S:P | trace:FILE (default %(default)s)")
    p.add_argument("--steps", type=at_least(1), default=D.steps)
    p.add_argument("--every", type=at_least(1), default=D.every,
                   help="steps between rebalances (default %(default)s)")
    p.add_argument("--window", type=at_least(1), default=D.window,
                   help="steps of load a rebalance places for (default %(default)s)")
    p.add_argument("--redundant-per-rank", type=at_least(1), default=D.redundant_per_rank)
    p.add_argument("--migration", choices=("sync", "async"), default=D.migration)
    p.add_argument("--candidate", default=None,
                   help="ep_dp/BACKEND/EXPERTS to hold (default: the planner's pick)")
    p.add_argument("--quant", default=None,
                   help="recipe (default: the first of fp8_block, mxfp8, bf16 that fits)")
    p.add_argument("--layers", type=at_least(1), default=D.layers,
                   help="MoE layers priced, scaled to the stack (default %(default)s)")
    p.add_argument("--sample-tokens", type=at_least(1), default=D.sample_tokens,
                   help="tokens drawn per step to count the load (default %(default)s)")
    p.add_argument("--block", type=at_least(1), default=D.block,
                   help="steps priced together (default %(default)s)")
    p.add_argument("--seed", type=at_least(0), default=D.seed)
    p.add_argument("--out", type=writable_dir, default=None,
                   help="directory for drift.json and drift.png")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def table(run: DriftRun, blocks, events, label: str) -> str:
    """80 columns: one line per block, one per rebalance, the means."""
    head = (f"{'steps':<11}{'ms none':>9}{'ms eplb':>9}{'ms ideal':>9}   "
            f"{'bal none':>8}{'bal eplb':>9}{'bal ideal':>10}")
    out = [textwrap.fill(f"{run.model} on {run.ep} x {run.gpu}, {run.tokens} tokens/rank, "
                         f"{run.routing}, {run.redundant_per_rank} redundant slot(s)/rank, "
                         f"rebalance every {run.every} steps on {run.window} steps of load "
                         f"({run.migration}); {label}", 80), head, "-" * 80]
    for b in blocks:
        steps = f"{b.start}-{b.stop - 1}"
        out.append(f"{steps:<11}" + "".join(f"{b.step_ms[s]:>9.1f}" for s in SERIES)
                   + "   " + f"{b.balancedness['none']:>8.3f}{b.balancedness['eplb']:>9.3f}"
                   + f"{b.balancedness['ideal']:>10.3f}")
    for e in events:
        did = (f"applied from step {e.lands}" if e.applied else "not applied")
        out.append(textwrap.fill(f"rebalance after step {e.step}: {e.kind}, {e.slots} slots, "
                                 f"{e.moved_MB:.0f} MB to the busiest rank, {did}: {e.reason}",
                                 80, subsequent_indent="  "))
    s = summary(blocks)
    means = ", ".join(f"{k} {s[k]['step_ms']:.1f} ms ({s[k]['balancedness']:.3f})"
                      for k in SERIES)
    r = s["recovered"]
    rec = "; none and ideal within 2%: EPLB has little to win here" if r is None else \
        f"; the rebalances recover {100 * r:.0f}% of none -> ideal" if r >= 0 else \
        f"; eplb is slower than none, by {100 * -r:.0f}% of the none -> ideal gap"
    out.append(textwrap.fill(f"mean step (balancedness): {means}{rec}", 80,
                             subsequent_indent="  "))
    return "\n".join(out)


def plot(run: DriftRun, blocks, events, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in SERIES:
        xs = [x for b in blocks for x in (b.start, b.stop)]
        ys = [b.step_ms[s] for b in blocks for _ in (0, 1)]
        ax.plot(xs, ys, label=s)
    for e in events:
        ax.axvline(e.lands if e.applied else e.step, color="grey", lw=0.8,
                   ls="-" if e.applied else ":")
    ax.set_xlabel("step")
    ax.set_ylabel("predicted step ms")
    ax.set_title(f"{run.model}, EP{run.ep} {run.gpu}, {run.routing}, rebalance every "
                 f"{run.every}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv) -> int:
    args = parser().parse_args(argv)
    keys = set(asdict(D))
    run = DriftRun(**{k: v for k, v in vars(args).items() if k in keys})
    try:
        run.check()
        from epmoe.launch.console import Phases

        ph = Phases()
        blocks, events, label = simulate(run, ph.counter("blocks priced"), ph)
    except (ValueError, KeyError) as exc:
        print(f"error: {str(exc).strip(chr(34))}", file=sys.stderr)
        return 2
    doc = {"run": asdict(run), "candidate": label, "blocks": [asdict(b) for b in blocks],
           "events": [asdict(e) for e in events], "summary": summary(blocks),
           "note": "step_ms predicted by epmoe.plan.cost from the named profile"}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "drift.json").write_text(json_text(doc) + "\n")
        png = plot(run, blocks, events, out / "drift.png")
        print(f"wrote {out / 'drift.json'} and {png.name}", file=sys.stderr)
    print(json_text(doc) if args.json else table(run, blocks, events, label))
    return 0
