"""Offline tuning of the Triton kernels' launch configs on one GPU, in one command.

    python -m epmoe.bench.kernel_tune --out DIR [--workers 12] [--tokens 4096,16384]

1. compile every candidate config in parallel subprocesses (they fill Triton's on-disk cache;
   a candidate that crashes the compiler only loses its own subprocess);
2. check each compiled candidate against a reference at the benchmark's shapes (GEMMs: the
   pointer kernel, tolerance 1e-2 of max |ref|; quantizer: bit for bit; router: ids on
   well-separated tokens and weights within 1e-4 of the torch router on float64 logits);
3. time each correct candidate, pick the fastest per kernel and shape;
4. run `epmoe.bench.kernels` with the picks.
Writes DIR/tune.json (every candidate: config, compile, check, ms, picks) and DIR/kernels.json.
The picks are then baked into the kernels' TUNED tables by hand (reviewed, committed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from epmoe.argtypes import at_least, int_list, seconds
from epmoe.bench import kernels as kb
from epmoe.kernels.gate_topk import RouterConfig
from epmoe.kernels.gemm_tma import GemmConfig
from epmoe.kernels.quantize import QuantKernelConfig
from epmoe.outputs import dump_json, run_main, writable_dir

G = GemmConfig
FP8_CANDIDATES = {
    "128x128w8s4": G(128, 128, 8, 4), "128x128w8s3": G(128, 128, 8, 3),
    "128x128w8s4np": G(128, 128, 8, 4, persistent=False),
    "128x128w8s4st": G(128, 128, 8, 4, tma_store=True),
    "128x256w8s3": G(128, 256, 8, 3), "128x256w8s4": G(128, 256, 8, 4),
    "128x256w8s3st": G(128, 256, 8, 3, tma_store=True),
    "64x256w4s4": G(64, 256, 4, 4), "64x128w4s4": G(64, 128, 4, 4),
    "128x128w8s4ws": G(128, 128, 8, 4, warp_spec=True),
    "128x128w4s4ws": G(128, 128, 4, 4, warp_spec=True),
}
BF16_CANDIDATES = {
    "128x256w8s3": G(128, 256, 8, 3), "128x256w8s4": G(128, 256, 8, 4),
    "128x128w8s4": G(128, 128, 8, 4),
    "128x256w8s3st": G(128, 256, 8, 3, tma_store=True),
    "128x256w8s3ws": G(128, 256, 8, 3, warp_spec=True),
}
ROUTER_CANDIDATES = {
    "64k64w8s4": RouterConfig(64, 64, 8, 4), "64k128w8s3": RouterConfig(64, 128, 8, 3),
    "64k64w4s4": RouterConfig(64, 64, 4, 4), "32k64w4s4": RouterConfig(32, 64, 4, 4),
}
Q = QuantKernelConfig
QUANT128_CANDIDATES = {"4x8w4": Q(4, 8, 4), "8x8w8": Q(8, 8, 8), "2x16w4": Q(2, 16, 4),
                       "1x64w8": Q(1, 64, 8)}
QUANT32_CANDIDATES = {"4x32w4": Q(4, 32, 4), "2x64w4": Q(2, 64, 4), "8x16w4": Q(8, 16, 4)}
GEMMS = {"GEMM1": (2 * kb.INTER, kb.HIDDEN), "GEMM2": (kb.HIDDEN, kb.INTER)}


def set_scratch_allocator() -> None:
    """Kernels that ask for global scratch (e.g. warp-specialized candidates) get it from
    torch; the library's kernels need none (host-side tensor descriptors)."""
    import triton

    if hasattr(triton, "set_allocator"):
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                      device="cuda"))


def kernel_stats() -> list[dict]:
    """Registers / spills / shared memory of every compiled TMA GEMM variant (best effort:
    Triton's cache layout differs between versions)."""
    from epmoe.kernels.gemm_tma import _gemm_tma_kernel

    out = []
    try:
        for dev_cache in _gemm_tma_kernel.device_caches.values():
            for key, k in dev_cache[0].items():
                out.append(dict(key=str(key)[-600:], n_regs=getattr(k, "n_regs", None),
                                n_spills=getattr(k, "n_spills", None),
                                shared=getattr(getattr(k, "metadata", None), "shared", None)))
    except Exception as exc:  # noqa: BLE001
        out.append(dict(error=repr(exc)))
    return out


