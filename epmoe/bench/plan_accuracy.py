"""`python -m epmoe.bench.plan_accuracy`: how well the cost model predicts this machine, and
whether the planner picks the fastest measured candidate.

Every group below is a `launch --plan sweep` (epmoe.launch.sweep: every feasible uniform
stack, one launch each, through the launch path and its report): per stage and launch the
prediction next to the measurement, the error (predicted / measured - 1) and whether it is
within 20% (judged for stages measured above 50 us only); per group the planner's pick
against the best measured (within 5%?).

| machine | groups                                                                          |
|---------|---------------------------------------------------------------------------------|
| CUDA    | ep 1 (--ep N: N ranks, one GPU each), DeepSeek-V3 dims (--layers, default 1),   |
|         | fp8_block and bf16, triton and deepgemm experts (those that run here), 128 and  |
|         | 4096 tokens; --no-check                                                         |
| CPU     | gloo ranks (Ray): deepseek-v3-tiny bf16 at ep 1 (8 and 64 tokens), ep 2 and 4    |
|         | (32 tokens/rank; every form, all2all and allgather); best effort, noisy          |

    python -m epmoe.bench.plan_accuracy --json runs/plan_accuracy.json [--quick]

--quick: CUDA 4096 tokens only (fp8 and bf16); CPU ep 1 and 2 only. Profile: --profile, else by
device (epmoe.launch.device_profile.profile_for_device). --calibrate [full|quick]: first run
`python -m epmoe.bench.calibrate` here (into --calibrate-out, default next to --json, else a
temporary file; --profile, if given, is its base) and predict with the profile it wrote, so
one command measures the machine and then judges the model on it:

    python -m epmoe.bench.plan_accuracy --quick --calibrate --calibrate-budget-s 120 \
        --budget-s 120 --json runs/plan_accuracy.json

The report (stdout and JSON "profile") names the profile used and its provenance counts.

--timing launched|device (default launched) is passed to every launch and to the calibration:
launched judges the stages as a synchronized step shows them (a small stage measures the host's
launch time, BENCHMARKS.md 6e); device judges the GPU's time per stage (the host issuing the
step ahead of the GPU), which is what the cost model predicts; the host's issue time per step
is reported next to it (JSON "host_issue_ms" per launch) with the model's ("predicted_issue_ms",
a "host issue" row, judged apart from the stages). --cuda-graph (CUDA) replays every
launch's steps 1.. from a CUDA graph (launch --cuda-graph): the host issues no launches, so the
stages are GPU time under either timing; judge them with a device-timed profile.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

from epmoe.argtypes import at_least, int_list, seconds
from epmoe.outputs import dump_json, run_main, writable_file

WITHIN = 0.20
FLOOR_MS = 0.05
HOST_ISSUE = "host issue"  # a row per launch: the host's issue time of a step, predicted


def groups(cuda: bool, quick: bool, layers: int, steps: int,
           tokens: tuple[int, ...] | None = None, ep: int = 1) -> list[dict]:
    """One dict of launch flags (and an experts restriction) per sweep (CUDA: `tokens`
    overrides the token counts, e.g. one between the calibration's sizes; `ep` ranks, one GPU
    each)."""
    if cuda:
        tokens = tokens or ((4096,) if quick else (128, 4096))
        return [dict(flags=["--model", "deepseek-v3", "--quant", recipe, "--tokens", str(t),
                            "--layers", str(layers), "--steps", str(steps), "--no-check",
                            "--device", "cuda", "--ep", str(ep)],
                     experts=("triton", "deepgemm"))
                for recipe in ("fp8_block", "bf16") for t in tokens]
    out = [dict(flags=["--tokens", str(t), "--ep", "1"], experts=None) for t in (8, 64)]
    out += [dict(flags=["--tokens", "32", "--ep", str(ep)], experts=None)
            for ep in ((2,) if quick else (2, 4))]
    for g in out:
        g["flags"] += ["--model", "deepseek-v3-tiny", "--layers", str(layers), "--steps",
                       str(steps), "--device", "cpu"]
    return out


def stage_rows(sweep: dict) -> list[dict]:
    """Per launch and stage: measured, predicted, error, within 20% (None under 50 us)."""
    out = []
    for r in sweep["rows"]:
        if r["status"] != "ok" or r["predicted_stages_ms"] is None:
            continue
        pred = r["predicted_stages_ms"]
        for k, m in r["stages_ms"].items():
            p = pred.get(k)
            if p is None:
                continue
            err = p / m - 1 if m else None
            out.append(dict(candidate=r["candidate"], stage=k, measured_ms=m, predicted_ms=p,
                            error=err, within_20=None if m < FLOOR_MS or err is None
                            else bool(abs(err) <= WITHIN)))
        err = None if r["ratio"] is None else r["ratio"] - 1
        out.append(dict(candidate=r["candidate"], stage="step", measured_ms=r["measured_ms"],
                        predicted_ms=r["predicted_ms"], error=err,
                        within_20=None if err is None else bool(abs(err) <= WITHIN)))
        m, p = r.get("host_issue_ms"), r.get("predicted_issue_ms")
        if m and p:  # the host's time to issue a step (the profile's, at this host's speed)
            out.append(dict(candidate=r["candidate"], stage=HOST_ISSUE, measured_ms=m,
                            predicted_ms=p, error=p / m - 1,
                            within_20=bool(abs(p / m - 1) <= WITHIN)))
    return out


def render_group(s: dict, rows: list[dict]) -> str:
    from epmoe.launch.sweep import render

    lines = [render(s)]
    hosts = sorted({round(r["host_factor"], 2) for r in s["rows"] if r.get("host_factor")})
    if hosts:  # the profile's host time was scaled to this host's (tiny-op probe)
        lines.append("host time at this host's speed: x" + ", x".join(map(str, hosts))
                     + " the profile's")
    lines.append(f"{'candidate':<24}{'stage':<19}{'measured':>10}{'predicted':>11}"
                 f"{'error':>8}  {'<=20%':<6}")
    for r in rows:
        ok = {True: "yes", False: "NO", None: "(<50us)"}[r["within_20"]]
        err = "-" if r["error"] is None else f"{100 * r['error']:+.0f}%"
        lines.append(f"{r['candidate'][:23]:<24}{r['stage'][:18]:<19}{r['measured_ms']:>10.3f}"
                     f"{r['predicted_ms']:>11.3f}{err:>8}  {ok:<6}".rstrip())
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m epmoe.bench.plan_accuracy",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, type=writable_file, help="write the results here")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=at_least(1), default=None, help="default: 1 on CUDA, 2 on CPU")
    ap.add_argument("--steps", type=at_least(1), default=None, help="default: 12 on CUDA, 6 on CPU")
    ap.add_argument("--profile", default=None, help="default: by device")
    ap.add_argument("--ep", type=at_least(1), default=1,
                    help="CUDA: ranks, one GPU each (the calibration then measures the comm "
                         "backends on as many; default 1)")
    ap.add_argument("--tokens", type=int_list(1), default=None,
                    help="CUDA: comma-separated token counts "
                    "(default 4096 with --quick, else 128,4096); a count the calibration did "
                    "not measure checks interpolation, not a fit")
    ap.add_argument("--budget-s", type=seconds, default=240.0,
                    help="no new launch after this many seconds (default 240)")
    ap.add_argument("--timing", default="launched", choices=("launched", "device"),
                    help="how the launches (and --calibrate) time steps (see launch --timing)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="launches replay steps 1.. from a CUDA graph (launch --cuda-graph)")
    ap.add_argument("--calibrate", nargs="?", const="full", default=None,
                    choices=("full", "quick"), help="calibrate this machine first (full unless "
                    "'quick') and predict with that profile")
    ap.add_argument("--calibrate-out", default=None, help="where the calibrated profile goes "
                    "(default: <--json without .json>.profile.json, else a temporary file)")
    ap.add_argument("--calibrate-budget-s", type=seconds, default=120.0,
                    help="calibration time budget (default 120)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    tokens = args.tokens
    import torch

    cuda = torch.cuda.is_available()
    if args.ep > 1 and not (cuda and torch.cuda.device_count() >= args.ep):
        print(f"error: --ep {args.ep} needs {args.ep} CUDA GPUs (one per rank); "
              f"{torch.cuda.device_count() if cuda else 0} visible", file=sys.stderr)
        return 2
    if args.calibrate:
        args.profile = calibrate_first(args)
        if args.profile is None:
            return 2
    from epmoe.launch.cli import build_run, parser as launch_parser
    from epmoe.launch.sweep import run_sweep

    if args.cuda_graph and not cuda:
        print("error: --cuda-graph needs a CUDA GPU (it captures CUDA graphs)", file=sys.stderr)
        return 2
    if not cuda:
        torch.set_num_threads(1)  # in-process ranks as the Ray workers: one thread each
    layers = args.layers or (1 if cuda else 2)
    steps = args.steps or (12 if cuda else 6)
    from epmoe.launch.device_profile import device_and_arch, profile_for_device, timing_kind
    from epmoe.plan.profile import load_profile

    profile = args.profile or profile_for_device(
        *device_and_arch(), args.ep, 1, timing_kind(args.timing, args.cuda_graph))[0]
    prof = load_profile(profile)
    used = dict(name=prof.name, source=profile, calibrated=bool(args.calibrate),
                provenance=prof.provenance_counts())
    print(f"profile: {prof.name} ({profile}): " + ", ".join(
        f"{k} {v}" for k, v in used["provenance"].items() if v), flush=True)
    t0, results = time.monotonic(), []
    for g in groups(cuda, args.quick, layers, steps, tokens, args.ep):
        left = args.budget_s - (time.monotonic() - t0)
        if left <= 0:
            print(f"budget spent: skipping {' '.join(g['flags'])}", flush=True)
            continue
        a = launch_parser().parse_args(
            g["flags"] + ["--plan", "sweep", "--sweep-budget-s", str(left),
                          "--timing", args.timing]
            + (["--profile", args.profile] if args.profile else [])
            + (["--cuda-graph"] if args.cuda_graph else []))
        try:
            s = run_sweep(a, build_run, experts=g["experts"])
        except ValueError as exc:
            print(f"skipped {' '.join(g['flags'])}: {exc}", flush=True)
            continue
        rows = stage_rows(s)
        print(render_group(s, rows) + "\n", flush=True)
        results.append(dict(flags=g["flags"], sweep=s, stages=rows))
    judged = [r for g in results for r in g["stages"]
              if r["within_20"] is not None and r["stage"] not in ("step", HOST_ISSUE)]
    issue = [r["within_20"] for g in results for r in g["stages"] if r["stage"] == HOST_ISSUE]
    picks = [g["sweep"]["auto"]["within_5pct"] for g in results]
    summary = dict(stages_judged=len(judged), stages_within_20=sum(r["within_20"]
                                                                    for r in judged),
                   steps_within_20=sum(r["within_20"] for g in results for r in g["stages"]
                                       if r["stage"] == "step"),
                   launches=sum(1 for g in results for r in g["sweep"]["rows"]
                                if r["status"] == "ok"),
                   groups=len(results), picks_within_5=sum(bool(p) for p in picks),
                   issue_judged=len(issue), issue_within_20=sum(issue),
                   seconds=time.monotonic() - t0)
    print(f"stages > 50 us within 20%: {summary['stages_within_20']}/{summary['stages_judged']};"
          f" steps within 20%: {summary['steps_within_20']}/{summary['launches']}; planner's "
          f"pick within 5% of the best: {summary['picks_within_5']}/{summary['groups']}; "
          f"{summary['seconds']:.0f} s" + (f"; host issue within 20%: {sum(issue)}/{len(issue)}"
                                             if issue else ""))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            dump_json(dict(machine=platform.node(), device=torch.cuda.get_device_name(0)
                           if cuda else "cpu", cpus=os.cpu_count(),
                           load_avg=os.getloadavg()[0],
                           date=datetime.date.today().isoformat(), command=sys.argv,
                           profile=used, timing=args.timing, cuda_graph=args.cuda_graph,
                           summary=summary,
                           groups=results), f, indent=1)
    return 0


def calibrate_first(args) -> str | None:
    """Run the calibration (args.calibrate: full | quick) -> the profile file it wrote, or
    None (its error is on stderr)."""
    from epmoe.bench import calibrate

    out = args.calibrate_out
    if out is None and args.json:
        out = os.path.splitext(args.json)[0] + ".profile.json"
    if out is None:
        out = os.path.join(tempfile.mkdtemp(prefix="epmoe-calibrate-"), "profile.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    argv = ["--out", out, "--budget-s", str(args.calibrate_budget_s), "--timing", args.timing]
    argv += ["--quick"] if args.calibrate == "quick" else []
    argv += ["--base", args.profile] if args.profile else []
    argv += ["--ranks", str(args.ep)] if args.ep > 1 else []
    t = time.monotonic()
    print(f"calibrating ({args.calibrate}): python -m epmoe.bench.calibrate {' '.join(argv)}",
          flush=True)
    if calibrate.main(argv) != 0:
        return None
    print(f"calibrated in {time.monotonic() - t:.0f} s", flush=True)
    return out


if __name__ == "__main__":
    run_main(main)
