"""A run's metrics through Ray's metrics API (`ray.util.metrics`): on a cluster with Ray's
metrics agent (`ray[default]`), Ray's Prometheus endpoint exposes them during and after a run.

| name                    | kind      | tags             | value                                 |
| epmoe_step_time_ms      | histogram | rank             | wall time of one step (all layers)    |
| epmoe_stage_time_ms     | gauge     | rank, stage      | ms per step in a stage (median/call)  |
| epmoe_routed_pairs      | gauge     | rank             | (token, k) pairs routed to the rank's |
|                         |           |                  | experts, over all layers and steps    |
| epmoe_eplb_balancedness | gauge     | rebalance, phase | mean/max pairs per rank; phase:       |
|                         |           |                  | before, predicted, after              |
Every metric also carries the tag `model`. Workers record step times as they happen; the driver
records the rest from the run's summary.
"""

from __future__ import annotations

from dataclasses import dataclass

STEP_MS_BOUNDARIES = [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000,
                      10000, 30000, 100000]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # histogram | gauge
    description: str
    tag_keys: tuple[str, ...]


STEP = MetricSpec("epmoe_step_time_ms", "histogram",
                  "wall time of one step (all MoE layers) on a rank, ms", ("model", "rank"))
STAGE = MetricSpec("epmoe_stage_time_ms", "gauge",
                   "ms per step a rank spends in a stage (median over steps)",
                   ("model", "rank", "stage"))
ROUTED = MetricSpec("epmoe_routed_pairs", "gauge",
                    "(token, k) pairs routed to the rank's experts, summed over layers and steps",
                    ("model", "rank"))
BALANCE = MetricSpec("epmoe_eplb_balancedness", "gauge",
                     "EPLB balancedness (mean/max pairs per rank) around each rebalance",
                     ("model", "rebalance", "phase"))
SPECS = (STEP, STAGE, ROUTED, BALANCE)
NAMES = tuple(s.name for s in SPECS)


def make(spec: MetricSpec):
    """The ray.util.metrics object of a spec (registered with Ray on creation)."""
    from ray.util import metrics

    if spec.kind == "histogram":
        return metrics.Histogram(spec.name, spec.description, boundaries=STEP_MS_BOUNDARIES,
                                 tag_keys=spec.tag_keys)
    return metrics.Gauge(spec.name, spec.description, tag_keys=spec.tag_keys)


class RankMetrics:
    """One rank's live metrics (owned by its worker)."""

    def __init__(self, rank: int, model: str):
        self.tags = {"model": model, "rank": str(rank)}
        self.step_ms = make(STEP)

    def step(self, ms: float) -> None:
        self.step_ms.observe(float(ms), tags=self.tags)


class RunMetrics:
    """The driver's metrics, recorded once from a run's summary."""

    def __init__(self):
        self.by_name = {s.name: make(s) for s in SPECS if s is not STEP}

    def record(self, summary: dict) -> None:
        model = summary["config"]["model"]
        per_rank = summary["timing"].get("stages_ms_per_rank", [])
        for rank, stages in enumerate(per_rank):
            for stage, ms in stages.items():
                self.by_name[STAGE.name].set(float(ms), tags=dict(model=model, rank=str(rank),
                                                                  stage=stage))
        for rank, pairs in enumerate(summary["load"]["tokens_per_rank"]):
            self.by_name[ROUTED.name].set(float(pairs), tags=dict(model=model, rank=str(rank)))
        for i, ev in enumerate(summary.get("eplb", {}).get("events", [])):
            for phase in ("before", "predicted", "after"):
                v = ev.get(f"balancedness_{phase}")
                if v is not None:
                    self.by_name[BALANCE.name].set(float(v), tags=dict(
                        model=model, rebalance=str(i), phase=phase))
