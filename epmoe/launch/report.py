"""Turn the ranks' reports into one summary: oracle check, timing, load; a table and JSON."""

from __future__ import annotations

import datetime
import statistics

import torch

from epmoe import __version__
from epmoe.plan.run import RunConfig
from epmoe.reference import TOLERANCE, max_rel_err, reference_moe, reference_route
from epmoe.weights import synthetic_layer

# Beyond this many oracle FLOPs the check covers a prefix of each rank's tokens.
MAX_CHECK_TOKENS_PER_RANK = 64


class LazyOracleLayer:
    """The float64 oracle's weights of one layer, built per expert on first use (a full-size
    model never materializes all of its experts)."""

    def __init__(self, run: RunConfig, layer: int):
        self.run, self.layer = run, layer
        lw = synthetic_layer(run.cfg, run.quant, layer, run.seed, [], with_shared=True)
        from epmoe.weights import layer_to_oracle

        self.gate, self.bias, _, _, self.shared = layer_to_oracle(lw)
        self._cache: dict[int, tuple] = {}
        outer = self

        class _Idx:
            def __init__(self, j):
                self.j = j

            def __getitem__(self, e):
                return outer._expert(int(e))[self.j]

        self.w13, self.w2 = _Idx(0), _Idx(1)

    def _expert(self, e: int):
        if e not in self._cache:
            from epmoe.quant import dequantize_weight

            lw = synthetic_layer(self.run.cfg, self.run.quant, self.layer, self.run.seed, [e],
                                 with_shared=False)
            self._cache[e] = (dequantize_weight(lw.experts.w13)[0].double(),
                              dequantize_weight(lw.experts.w2)[0].double())
        return self._cache[e]

    def as_tuple(self):
        return self.gate, self.bias, self.w13, self.w2, self.shared


def layer_sources(run: RunConfig, reports: list[dict], l: int) -> list[dict]:
    """The reports whose layer-l rows together are the step's batch: every rank's own rows, or
    rank 0's (a replicated layer: every rank holds the same gathered batch)."""
    return reports if run.holds_own_rows(l) and run.own_tokens else reports[:1]


def check_correctness(run: RunConfig, reports: list[dict]) -> dict:
    """Compare every layer's output (last step) with the float64 oracle on the gathered tokens."""
    if not run.check or not reports[0]["last"]:
        return dict(checked=False, passed=None, max_rel_err=None,
                    tolerance=TOLERANCE[run.quant.recipe])
    per_layer, router, checked = [], [], 0
    for l in range(run.num_layers):
        srcs = layer_sources(run, reports, l)
        n_check = min(run.layer_tokens(l), MAX_CHECK_TOKENS_PER_RANK)
        recs = [r["last"][l] for r in srcs]
        x = torch.cat([rec["x"][:n_check] for rec in recs])
        out = torch.cat([rec["out"][:n_check] for rec in recs])
        # the routing the layer used: the oracle replays it (the router is checked apart)
        ids = torch.cat([rec["ids"][:n_check] for rec in recs])
        w = torch.cat([rec["w"][:n_check] for rec in recs])
        oracle = LazyOracleLayer(run, l).as_tuple()
        ref = reference_moe(x, oracle, run.cfg, run.quant, ids, w)
        per_layer.append(max_rel_err(out, ref))
        if bool(recs[0].get("routed", False)):
            router.append(check_router(x, ids, w, oracle, run.cfg))
        checked = max(checked, n_check * len(srcs))
        if len(srcs) == 1:  # replicated tokens: every rank must hold the same output
            for r in reports[1:]:
                other = r["last"][l]["out"][:n_check]
                per_layer[-1] = max(per_layer[-1], max_rel_err(other, ref))
    tol = TOLERANCE[run.quant.recipe]
    worst = max(per_layer)
    out = dict(checked=True, passed=bool(worst <= tol), max_rel_err=worst, tolerance=tol,
               per_layer=per_layer, tokens_checked=checked,
               metric="max|out-ref| / max|ref| per layer, float64 oracle (replaying the "
                      "routing each layer used)")
    if router:
        agree = min(r["agreement"] for r in router)
        w_err = max(r["weight_rel_err"] for r in router)
        ok = agree >= ROUTER_MIN_AGREEMENT and w_err <= ROUTER_WEIGHT_TOL
        out["router"] = dict(passed=ok, agreement=agree, weight_rel_err=w_err,
                             min_agreement=ROUTER_MIN_AGREEMENT, weight_tol=ROUTER_WEIGHT_TOL,
                             metric="share of tokens whose top-k set equals the float64 "
                                    "router's (worst layer); weights of those tokens")
        out["passed"] = out["passed"] and ok
    return out


