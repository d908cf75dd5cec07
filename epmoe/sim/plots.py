"""PNG plots of a sweep (matplotlib, Agg backend: no display needed).

step_time.png   predicted MoE-stack step time vs EP size, one line per (gpu, tokens, routing,
                redundancy) of the planner's picks
comm_share.png  the share of dispatch + combine + all-reduce in that time
link_bytes.png  bytes one rank sends per layer on NVLink and on RDMA vs EP size
"""

from __future__ import annotations

from pathlib import Path


def _series(rows):
    out: dict = {}
    for r in rows:
        if r["kind"] != "pick":
            continue
        key = f"{r['gpu']} T={r['tokens']} {r['routing']}" + (
            f" +{r['redundant_per_rank']}/rank" if r["redundant_per_rank"] else "")
        out.setdefault(key, []).append(r)
    return {k: sorted(v, key=lambda r: r["ep"]) for k, v in out.items()}


def _finish(fig, ax, path: Path, title: str, ylabel: str, fontsize: int) -> Path:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("EP size (ranks)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title} {ylabel} (model, not measured)".strip())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=fontsize)
    fig.savefig(path, dpi=80)
    return path


def plot(rows: list[dict], out_dir, title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series = _series(rows)
    paths = []
    for name, field, ylabel, scale in (("step_time", "step_ms", "step (ms, MoE layers)", 1.0),
                                       ("comm_share", "comm_share", "comm share (%)", 100.0)):
        fig, ax = plt.subplots(figsize=(8, 5))
        for key, rs in series.items():
            ax.plot([r["ep"] for r in rs], [r[field] * scale for r in rs], marker="o",
                    label=key)
        paths.append(_finish(fig, ax, out / f"{name}.png", title, ylabel, 7))
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, rs in series.items():
        eps = [r["ep"] for r in rs]
        ax.plot(eps, [r["nvlink_MB"] for r in rs], marker="o", label=f"{key} nvlink")
        ax.plot(eps, [r["rdma_MB"] for r in rs], marker="x", ls="--", label=f"{key} rdma")
    paths.append(_finish(fig, ax, out / "link_bytes.png", title,
                         "MB sent per rank per layer", 6))
    plt.close(fig)
    return paths
