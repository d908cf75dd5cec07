"""PNG plots of a sweep (matplotlib, Agg backend: no display needed). One panel per token
count (the LL / HT regimes); a line per (gpu, routing, redundancy) of the planner's picks,
colour by GPU, dash by routing and redundancy.

step_time.png   predicted MoE-stack step time vs EP size (log-log); with `--run`, the
                measured steps as crosses in the series' colour
comm_share.png  the share of dispatch + combine + all-reduce + relayout in that time
link_bytes.png  MB one rank sends per layer, NVLink (solid) and RDMA (dashed), vs EP size
                (log scale: a class a point does not use is left out)
"""

from __future__ import annotations

from pathlib import Path

STYLES = ("-", "--", ":", "-.")


def _panels(rows):
    """tokens -> {(gpu, variant): rows sorted by ep} for the picks."""
    out: dict = {}
    for r in rows:
        if r["kind"] != "pick":
            continue
        var = r["routing"] + (f" +{r['redundant_per_rank']}/rank" if r["redundant_per_rank"]
                              else "")
        if r.get("placed_for") not in (None, r["routing"]):
            var += f" for {r['placed_for']}"
        out.setdefault(r["tokens"], {}).setdefault((r["gpu"], var), []).append(r)
    return {t: {k: sorted(v, key=lambda r: r["ep"]) for k, v in s.items()}
            for t, s in sorted(out.items())}


def _measured(rs):
    return [(r["ep"], r["measured"]["step_ms"]) for r in rs
            if r.get("measured", {}).get("status") == "ok"]


def _figure(plt, panels, title, ylabel, ys, log_y, measured=False):
    """ys: [(field, scale, linestyle or None)] drawn per series; measured: crosses at the
    rows' measured step."""
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(6 * max(len(panels), 1), 5),
                             squeeze=False)
    gpus = sorted({g for s in panels.values() for g, _ in s})
    variants = sorted({v for s in panels.values() for _, v in s})
    colors = {g: f"C{i}" for i, g in enumerate(gpus)}
    for ax, (tokens, series) in zip(axes[0], panels.items()):
        positive = False  # a log axis needs a value above 0 (one node moves no RDMA bytes)
        for (gpu, var), rs in series.items():
            for field, scale, style in ys:
                ls = style or STYLES[variants.index(var) % len(STYLES)]
                y = [r[field] * scale for r in rs]
                positive = positive or any(v > 0 for v in y)
                ax.plot([r["ep"] for r in rs], y, ls=ls,
                        marker="o", ms=3, color=colors[gpu], label=f"{gpu} {var}")
            pts = _measured(rs) if measured else []
            if pts:
                ax.plot(*zip(*pts), ls="none", marker="x", ms=8, color=colors[gpu],
                        label=f"{gpu} {var} measured")
        ax.set_xscale("log", base=2)
        if log_y and positive:
            ax.set_yscale("log")
        ax.set_xlabel("EP size (ranks)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{tokens} tokens/rank")
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    fig.legend(uniq.values(), uniq.keys(), loc="lower center", ncol=4, fontsize=7)
    what = "lines: model, crosses: measured" if measured and any(
        _measured(rs) for s in panels.values() for rs in s.values()) else "model, not measured"
    fig.suptitle(f"{title}: {ylabel} ({what})".strip(": "))
    fig.subplots_adjust(bottom=0.12 + 0.035 * ((len(uniq) + 3) // 4), top=0.88)
    return fig


def plot(rows: list[dict], out_dir, title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    panels = _panels(rows)
    paths = []
    for name, ylabel, ys, log_y in (
            ("step_time", "step ms (MoE layers)", [("step_ms", 1.0, None)], True),
            ("comm_share", "comm share %", [("comm_share", 100.0, None)], False),
            ("link_bytes", "MB/rank/layer (NVLink -, RDMA --)",
             [("nvlink_MB", 1.0, "-"), ("rdma_MB", 1.0, "--")], True)):
        fig = _figure(plt, panels, title, ylabel, ys, log_y, measured=name == "step_time")
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1], dpi=80)
        plt.close(fig)
    return paths