# The layer's router may compute logits in bf16 with fp32 accumulation (the fused GPU router):
# tokens whose k-th and (k+1)-th scores lie within that rounding may pick the other expert, a
# legitimate difference. The MoE output is checked against the oracle on the routing the layer
# used; the router is checked here: nearly every token's top-k set must equal the oracle's.
ROUTER_MIN_AGREEMENT = 0.9
ROUTER_WEIGHT_TOL = 1e-2


def check_router(x, ids, w, oracle, cfg) -> dict:
    """Top-k sets and weights of the layer's router against the float64 reference router."""
    gate, bias = oracle[0], oracle[1]
    ref_ids, ref_w = reference_route(x.double() @ gate.T, cfg, bias)
    ids_s, order = ids.long().sort(1)
    ref_s, ref_order = ref_ids.sort(1)
    same = (ids_s == ref_s).all(1)
    w_err = 0.0
    if same.any():
        got = w.double().gather(1, order)[same]
        want = ref_w.gather(1, ref_order)[same]
        w_err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
    return dict(agreement=float(same.double().mean()) if same.numel() else 1.0,
                weight_rel_err=w_err)


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize(run: RunConfig, reports: list[dict], where: list[dict], extra: dict | None = None) -> dict:
    world = run.world
    steps = len(reports[0]["step_ms"])
    step_ms = [max(r["step_ms"][s] for r in reports) for s in range(steps)]
    timed = step_ms[1:] if steps > 1 else step_ms  # step 0 warms up
    stages = {}
    order = ["router", "dispatch", "dispatch.quantize", "experts", "experts.permute", "experts.gemm1",
             "experts.act_quant", "experts.gemm2", "experts.gather", "combine", "shared",
             "all_reduce"]
    names = {k for r in reports for k in r["stages_ms"]}
    for name in [n for n in order if n in names] + sorted(names - set(order)):
        vals = [v for r in reports for v in r["stages_ms"].get(name, [])]
        # per-call median, times calls per step = ms per step spent in the stage
        per_step = len(vals) / (len(reports) * steps)
        stages[name] = _median(vals) * per_step
    tokens_step = run.global_tokens
    cfg = run.cfg
    per_rank = [0] * world
    per_expert = 0
    for l in range(run.num_layers):
        srcs = layer_sources(run, reports, l)
        per_slot = sum(r["load_LS"][l] for r in srcs)  # [slots]
        per_expert = per_expert + sum(r["load_LE"][l] for r in srcs)
        if run.layer_spec(l).form == "tp":  # every rank runs every pair (a slice of I)
            per_rank = [p + int(per_slot.sum()) for p in per_rank]
        else:
            per_rank = [p + int(x) for p, x in zip(per_rank, per_slot.view(world, -1).sum(1))]
    bal = (sum(per_rank) / len(per_rank)) / max(max(per_rank), 1)
    nodes = sorted({w["node_id"] for w in where})
    summary = dict(
        epmoe_version=__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        config=dict(model=run.model, recipe=run.quant.recipe, scale_fmt=run.quant.scale_fmt,
                    tokens_per_rank=run.tokens if run.own_tokens else None,
                    tokens=tokens_step, layers=run.num_layers, steps=run.steps, seed=run.seed,
                    routing=run.routing, hidden=cfg.hidden, moe_intermediate=cfg.moe_intermediate,
                    num_experts=cfg.num_experts, top_k=cfg.top_k),
        world=dict(form="mixed" if run.mixed else run.form,
                   ep=world if run.form != "tp" or run.mixed else 1,
                   tp=world if "tp" in run.forms else 1, dp=world if run.own_tokens else 1,
                   layers=[dict(form=f, backend=b[0], reason=b[1]) for f, b in
                           zip(run.forms, reports[0].get("layer_backends", []))],
                   backend=reports[0]["backend"], backend_reason=reports[0]["backend_reason"],
                   experts=reports[0]["experts_reason"], device=reports[0]["device"],
                   nodes=len(nodes),
                   ranks=[dict(rank=w["rank"], host=w["host"], node=nodes.index(w["node_id"]),
                               device=w["device"]) for w in where]),
        correctness=check_correctness(run, reports),
        timing=dict(step_ms_median=_median(timed), step_ms=step_ms, stages_ms=stages,
                    tokens_per_s=tokens_step / (_median(timed) / 1e3) if timed else None,
                    note="step = all layers, max over ranks; median excludes step 0 (warm-up)"),
        load=dict(tokens_per_expert=per_expert.tolist(), tokens_per_rank=per_rank,
                  balancedness=bal, unit="(token, k) pairs summed over layers and steps"),
    )
    if extra:
        summary.update(extra)
    return summary


