"""The integration run of an N-GPU node: the whole test suite, the benchmarks, and the EP runs
through Ray at the machine's GPU count, summarized as JSON + Markdown.

    python -m epmoe.bench.integration --out runs/integration          # everything
    python -m epmoe.bench.integration --only launch --ep 2            # a subset

Steps (each a subprocess with its own deadline; a failing step is recorded, the run goes on):
  tests        pytest, the GPU tests unskipped by CUDA
  kernels      python -m epmoe.bench.kernels
  gpu_moe      python -m epmoe.bench.gpu_moe (DeepGEMM / DeepEP cases)
  comm         python -m epmoe.bench.comm --world N (every comm backend on N real ranks, ratios
               to DeepEP in the same run; one GPU: the loopback world)
  launch       python -m epmoe.launch --ep N with deepep-ht, symm-ht, deepep-ll, symm-ll,
               all2all (auto picks the experts backend), and --eplb on Zipf routing
  plan         python -m epmoe.bench.calibrate --parts comm --ranks N (this node's links and
               comm backends onto the shipped profile of its GPU), then launch --plan sweep
               --ep N at each --sweep-tokens with that profile: every feasible form and
               backend measured, predicted vs measured, the planner's pick vs the fastest
With fewer GPUs than ranks (one lent GPU), the ranks share them: comm adds symm-* on real
ranks sharing the GPU (`bench.comm --device shared`), and launch runs symm-ht / symm-ll with
--ranks-per-gpu (checked against the oracle; their times are time slices); the cases that
need a GPU per rank are recorded as skipped, with that reason.
On a machine without CUDA the GPU benchmarks are skipped with that reason and the launch runs
use gloo: the script itself is exercised by the CPU test suite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

from epmoe.argtypes import at_least, int_list, model_name, name_list, seconds
from epmoe.outputs import dump_json, run_main, writable_dir

STEPS = ("tests", "kernels", "gpu_moe", "comm", "launch", "plan")


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _run(name: str, cmd: list[str], timeout: float, log_dir: str) -> dict:
    t0 = time.monotonic()
    log = os.path.join(log_dir, f"{name}.log")
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return dict(step=name, cmd=" ".join(cmd), rc=rc, ok=rc == 0, seconds=time.monotonic() - t0,
                log=log)


def _launch_cases(ep: int, model: str, tokens: int, gpus: int) -> list[tuple[str, list[str]]]:
    """(name, launch flags) per case at `ep` ranks on `gpus` GPUs (0: CPU, gloo)."""
    common = ["--ep", str(ep), "--model", model, "--tokens", str(tokens), "--quiet",
              *(() if gpus else ("--device", "cpu"))]
    fp8 = ["--quant", "fp8_block"]
    if 0 < gpus < ep:  # ranks share the GPUs: our backends only (launch --ranks-per-gpu)
        share = ["--ranks-per-gpu", str(-(-ep // gpus)), "--device", "cuda"]
        return [(f"{b}-shared", [*common, *fp8, "--backend", b, *share])
                for b in ("symm-ht", "symm-ll")]
    cases = [("all2all", [*common, "--backend", "all2all"])]
    if gpus:
        from epmoe.config import get_preset

        # DeepEP's low-latency kernels take hidden >= 2048: a small real preset, one layer
        ll = common if get_preset(model).hidden >= 2048 else \
            [*common[:2], "--model", "qwen3-30b-a3b", "--layers", "1", *common[4:]]
        # ours beside DeepEP's on the same model and tokens (each run its own processes:
        # symm-* and DeepEP's low-latency mode each own NVSHMEM in a process)
        cases += [("deepep-ht", [*common, *fp8, "--backend", "deepep-ht"]),
                  ("symm-ht", [*common, *fp8, "--backend", "symm-ht"]),
                  ("deepep-ll", [*ll, *fp8, "--backend", "deepep-ll"]),
                  ("symm-ll", [*ll, *fp8, "--backend", "symm-ll"]),
                  # the decode step with the host out of it (steps replayed from a graph)
                  ("symm-ll-graph", [*ll, *fp8, "--backend", "symm-ll", "--cuda-graph"])]
    cases.append(("eplb-zipf", [*common, "--eplb", "--redundant-experts", str(ep),
                                "--routing", "zipf:1.2", "--rebalance-every", "3",
                                "--steps", "8"]))
    return cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.integration", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/integration", type=writable_dir,
                   help="folder for logs and summaries")
    p.add_argument("--only", type=name_list(STEPS), default=",".join(STEPS),
                   help=f"comma-separated: {','.join(STEPS)}")
    p.add_argument("--ep", type=at_least(1), default=None,
                   help="ranks (default: the GPU count, or 2)")
    p.add_argument("--model", type=model_name, default="deepseek-v3-tiny",
                   help="launch preset (the deepep-ll case switches to qwen3-30b-a3b, 1 layer, "
                        "when the preset's hidden is below DeepEP LL's 2048)")
    p.add_argument("--tokens", type=at_least(1), default=128,
                   help="tokens per rank for the launches")
    p.add_argument("--sweep-tokens", type=int_list(1), default=None,
                   help="plan: tokens per rank of each sweep, comma separated (default "
                        "128,4096 on GPUs, --tokens on CPU)")
    p.add_argument("--step-timeout", type=seconds, default=1800.0)
    a = p.parse_args(argv)
    only = a.only
    gpus = _cuda_count()
    ep = a.ep or max(gpus, 2)
    os.makedirs(a.out, exist_ok=True)
    py = sys.executable
    results = []
    if "tests" in only:
        results.append(_run("tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                            a.step_timeout, a.out))
    for bench in ("kernels", "gpu_moe", "comm"):
        if bench in only:
            if not gpus:
                results.append(dict(step=bench, ok=None, skipped="needs CUDA"))
                continue
            js = os.path.join(a.out, f"{bench}.json")
            extra = ["--world", str(min(ep, gpus) if gpus > 1 else 2)] if bench == "comm" else []
            r = _run(bench, [py, "-m", f"epmoe.bench.{bench}", "--json", js, *extra],
                     a.step_timeout, a.out)
            r["json"] = js
            results.append(r)
            if bench == "comm" and gpus < ep:  # real ranks sharing the GPU(s) as well
                js = os.path.join(a.out, "comm_shared.json")
                r = _run("comm_shared", [py, "-m", "epmoe.bench.comm", "--device", "shared",
                                         "--world", str(ep), "--quick", "--json", js],
                         a.step_timeout, a.out)
                r["json"] = js
                results.append(r)
    if "launch" in only:
        if 0 < gpus < ep:
            results.append(dict(step="launch_deepep_all2all", ok=None,
                                skipped=f"{gpus} GPU(s) for ep {ep}: DeepEP and NCCL need a GPU "
                                        f"per rank"))
        for name, args in _launch_cases(ep, a.model, a.tokens, gpus):
            js = os.path.join(a.out, f"launch_{name}.json")
            r = _run(f"launch_{name}", [py, "-m", "epmoe.launch", *args, "--out", js],
                     a.step_timeout, a.out)
            if os.path.exists(js):
                with open(js) as f:
                    s = json.load(f)
                r["summary"] = dict(
                    backend=s["world"]["backend"], experts=s["world"]["experts"],
                    passed=s["correctness"].get("passed"),
                    max_rel_err=s["correctness"].get("max_rel_err"),
                    step_ms=s["timing"]["step_ms_median"],
                    balancedness=s["load"]["balancedness"],
                    eplb=None if "eplb" not in s else {
                        k: s["eplb"][k] for k in ("balancedness_before", "balancedness_after",
                                                  "rebalances", "slots_moved")})
            results.append(r)
    if "plan" in only:
        results += _plan_steps(a, ep, gpus, py)
    summary = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   gpus=gpus, ep=ep, model=a.model, steps=results,
                   passed=all(r.get("ok") is not False for r in results))
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        dump_json(summary, f, indent=2)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(_markdown(summary))
    print(_markdown(summary))
    return 0 if summary["passed"] else 1


def _plan_steps(a, ep: int, gpus: int, py: str) -> list[dict]:
    """Calibrate the comm part here, then one --plan sweep per token count with that profile
    (the shipped profile of this GPU when the calibration failed)."""
    if 0 < gpus < ep:
        return [dict(step="plan", ok=None, skipped=f"{gpus} GPU(s) for ep {ep}: the sweep's "
                                                   f"DeepEP and NCCL candidates need a GPU "
                                                   f"per rank")]
    prof = os.path.join(a.out, "plan_profile.json")
    dev = [] if gpus else ["--device", "cpu"]
    cal = _run("plan_calibrate", [py, "-m", "epmoe.bench.calibrate", "--parts", "comm",
                                  "--ranks", str(ep), "--out", prof, *dev],
               a.step_timeout, a.out)
    cal["json"] = prof
    out = [cal]
    for t in a.sweep_tokens or ((128, 4096) if gpus else (a.tokens,)):
        js = os.path.join(a.out, f"sweep_{t}.json")
        cmd = [py, "-m", "epmoe.launch", "--plan", "sweep", "--ep", str(ep), "--model", a.model,
               "--tokens", str(t), "--quiet", "--out", js, *dev,
               *(["--profile", prof] if cal["ok"] else [])]
        r = _run(f"plan_sweep_{t}", cmd, a.step_timeout, a.out)
        if os.path.exists(js):
            with open(js) as f:
                sw = json.load(f)["sweep"]
            r["json"] = js
            r["sweep"] = dict(fastest=sw.get("fastest"), fastest_ms=sw.get("fastest_ms"),
                              auto=sw.get("auto"), profile=sw.get("profile"))
        out.append(r)
    return out


def _markdown(s: dict) -> str:
    lines = [f"# epmoe integration run, {s['date']}", "",
             f"{s['gpus']} GPU(s), ep={s['ep']}, model {s['model']}: "
             f"{'PASS' if s['passed'] else 'FAIL'}", "",
             "| step | result | seconds | details |", "|---|---|---|---|"]
    for r in s["steps"]:
        res = "skipped" if r.get("ok") is None else ("ok" if r["ok"] else f"FAIL (rc {r['rc']})")
        det = r.get("skipped") or r.get("json") or r.get("log", "")
        if "summary" in r:
            m = r["summary"]
            err = m["max_rel_err"]
            det = (f"{m['backend']}; correctness {m['passed']} "
                   f"({'-' if err is None else f'{err:.2e}'}); step {m['step_ms']:.2f} ms; "
                   f"balancedness {m['balancedness']:.3f}")
            if m["eplb"]:
                e = m["eplb"]
                det += (f"; EPLB {e['balancedness_before']:.3f} -> {e['balancedness_after']:.3f}"
                        f", {e['rebalances']} rebalances, {e['slots_moved']} slots moved")
        if r.get("sweep"):
            w, auto = r["sweep"], r["sweep"].get("auto") or {}
            gap = auto.get("vs_best")
            det = (f"fastest {w['fastest']} {w['fastest_ms'] or 0:.2f} ms; planner "
                   f"{auto.get('label')}" + ("" if gap is None else f" {100 * gap:+.1f}%") +
                   f"; profile {w['profile']}")
        secs = r.get("seconds")
        lines.append(f"| {r['step']} | {res} | {'' if secs is None else f'{secs:.0f}'} | {det} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_main(main)
