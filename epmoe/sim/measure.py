"""A sweep's points run for real: `python -m epmoe.sim SWEEP --run GPU [--address A]`.

The same sweep file that the model predicts is launched where it can run: every row of GPU
`--run` (the sweep's `gpus` entry that names this cluster's profile, e.g. `cpu` here or `h200`
on the lent machines) runs as one `python -m epmoe.launch` in a subprocess, with the point's
ranks, tokens per rank, model, recipe, routing and layer count, the row's choice as a fixed
plan (`--plan FORM --backend B --experts E`), `--profile GPU`, and `--address` when given (a
Ray cluster; else each launch starts its own private one). The launcher finds the real
topology itself, so each measured row carries two predictions: the sweep's (its assumed
topology) and the launch's own (the topology it ran on), both from the same profile.

Rows with EPLB redundancy are predicted only: a launch places replicas from the load it
records, the sweep from the expected load; so are rows at a recorded load (a launch routes by
its own router). A launch that fails (a cluster too small, a
backend this machine lacks) is reported with the launcher's one-line error; a launch past
`timeout_s` is stopped and reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class MeasureOptions:
    """gpu: the sweep gpu whose rows run; steps: steps per launch (step 0 is warm-up);
    timeout_s: per launch; device: the launcher's --device."""

    gpu: str
    address: str | None = None
    steps: int = 4
    timeout_s: float = 600.0
    device: str = "auto"

    def __post_init__(self):
        if self.steps < 2:
            raise ValueError(f"--run-steps ({self.steps}) must be >= 2 (step 0 is warm-up)")
        if self.timeout_s <= 0:
            raise ValueError(f"--run-timeout ({self.timeout_s}) must be > 0 seconds")


def launch_argv(row: dict, sweep, opts: MeasureOptions) -> list[str]:
    """The launcher's flags for one sweep row."""
    from epmoe.config import get_preset

    form, backend, experts = row["choice"].split("/")
    layers = sweep.layers or get_preset(sweep.model).num_moe_layers
    argv = ["--model", sweep.model, "--quant", sweep.recipe()[0], "--ep", str(row["ep"]),
            "--tokens", str(row["tokens"]), "--layers", str(layers), "--steps",
            str(opts.steps), "--routing", row["routing"], "--plan", form, "--backend",
            backend, "--experts", experts, "--profile", opts.gpu, "--device", opts.device,
            "--timeout", str(max(1, int(opts.timeout_s))), "--json", "--quiet"]
    if sweep.scale_fmt:
        argv += ["--scale-fmt", sweep.scale_fmt]
    if opts.address:
        argv += ["--address", opts.address]
    return argv


def _skip(row: dict, opts: MeasureOptions) -> str | None:
    if row.get("kind") == "infeasible":
        return row["reason"]
    if row["gpu"] != opts.gpu:
        return f"gpu {row['gpu']} (this run measures {opts.gpu})"
    if row["redundant"]:
        return "EPLB redundancy: predicted only (a launch places replicas from measured load)"
    if row["routing"].startswith(("rec:", "recorded")):
        return "recorded load: predicted only (a launch routes by its own router)"
    return None


def launch(argv: list[str], timeout_s: float) -> tuple[dict | None, str | None]:
    """-> (the launch's JSON summary, None) or (None, its one-line error)."""
    try:
        p = subprocess.run([sys.executable, "-m", "epmoe.launch", *argv], capture_output=True,
                           text=True, timeout=timeout_s + 60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"the launch ran past {timeout_s:.0f} s (+60 s grace) and was stopped"
    try:
        doc = json.loads(p.stdout) if p.stdout.strip() else None
    except json.JSONDecodeError:
        doc = None
    if doc is None or "timing" not in doc:
        err = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        return None, (err[-1] if err else f"the launch exited {p.returncode} without a "
                                          f"summary")[:200]
    return doc, None


def measure(rows: list[dict], sweep, opts: MeasureOptions, say=None) -> list[dict]:
    """Each row with a `measured` entry: status ok / failed / skipped, and for ok rows the
    measured step (median, warm-up excluded), the launch's own prediction, the oracle
    check, the ratio sweep-predicted / measured and the launch's seconds."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    todo = {_key(r) for r in rows if _skip(r, opts) is None}  # launches: distinct cases
    out, done, n = [], {}, 0
    for r in rows:
        why = _skip(r, opts)
        if why is not None:
            out.append({**r, "measured": dict(status="skipped", error=why)})
            continue
        key = _key(r)
        if key not in done:  # a fixed candidate equal to the pick runs once
            n += 1
            say(f"[{n}/{len(todo)}] ep {r['ep']}, {r['tokens']} tokens/rank, {r['routing']}, "
                f"{r['choice']}: launching")
            t0 = time.monotonic()
            doc, err = launch(launch_argv(r, sweep, opts), opts.timeout_s)
            done[key] = _result(r, doc, err, time.monotonic() - t0)
            m = done[key]
            say(f"[{n}/{len(todo)}] " + (f"measured {m['step_ms']:.3f} ms, predicted "
                                         f"{r['step_ms']:.3f} ms" if m["status"] == "ok"
                                         else f"failed: {m['error']}"))
        out.append({**r, "measured": done[key]})
    return out


def _key(row: dict) -> tuple:
    return row["ep"], row["tokens"], row["routing"], row["choice"]


def _result(row: dict, doc: dict | None, err: str | None, seconds: float) -> dict:
    if doc is None:
        return dict(status="failed", error=err, seconds=seconds)
    t, c = doc["timing"], doc["correctness"]
    step = t["step_ms_median"]
    return dict(status="ok", error=None, seconds=seconds, step_ms=step,
                launch_predicted_ms=t.get("predicted_step_ms"),
                ratio=row["step_ms"] / step if step else None,
                passed=c["passed"] if c.get("checked") else None,
                topology=t.get("prediction", {}).get("topology"))


def table(rows: list[dict]) -> str:
    """80 columns: the measured rows, the sweep's and the launch's predictions beside them."""
    head = (f"{'ep':>4}{'tok':>6} {'routing':<9} {'choice':<22}{'sim ms':>9}{'launch ms':>10}"
            f"{'meas ms':>9}{'sim/meas':>9}")
    out = ["measured (python -m epmoe.launch per row)", head, "-" * 80]
    for r in rows:
        m = r.get("measured", {})
        if m.get("status") == "skipped":
            continue
        lead = f"{r['ep']:>4}{r['tokens']:>6} {r['routing'][:9]:<9} {r['choice'][:22]:<22}"
        if m.get("status") != "ok":
            out.append(f"{lead}failed: {m.get('error')}"[:80])
            continue
        lp = m["launch_predicted_ms"]
        out.append(f"{lead}{r['step_ms']:>9.3f}{'-' if lp is None else f'{lp:.3f}':>10}"
                   f"{m['step_ms']:>9.3f}{m['ratio']:>9.2f}")
    return "\n".join(out)


def exit_code(rows: list[dict]) -> int:
    """0 every launch ok (and correct), 1 a launch failed its oracle check, 3 none ran."""
    ms = [r["measured"] for r in rows if r.get("measured", {}).get("status") != "skipped"]
    ok = [m for m in ms if m["status"] == "ok"]
    if ms and not ok:
        return 3
    return 1 if any(m["passed"] is False for m in ok) else 0