def render(summary: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    c, w, t, ld = (summary["correctness"], summary["world"], summary["timing"], summary["load"])
    cfg = summary["config"]
    head = Table(title=f"epmoe: {cfg['model']} x{cfg['layers']} layers, {cfg['recipe']}, "
                       f"form {w['form']} on {len(w['ranks'])} rank(s), {w['nodes']} node(s)",
                 show_header=False)
    head.add_row("backend", f"{w['backend']} ({w['backend_reason']})")
    head.add_row("experts", str(w["experts"]))
    head.add_row("device", w["device"])
    if c.get("checked"):
        ok = "[green]PASS[/green]" if c["passed"] else "[red]FAIL[/red]"
        head.add_row("correctness", f"{ok} max rel err {c['max_rel_err']:.2e} <= tol "
                                    f"{c['tolerance']:.0e} over {c['tokens_checked']} tokens")
        if c.get("router"):
            rt = c["router"]
            head.add_row("router", f"{'PASS' if rt['passed'] else 'FAIL'} top-k sets equal "
                                   f"to the oracle's for {rt['agreement']:.1%} of tokens "
                                   f"(>= {rt['min_agreement']:.0%}), weights "
                                   f"{rt['weight_rel_err']:.1e}")
    else:
        head.add_row("correctness", "not checked (--no-check)")
    head.add_row("step time", f"{t['step_ms_median']:.2f} ms median  ({t['tokens_per_s']:.0f} "
                              f"tokens/s)")
    head.add_row("balancedness", f"{ld['balancedness']:.3f} (mean/max tokens per rank)")
    console.print(head)
    from epmoe.launch.plan_report import render_plan, render_stages

    if "plan" in summary:
        render_plan(summary["plan"], console)
    render_stages(t, console)  # measured, predicted, ratio
    rk = Table(title="ranks")
    for col in ("rank", "node", "host", "tokens routed here"):
        rk.add_column(col, justify="right")
    for r in w["ranks"]:
        rk.add_row(str(r["rank"]), str(r["node"]), r["host"],
                   str(ld["tokens_per_rank"][r["rank"]]))
    console.print(rk)
    per_e = ld["tokens_per_expert"]
    tot = max(sum(per_e), 1)
    hot = sorted(range(len(per_e)), key=lambda e: -per_e[e])[:8]
    console.print("per-expert load (share of (token,k) pairs), hottest first: "
                  + ", ".join(f"e{e} {per_e[e] / tot:.1%}" for e in hot)
                  + f"  | min {min(per_e) / tot:.1%}, ideal {1 / len(per_e):.1%}")
    if "eplb" in summary:
        from epmoe.launch.eplb_report import render_eplb

        render_eplb(summary["eplb"], console)
