"""Routed stages beside the shared MLP: one timeline rule for the cost model and the calibration.

On CUDA the layer forks the shared MLP onto a side stream right after the router (layer.py), so
it runs from the start of the dispatch until it ends, beside the routed stages issued in
`ROUTED_ORDER`. A routed kernel that runs beside it shares the SMs and HBM and runs slower; one
that starts after it ended runs at its alone rate. The calibration times the routed stages
both ways (".overlapped" kernel fits and overlapped GEMM curves, from the stages that ran
entirely beside the shared MLP: `fully_beside`), and the model places each stage on the
timeline (`blend`): alone after the shared MLP's end, beside it before, and split at the end.
"""

from __future__ import annotations

ROUTED_ORDER = ("experts.permute", "experts.gemm1", "experts.act_quant", "experts.gemm2",
                "experts.gather")


def blend(alone: dict[str, float], beside: dict[str, float], start_us: float,
          shared_end_us: float) -> dict[str, float]:
    """The experts' stages on the timeline: `alone` / `beside` are each stage's time alone and
    entirely beside the shared MLP, the first starting at `start_us` (after the dispatch), the
    shared MLP ending at `shared_end_us` (both from the fork). A stage that straddles the end
    runs beside it until then at the slower rate and does the rest of its work alone. Stages
    not in ROUTED_ORDER (none today) keep their alone time; "experts" is re-summed."""
    out = dict(alone)
    t = start_us
    for s in ROUTED_ORDER:
        if s not in alone:
            continue
        a, b = alone[s], beside.get(s, alone[s])
        if t >= shared_end_us or b <= 0:
            d = a
        elif t + b <= shared_end_us:
            d = b
        else:
            done = (shared_end_us - t) / b  # the share of its work done beside the shared MLP
            d = (shared_end_us - t) + (1.0 - done) * a
        out[s] = d
        t += d
    out["experts"] = alone["experts"] + sum(out[s] - alone[s] for s in ROUTED_ORDER if s in alone)
    return out


def fully_beside(st: dict[str, float]) -> set[str]:
    """The routed stages of one measured forward that ran entirely beside the shared MLP:
    each stage's start is the dispatch plus the stages before it (their measured times) and
    it ended before the shared stage did."""
    end = st.get("shared", 0.0)
    t = st.get("dispatch", 0.0)
    inside = set()
    for s in ROUTED_ORDER:
        if s not in st:
            continue
        t += st[s]
        if t <= end:
            inside.add(s)
    return inside


__all__ = ["ROUTED_ORDER", "blend", "fully_beside"]
