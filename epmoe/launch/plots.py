"""PNG plots of a run (`--plot DIR`), drawn from its summary with matplotlib's Agg canvas (no
display, no pyplot global state):

| file                   | shows                                                              |
| load_heatmap.png       | (token, k) pairs routed per layer x logical expert, whole run      |
| stage_times.png        | ms per step in each top-level stage, one stacked bar per rank      |
| layer_stages.png       | per MoE layer, its stages measured (solid) and predicted (hatched) |
| eplb_balancedness.png  | balancedness before / predicted / after each rebalance (--eplb)    |
"""

from __future__ import annotations

from pathlib import Path


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _title(s: dict) -> str:
    c, w = s["config"], s["world"]
    return f"{c['model']}, {c['recipe']}, {w['form']} x{len(w['ranks'])}, {c['steps']} steps"


def load_heatmap(s: dict, path: Path) -> Path:
    load = s["load"]["tokens_per_layer_expert"]
    fig = _figure(max(6.0, 0.25 * len(load[0]) + 2), max(2.5, 0.35 * len(load) + 1.5))
    ax = fig.add_subplot()
    im = ax.imshow(load, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("logical expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(load)))
    ax.set_title(f"(token, k) pairs routed per layer x expert\n{_title(s)}", fontsize=9)
    fig.colorbar(im, ax=ax, label="pairs")
    fig.savefig(path)
    return path


def stage_times(s: dict, path: Path) -> Path:
    per_rank = s["timing"]["stages_ms_per_rank"]
    top = [n for n in s["timing"]["stages_ms"] if "." not in n]  # sub-stages nest in these
    fig = _figure(7.0, max(2.5, 0.4 * len(per_rank) + 1.5))
    ax = fig.add_subplot()
    left = [0.0] * len(per_rank)
    for name in top:
        vals = [r.get(name, 0.0) for r in per_rank]
        ax.barh(range(len(per_rank)), vals, left=left, label=name)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median over steps of a step's calls)")
    ax.set_title(f"where each rank's step goes\n{_title(s)}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.savefig(path)
    return path


def layer_stages(s: dict, path: Path) -> Path | None:
    """Per layer two stacked bars of its top-level stages: measured (`stages_ms_per_layer`)
    and the cost model's (`predicted_ms_per_layer`, hatched, same colours); None when the
    run has neither per-layer view."""
    t = s["timing"]
    meas, pred = t.get("stages_ms_per_layer") or {}, t.get("predicted_ms_per_layer") or {}
    top = [n for n in list(meas) + [k for k in pred if k not in meas]
           if "." not in n and n in meas]  # the stages every layer called, as measured
    if not top:
        return None
    layers = len(meas[top[0]])
    fig = _figure(7.0, max(2.5, 0.45 * layers + 1.6))
    ax = fig.add_subplot()
    colours = {}
    for row, (src, hatch, off) in enumerate(((meas, None, -0.2), (pred, "//", 0.2))):
        left = [0.0] * layers
        for name in top:
            vals = src.get(name)
            if not vals:
                continue
            bars = ax.barh([l + off for l in range(layers)], vals, height=0.38, left=left,
                           label=name if row == 0 else None, hatch=hatch,
                           color=colours.get(name), edgecolor="white" if hatch else None)
            colours.setdefault(name, bars.patches[0].get_facecolor())
            left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(layers), [f"layer {l}" for l in range(layers)])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step: measured (upper bar), predicted (lower, hatched)\n(on CUDA "
                  "the shared MLP overlaps the routed path)", fontsize=8)
    ax.set_title(f"each layer's stages, measured and predicted\n{_title(s)}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path)
    return path


def eplb_balancedness(s: dict, path: Path) -> Path:
    events = s["eplb"]["events"]
    x = [e["step"] for e in events]
    fig = _figure(6.0, 3.5)
    ax = fig.add_subplot()
    for key, style in (("balancedness_before", "o-"), ("balancedness_predicted", "s--"),
                       ("balancedness_after", "^-")):
        pts = [(xi, e.get(key)) for xi, e in zip(x, events) if e.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style,
                    label=key.split("_", 1)[1])
    from matplotlib.ticker import MaxNLocator

    ax.set_ylim(0, 1.05)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("rebalance after step")
    ax.set_ylabel("mean / max pairs per rank")
    ax.set_title(f"EPLB balancedness around each rebalance\n{_title(s)}", fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path)
    return path


def write_plots(summary: dict, out_dir: str) -> list[Path]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = [load_heatmap(summary, d / "load_heatmap.png"),
             stage_times(summary, d / "stage_times.png")]
    per_layer = layer_stages(summary, d / "layer_stages.png")
    if per_layer is not None:
        paths.append(per_layer)
    if summary.get("eplb", {}).get("events"):
        paths.append(eplb_balancedness(summary, d / "eplb_balancedness.png"))
    return paths