def jobs() -> list[str]:
    out = [f"gemm/fp8_block/{n}" for n in FP8_CANDIDATES]
    out += [f"gemm/bf16/{n}" for n in BF16_CANDIDATES]
    out += [f"router/{n}" for n in ROUTER_CANDIDATES]
    out += [f"quant128/{n}" for n in QUANT128_CANDIDATES]
    out += [f"quant32/{n}" for n in QUANT32_CANDIDATES]
    return out + ["other/pointer_fp8", "other/pointer_bf16", "other/bandwidth",
                  "other/deepgemm"]


class Case:
    """A routing of the benchmark's shapes at T tokens and lazily made GEMM inputs."""

    def __init__(self, t: int):
        from epmoe.layout import make_contiguous_layout

        torch.manual_seed(0)
        self.t = t
        ids, _ = kb.routing(t)
        self.layout = make_contiguous_layout(ids, kb.NUM_EXPERTS, alignment=128)
        self._gemm = {}

    def gemm(self, recipe: str, gname: str):
        key = (recipe, gname)
        if key not in self._gemm:
            n, k = GEMMS[gname]
            self._gemm[key] = kb.gemm_inputs(self.layout, recipe, n, k)
        return self._gemm[key]


def _run_gemm(case: Case, recipe: str, gname: str, cfg, kernel="tma"):
    from epmoe.kernels.grouped_gemm import triton_m_grouped_gemm_nt_contiguous

    x, w = case.gemm(recipe, gname)
    return lambda: triton_m_grouped_gemm_nt_contiguous(x, w, case.layout, config=cfg,
                                                        kernel=kernel)


def _router_inputs(t: int):
    torch.manual_seed(1)
    cfg = kb.ROUTER_CFG
    x = torch.randn(t, kb.HIDDEN, device="cuda").to(torch.bfloat16)
    gate = (torch.randn(cfg.num_experts, kb.HIDDEN, device="cuda") / kb.HIDDEN ** 0.5
            ).to(torch.bfloat16)
    return x, gate, torch.randn(cfg.num_experts, device="cuda") * 0.01


