"""Print a run's summary as tables that fit an 80-column terminal: the run (backend, experts,
correctness, step time, balance), stages as rows (ms per step and share of the step), ranks,
the hottest experts, and the EPLB section. Rich drops colours and styles by itself when stdout
is not a terminal (no ANSI codes in a pipe or a file)."""

from __future__ import annotations

BAR_WIDTH = 16
WIDTH = 80  # the terminal width every table fits


def table(title: str, columns: list[tuple[str, str]], rows: list[list[str]], **kw):
    """A rich Table whose cells wrap instead of being cut ("rou…"), without vertical rules (room
    for the content in 80 columns). columns: (header, justify)."""
    from rich import box
    from rich.table import Table

    kw.setdefault("box", box.SIMPLE_HEAD)
    kw.setdefault("show_edge", False)
    t = Table(title=title, title_justify="left", **kw)
    natural = sum(max([len(h)] + [len(r[i]) for r in rows]) + 3 for i, (h, _) in
                  enumerate(columns))
    for header, justify in columns:
        if natural > WIDTH:  # one word per line: the column is as wide as its longest word
            header = header.replace(" ", "\n")
        t.add_column(header, justify=justify, overflow="fold")
    for row in rows:
        t.add_row(*row)
    return t


def _bar(share: float) -> str:
    n = max(0, min(BAR_WIDTH, round(share * BAR_WIDTH)))
    return "#" * n


def correctness_line(c: dict) -> str:
    if not c.get("checked"):
        return "not checked (--no-check)"
    raw = c.get("max_rel_err_raw")  # summaries written before the slack: none
    past = "" if raw is None else f"past the rounding slack, {raw:.2e} without; "
    what = f"({past}max|out-ref|/max|ref|, float64 oracle, {c['tokens_checked']} tokens)"
    err, tol = f"{c['max_rel_err']:.2e}", f"{c['tolerance']:.0e}"
    if c["passed"]:
        return f"[green]PASS[/green] max rel err {err} <= tol {tol} {what}"
    return f"[red]FAIL[/red] max rel err {err} > tol {tol} {what}"


def router_line(rt: dict) -> str:
    verdict = "[green]PASS[/green]" if rt["passed"] else "[red]FAIL[/red]"
    return (f"{verdict} top-k sets equal to the float64 router's for {rt['agreement']:.1%} of "
            f"tokens (>= {rt['min_agreement']:.0%}), weights {rt['weight_rel_err']:.1e} "
            f"(tol {rt['weight_tol']:.0e})")


def _options_words(w: dict) -> str:
    """--comm-option knobs on the backend line; said unused when no layer ran a symm backend."""
    opts = w.get("comm_options") or {}
    words = "".join(f"; {k}={v}" for k, v in opts.items())
    if opts and not w.get("comm_options_used", True):
        words += " (unused: no layer ran symm-ht / symm-ll)"
    return words


def run_table(s: dict):
    from rich.markup import escape

    c, w, t, ld, cfg = s["correctness"], s["world"], s["timing"], s["load"], s["config"]
    rows = [*([["weights", escape(cfg["weights"])]] if cfg.get("weights", "synthetic")
               != "synthetic" else []),
            ["backend", escape(f"{w['backend']} ({w['backend_reason']})"
                               + _options_words(w))],
            ["experts", escape(str(w["experts"]))],
            ["device", escape(w["device"]) + (
                f" ({w['ranks_per_gpu']} ranks per GPU, time-sliced: the times are not speeds)"
                if w.get("ranks_per_gpu", 1) > 1 else "")],
            ["correctness", correctness_line(c)],
            *([["router", router_line(c["router"])]] if c.get("router") else []),
            ["step time", f"{t['step_ms_median']:.2f} ms median over steps 1.. (all layers, "
                          f"slowest rank); {t['tokens_per_s']:.0f} tokens/s"
                          + _overlap_words(t.get("overlap"))
                          + ("; replayed from a CUDA graph" if t.get("cuda_graph") else "")],
            *([["host issue", f"{t['host_issue_ms_median']:.2f} ms to issue a step; the step "
                              f"and stages above are GPU time (--timing device)"]]
              if t.get("mode") == "device" and t.get("host_issue_ms_median") else []),
            ["balancedness", f"{ld['balancedness']:.3f} = mean/max (token,k) pairs per rank"]]
    title = (f"epmoe: {cfg['model']}, {cfg['layers']} layer(s), {cfg['recipe']}, form "
             f"{w['form']} on {len(w['ranks'])} rank(s), {w['nodes']} node(s)")
    return table(title, [("", "left"), ("", "left")], rows, show_header=False)


def _overlap_words(ov: float | None) -> str:
    """The overlap fraction in words; negative: the stages leave gaps (barriers, host time)."""
    if ov is None:
        return ""
    if ov < 0:  # step = sum x (1 - ov): the gaps' share of the step is -ov / (1 - ov)
        return f"; {-ov / (1 - ov):.0%} of the step outside the timed stages"
    return f"; overlap {ov:.2f}"


