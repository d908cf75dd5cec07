"""`python -m epmoe.plan`: print (or write) the plan of a model's MoE stack without running it.

    python -m epmoe.plan --model deepseek-v3 --topology 2x8 --tokens 128,4096
    python -m epmoe.plan --model qwen3-235b-a22b --topology 1x8 --profile b200 --json
    python -m epmoe.plan ... --out plan.json      # a plan file for `launch --plan FILE`

Exit codes: 0 planned, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from epmoe.config import (DEFAULT_RECIPES, PRESETS, RECIPES, SCALE_FMTS, QuantConfig,
                          default_scale_fmt, fitting_recipe, get_preset)
from epmoe.plan.forms import FORMS
from epmoe.plan.planfile import Plan
from epmoe.plan.planner import SCOPES, plan_stack
from epmoe.plan.profile import load_profile, shipped_profiles
from epmoe.plan.recorded import RecordedRouting, is_recorded, read_recorded
from epmoe.plan.topology import LINK_SPECS, Topology
from epmoe.outputs import json_text, run_main, writable_file


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epmoe.plan", description=(
        "Choose per MoE layer and token bucket the parallel form, comm backend and experts "
        "kernel with the lowest predicted time (epmoe.plan.cost) that fits in memory."))
    p.add_argument("--model", default="deepseek-v3",
                   help=f"preset ({', '.join(PRESETS)}), or a Hugging Face config.json "
                        f"(or the folder holding it)")
    p.add_argument("--topology", default="1x8",
                   help="NODESxGPUS (e.g. 2x8) or a topology JSON file")
    p.add_argument("--tokens", default="128,4096",
                   help="token buckets, tokens per rank, comma separated (default 128,4096)")
    p.add_argument("--profile", default="h200",
                   help=f"shipped profile ({', '.join(shipped_profiles())}) or a JSON file")
    p.add_argument("--quant", default=None,
                   help=f"recipe: {', '.join(RECIPES)} (default: the first of "
                        f"{', '.join(DEFAULT_RECIPES)} whose groups tile the model's widths)")
    p.add_argument("--scale-fmt", default=None,
                   help=f"{', '.join(SCALE_FMTS)} (default: ue8m0_fp32 on SM100, else fp32)")
    p.add_argument("--routing", default="uniform",
                   help="uniform | zipf:S | FILE: a launch summary's recorded load per layer "
                        "(and an EPLB run's placement), or a routing trace (trace:FILE, "
                        ".pt / .safetensors; epmoe/plan/recorded.py)")
    p.add_argument("--redundant-experts", type=int, default=0, help="EPLB extra slots")
    p.add_argument("--layers", type=int, default=None, help="MoE layers (default: preset)")
    p.add_argument("--forms", default=None, help=f"restrict forms: {','.join(FORMS)}")
    p.add_argument("--scope", default="runtime", choices=SCOPES,
                   help="runtime: what epmoe runs today; model: every modelled mechanism")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory budget per rank (default 90%% of the profile's HBM)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--out", default=None, type=writable_file,
                   help="write the plan file (JSON) here")
    return p


def build(args) -> tuple[Plan, list[str]]:
    """The plan, and notes on what was chosen for the user (the recipe when not given)."""
    cfg = get_preset(args.model)
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers ({args.layers}) must be >= 1")
    rec = read_recorded(args.routing, num_experts=cfg.num_experts) \
        if is_recorded(args.routing) else None
    layers = args.layers or (rec.layers if rec else None)
    routing = _recorded_kwargs(rec, cfg, args, layers) if rec else dict(
        routing=args.routing, redundant_experts=args.redundant_experts)
    if layers is not None:
        cfg = cfg.replace(num_moe_layers=layers)
    prof = load_profile(args.profile)
    recipe, why = (args.quant, None) if args.quant else fitting_recipe(cfg)
    notes = textwrap.wrap(f"note: {why}; planned as {recipe} (--quant to choose)", 80,
                          subsequent_indent="  ") if why else []
    if rec:
        notes += textwrap.wrap(f"note: planned at the {rec.describe()}", 80,
                               subsequent_indent="  ")
    quant = QuantConfig(recipe, args.scale_fmt or default_scale_fmt(recipe, prof.fig("sm_arch")))
    gpu = prof.gpu if prof.gpu in LINK_SPECS else "h200"
    topo = Topology.resolve(args.topology, gpu)
    if topo.gpu != prof.gpu:
        notes += textwrap.wrap(f"note: the topology's GPU ({topo.gpu}) is not the profile's "
                               f"({prof.gpu}): links from the topology, the rest from profile "
                               f"{prof.name} (--profile to choose)", 80, subsequent_indent="  ")
    try:
        buckets = [int(x) for x in str(args.tokens).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--tokens {args.tokens!r} must be comma-separated integers, e.g. "
                         f"128,4096") from None
    forms = tuple(f.strip() for f in args.forms.split(",")) if args.forms else None
    if forms and set(forms) - set(FORMS):
        raise ValueError(f"--forms {args.forms!r}: each must be one of {FORMS}")
    if args.redundant_experts < 0:
        raise ValueError(f"--redundant-experts ({args.redundant_experts}) must be >= 0")
    if args.memory_gib is not None and not args.memory_gib > 0:
        raise ValueError(f"--memory-gib ({args.memory_gib}) must be > 0 (GiB per rank)")
    return plan_stack(cfg, quant, topo, prof, buckets, scope=args.scope, forms=forms,
                      memory_GiB=args.memory_gib, model=args.model, **routing), notes


def _recorded_kwargs(rec: RecordedRouting, cfg, args, layers: int) -> dict:
    """plan_stack's routing keywords for a recorded load planned over `layers` (checked
    against the model and the flags); one recorded layer stands for every layer."""
    loads = rec.fitted(cfg.num_experts, layers, f"--routing {args.routing}", args.model,
                       f"plan them (--layers {rec.layers}) or give a file of {layers}")
    if rec.phy2log_LR is None:
        return dict(loads_LE=loads, redundant_experts=args.redundant_experts)
    if args.redundant_experts not in (0, rec.redundant_experts):
        raise ValueError(f"--redundant-experts {args.redundant_experts}: the file's EPLB "
                         f"placement has {rec.redundant_experts} (drop the flag)")
    return dict(loads_LE=loads, placement=rec.phy2log_LR * (len(loads) // rec.layers),
                redundant_experts=rec.redundant_experts)


def render(plan: Plan, buckets=None) -> str:
    """80-column table: runs of equal layers collapsed, one reason line per run (buckets:
    the token counts to show, default every bucket of the plan)."""
    t = Topology.from_dict(plan.topology)
    lines = [f"plan: {plan.model} {plan.quant.recipe} on {t.describe()}"[:80],
             f"profile {plan.profile}, scope {plan.scope}; tokens per rank"[:80],
             f"{'layers':<8}{'tokens':>7}  {'form':<6}{'backend':<10}{'experts':<9}"
             f"{'layer ms':>9}{'stack ms':>10}", "-" * 80]
    for tokens in plan.buckets if buckets is None else buckets:
        runs = []
        for e in plan.layers:
            c = e.choice(tokens)
            if runs and runs[-1][2].label == c.label and runs[-1][2].why == c.why:
                runs[-1][1] = e.layer
            else:
                runs.append([e.layer, e.layer, c])
        for a, b, c in runs:
            span = f"{a}" if a == b else f"{a}-{b}"
            lines.append(f"{span:<8}{tokens:>7}  {c.form:<6}{c.backend:<10}{c.experts:<9}"
                         f"{c.predicted_us / 1e3:>9.3f}{plan.step_us(tokens) / 1e3:>10.2f}")
            lines.append(("  " + c.why)[:80])
    return "\n".join(lines)


def profile_notes(plan: Plan, prof) -> list[str]:
    """What the prediction borrowed: one note per experts backend of the plan whose recipe the
    profile has no GEMM curves for (the model then prices it from fp8_block's curves, e.g.
    mxfp8, which Triton runs at about half fp8_block's rate)."""
    recipe, out = plan.quant.recipe, []
    chosen = {e.choice(t).experts for e in plan.layers for t in plan.buckets}
    for ex in sorted(chosen - {"torch"}):  # torch computes in fp32: bf16 curves by design
        if recipe not in {c.recipe for c in prof.gemm if c.backend == ex}:
            src = "fp8_block" if recipe != "bf16" else "bf16"
            out += [f"note: {ex} {recipe} GEMMs are priced from {src} curves: profile",
                    f"  {prof.name} has none (python -m epmoe.bench.calibrate --recipes "
                    f"{recipe})"]
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        plan, notes = build(args)
    except (ValueError, KeyError) as exc:
        print(f"error: {str(exc).strip(chr(34))}", file=sys.stderr)
        return 2
    if args.out:
        plan.save(args.out)
    notes += profile_notes(plan, load_profile(args.profile))
    if args.json:
        print(json_text(plan.to_dict()))
        if notes:  # stdout stays one JSON document
            print("\n".join(notes), file=sys.stderr)
    else:
        print("\n".join([render(plan), *notes]))
    return 0


if __name__ == "__main__":
    run_main(main)