def check_router(ids, w, x, gate, bias) -> str | None:
    """None if (ids, w) match the torch router on float64 logits for well-separated tokens."""
    from epmoe.router import route

    cfg = kb.ROUTER_CFG
    lg = x.double() @ gate.double().T
    ref = route(lg.float(), cfg, bias, backend="torch")
    b = torch.sigmoid(lg) + bias.double()
    gsc = b.view(b.shape[0], cfg.n_group, -1).topk(2, -1).values.sum(-1)
    srt = gsc.sort(-1, descending=True)
    ok = srt.values[:, cfg.topk_group - 1] - srt.values[:, cfg.topk_group] > 1e-4
    keep = torch.zeros_like(gsc, dtype=torch.bool).scatter_(1, srt.indices[:, :cfg.topk_group],
                                                            True)
    bm = b.masked_fill(~keep.repeat_interleave(b.shape[1] // cfg.n_group, 1), -1e9)
    sb = bm.sort(-1, descending=True).values
    ok &= sb[:, cfg.top_k - 1] - sb[:, cfg.top_k] > 1e-4
    gi, order = ids.long().sort(-1)
    ri, rorder = ref.topk_ids_TK.long().sort(-1)
    bad = (gi != ri).any(-1) & ok
    if int(ok.sum()) < 0.9 * ok.numel() or bool(bad.any()):
        return f"ids differ on {int(bad.sum())} of {int(ok.sum())} separated tokens"
    err = (w.gather(1, order) - ref.topk_weights_TK.gather(1, rorder))[ok].abs().max()
    return None if float(err) <= 1e-4 else f"weights differ by {float(err):.2e}"


def _call(job: str, case: Case):
    """A zero-argument function running `job`'s kernel once, plus its check (or None)."""
    from epmoe.kernels.gate_topk import triton_gate_route
    from epmoe.kernels.quantize import quantize_tokens
    from epmoe.quant import quantize_act

    kind, *rest = job.split("/")
    if kind == "gemm":
        recipe, name = rest
        cfg = (FP8_CANDIDATES if recipe == "fp8_block" else BF16_CANDIDATES)[name]
        return {g: _run_gemm(case, recipe, g, cfg) for g in GEMMS}
    if kind == "router":
        x, gate, bias = _router_inputs(case.t)
        cfg = ROUTER_CANDIDATES[rest[0]]
        return {"router": lambda: triton_gate_route(x, gate, kb.ROUTER_CFG, bias, config=cfg)}
    if kind.startswith("quant"):
        group = int(kind[5:])
        cfg = (QUANT128_CANDIDATES if group == 128 else QUANT32_CANDIDATES)[rest[0]]
        quant = kb.FP8 if group == 128 else kb.QuantConfig("mxfp8")
        x = torch.randn(case.t, kb.HIDDEN, device="cuda").to(torch.bfloat16)
        out = quantize_act(x, quant)
        return {f"quant{group}": lambda: quantize_tokens(x, quant, out=out, config=cfg)}
    return {}


def compile_main(job_list: list[str], result: str, t: int) -> int:
    """Subprocess: run each job once at T tokens (the benchmark's specializations)."""
    set_scratch_allocator()
    case = Case(t)
    done = []
    for job in job_list:
        t0 = time.time()
        try:
            if job == "other/bandwidth":
                kb.bandwidth_rows(t, {})
            elif job == "other/deepgemm":  # DeepGEMM's JIT (when installed) fills its cache
                for g, (n, _) in GEMMS.items():
                    x, w = case.gemm("fp8_block", g)
                    kb.fp8_baseline(x, w, case.layout, case.layout.num_rows, n)
            elif job.startswith("other/pointer"):
                recipe = "fp8_block" if job.endswith("fp8") else "bf16"
                for g in GEMMS:
                    _run_gemm(case, recipe, g, None, kernel="pointer")()
            else:
                for fn in _call(job, case).values():
                    fn()
            torch.cuda.synchronize()
            done.append(dict(job=job, ok=True, s=time.time() - t0))
        except Exception as exc:  # noqa: BLE001  (record the failure, keep compiling)
            done.append(dict(job=job, ok=False, s=time.time() - t0,
                             error=f"{type(exc).__name__}: {str(exc)[:300]}"))
        with open(result, "w") as f:
            dump_json(done, f)
    return 0


def parallel_compile(workers: int, timeout: float, t: int) -> dict:
    all_jobs = jobs()
    risky = [j for j in all_jobs if j.endswith("ws")]
    safe = [j for j in all_jobs if j not in risky]
    groups = [safe[i::workers] for i in range(workers)] + [[j] for j in risky]
    procs = []
    tmp = tempfile.mkdtemp(prefix="epmoe_tune_")  # not in out_dir: few files come back
    for i, g in enumerate(x for x in groups if x):
        res = os.path.join(tmp, f"compile{i}.json")
        cmd = [sys.executable, "-m", "epmoe.bench.kernel_tune", "--compile", ",".join(g),
               "--result", res, "--tokens", str(t)]
        procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True), res, g))
    t0, status = time.time(), {}
    for p, res, g in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            err = "timeout"
        got = json.load(open(res)) if os.path.exists(res) else []
        for r in got:
            status[r["job"]] = r
        for j in g:
            status.setdefault(j, dict(job=j, ok=False, error=f"subprocess died: "
                                                              f"{(err or '')[-300:]}"))
    return status