def stage_table(s: dict):
    """Stages as rows: measured ms per step, share of the step, and the cost model's prediction
    with predicted / measured (`*`: measured under the 50 us noise floor)."""
    t = s["timing"]
    step = t["step_ms_median"] or 0.0
    pred, ratio = t.get("predicted_ms") or {}, t.get("ratio") or {}
    low = set(t.get("below_noise_floor", ()))
    rows = []
    for name, ms in t["stages_ms"].items():
        parent, _, child = name.partition(".")
        label = f"  {child}" if child else parent
        share = ms / step if step > 0 else 0.0
        p, r = pred.get(name), ratio.get(name)
        rows.append([label, f"{ms:.3f}", f"{share:.0%}", "-" if p is None else f"{p:.3f}",
                     "-" if r is None else f"{r:.2f}" + ("*" if name in low else ""),
                     _bar(share)])
    if t.get("predicted_step_ms") is not None:
        r = t.get("step_ratio")
        rows.append(["step", f"{step:.3f}", "100%", f"{t['predicted_step_ms']:.3f}",
                     "-" if r is None else f"{r:.2f}", ""])
    return table("stages: ms per step (median over steps and ranks of a step's calls), share of "
                 "the step, and the cost model's prediction",
                 [("stage", "left"), ("ms/step", "right"), ("share", "right"),
                  ("predicted", "right"), ("pred/meas", "right"), ("", "left")], rows)


def prediction_line(s: dict) -> str | None:
    info = s["timing"].get("prediction") or {}
    if info.get("error"):
        return f"no prediction: {info['error']}"
    if not info:
        return None
    host = info.get("host")
    at = f" (its host time x{host['factor']:.2f}: this host's speed)" if host else ""
    return (f"predicted by epmoe.plan with profile {info['profile']}{at} on "
            f"{info['topology']}, routing {info.get('routing', '?')}; * = measured under the "
            f"50 us noise floor")


def layer_miss_line(s: dict) -> str | None:
    """The layer and stage the model misses most (ratio furthest from 1, measured at or
    above the noise floor), from the per-layer views; None for one layer or none to judge."""
    import math

    t = s["timing"]
    meas, pred = t.get("stages_ms_per_layer") or {}, t.get("predicted_ms_per_layer") or {}
    floor = t.get("noise_floor_ms", 0.05)
    worst = None
    for name, ms in meas.items():
        for l, (m, p) in enumerate(zip(ms, pred.get(name, ()))):
            if len(ms) > 1 and m >= floor and p > 0:
                miss = abs(math.log(p / m))
                if worst is None or miss > worst[0]:
                    worst = (miss, name, l, m, p)
    if worst is None:
        return None
    _, name, l, m, p = worst
    return (f"largest per-layer miss: {name}, layer {l}: {m:.3f} ms measured, {p:.3f} "
            f"predicted ({p / m:.2f}x); all in timing.stages_ms_per_layer")


def rank_table(s: dict):
    w, ld, t = s["world"], s["load"], s["timing"]
    per_rank_ms = t.get("step_ms_median_per_rank") or []
    rows = []
    for r in w["ranks"]:
        ms = per_rank_ms[r["rank"]] if r["rank"] < len(per_rank_ms) else None
        rows.append([str(r["rank"]), str(r["node"]), r["host"],
                     str(ld["tokens_per_rank"][r["rank"]]), "-" if ms is None else f"{ms:.2f}"])
    return table("ranks: (token,k) pairs routed to each rank's experts (all layers and steps)",
                 [("rank", "right"), ("node", "right"), ("host", "left"),
                  ("pairs routed here", "right"), ("step ms", "right")], rows)


def hot_experts_line(s: dict) -> str:
    per_e = s["load"]["tokens_per_expert"]
    tot = max(sum(per_e), 1)
    hot = sorted(range(len(per_e)), key=lambda e: -per_e[e])[:8]
    return ("expert load (share of (token,k) pairs, all layers), hottest first: "
            + ", ".join(f"e{e} {per_e[e] / tot:.1%}" for e in hot)
            + f"; coldest {min(per_e) / tot:.1%}, even share {1 / len(per_e):.1%}")


def render(summary: dict, console=None) -> None:
    from rich.console import Console

    console = console or Console()
    console.print(run_table(summary))
    if "plan" in summary:
        from epmoe.launch.plan_report import render_plan

        render_plan(summary["plan"], console)
    console.print(stage_table(summary))
    for line in (prediction_line(summary), layer_miss_line(summary)):
        if line:
            console.print(line, markup=False, highlight=False)
    console.print(rank_table(summary))
    console.print(hot_experts_line(summary), markup=False, highlight=False)
    if "eplb" in summary:
        from epmoe.launch.eplb_report import render_eplb

        render_eplb(summary["eplb"], console)