def tune(t: int, status: dict) -> tuple[dict, list[dict]]:
    """Check and time every compiled candidate at T tokens; -> (picks, records)."""
    case = Case(t)
    records, best = [], {}
    ref = {}
    for recipe in ("fp8_block", "bf16"):
        for g in GEMMS:
            ref[(recipe, g)] = _run_gemm(case, recipe, g, None, kernel="pointer")().float()
    x, gate, bias = _router_inputs(t)
    for job in jobs():
        if not job.startswith(("gemm", "router", "quant")):
            continue
        st = status.get(job, {})
        if not st.get("ok"):
            records.append(dict(job=job, compile=st.get("error", "not compiled")))
            continue
        for key, fn in _call(job, case).items():
            rec = dict(job=job, key=key)
            try:
                y = fn()
                rec["check"] = _check(job, key, y, case, ref, (x, gate, bias))
                rec["ms"] = kb.bench_ms(fn, rep=60)
            except Exception as exc:  # noqa: BLE001
                rec["check"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            records.append(rec)
            print(f"  {job:<28} {key:<8} {rec.get('ms', float('nan')) * 1e3:9.1f} us  "
                  f"{rec['check'] or 'ok'}", flush=True)
            if rec["check"] is None:
                kind = job.split("/")[0]
                slot = f"{job.split('/')[1]}/{key}" if kind == "gemm" else key
                if slot not in best or rec["ms"] < best[slot][0]:
                    best[slot] = (rec["ms"], job.split("/")[-1])
    return best, records


def _check(job, key, y, case, ref, router_in):
    from epmoe.quant import quantize_act

    if job.startswith("gemm"):
        recipe = job.split("/")[1]
        r = ref[(recipe, key)]
        valid = case.layout.row_expert_M >= 0
        err = float((y[valid].float() - r[valid]).abs().max() / r[valid].abs().max())
        return None if err <= 1e-2 else f"rel err {err:.2e}"
    if job.startswith("router"):
        return check_router(*y, *router_in)
    quant = kb.FP8 if key == "quant128" else kb.QuantConfig("mxfp8")
    torch.manual_seed(2)
    x = torch.randn(case.t, kb.HIDDEN, device="cuda").to(torch.bfloat16)
    r, q = quantize_act(x, quant), None
    from epmoe.kernels.quantize import quantize_tokens

    cfg = (QUANT128_CANDIDATES if key == "quant128" else QUANT32_CANDIDATES)[job.split("/")[1]]
    q = quantize_tokens(x, quant, config=cfg)
    same = torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8)) and torch.equal(
        q.scale.view(torch.uint8), r.scale.view(torch.uint8))
    return None if same else "not bit-exact"


def picks_to_configs(best: dict) -> dict:
    out = {}
    for slot, (_, name) in best.items():
        if slot.startswith(("fp8_block/", "bf16/")):
            out[slot] = (FP8_CANDIDATES if slot.startswith("fp8") else BF16_CANDIDATES)[name]
        elif slot == "router":
            out["router"] = ROUTER_CANDIDATES[name]
        else:
            out[slot] = (QUANT128_CANDIDATES if slot == "quant128" else
                         QUANT32_CANDIDATES)[name]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.kernel_tune",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", type=writable_dir)
    p.add_argument("--workers", type=at_least(1), default=12)
    p.add_argument("--tokens", type=int_list(1), default="4096,16384")
    p.add_argument("--phase", choices=("compile", "tune", "all"), default="all",
                   help="compile: fill the cache only; tune: use DIR/compile.json")
    p.add_argument("--compile-timeout", type=seconds, default=240.0)
    p.add_argument("--compile", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile:
        return compile_main(args.compile.split(","), args.result, args.tokens[0])
    if not torch.cuda.is_available():
        print("kernel_tune needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    tokens = args.tokens
    t0 = time.time()
    status_path = os.path.join(args.out, "compile.json")
    if args.phase in ("compile", "all"):
        status = parallel_compile(args.workers, args.compile_timeout, tokens[0])
        with open(status_path, "w") as f:
            dump_json(status, f, indent=1)
        print(f"# compiled {sum(s.get('ok', False) for s in status.values())}/{len(status)} "
              f"jobs in {time.time() - t0:.0f}s", flush=True)
        for s in status.values():
            if not s.get("ok"):
                print(f"  compile failed: {s['job']}: {s.get('error', '')[:200]}", flush=True)
        if args.phase == "compile":
            return 0
    status = json.load(open(status_path))
    set_scratch_allocator()
    best, records = tune(tokens[0], status)
    picks = picks_to_configs(best)
    report = dict(status=status, records=records,
                  picks={k: [v[1], v[0]] for k, v in best.items()},
                  configs={k: dataclasses.asdict(v) for k, v in picks.items()},
                  gemm_kernels=kernel_stats())
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        dump_json(report, f, indent=1)
    print(f"# picks: {report['picks']}", flush=True)
    for t in tokens:
        kb.run((t,), picks, os.path.join(args.out, f"kernels_{t}.json"))
    print(f"# total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    run_main(main)
