"""The cost model against published numbers nobody here measured: DeepEP's v1 tables.

Source: deepseek-ai/DeepEP, docs/legacy.md "Performance" (the README before V2; the LL table
as updated on 2025-06-05, when low-latency kernels started to use NVLink within a node).
H800 (NVLink ~160 GB/s), one CX7 400 Gb/s NIC per GPU.
- Normal (HT) kernels: 4096 tokens/rank, hidden 7168, 256 experts, top-8, top-4 groups, FP8
  dispatch, BF16 combine; tests/test_intranode.py and test_internode.py at 24 SMs with a
  cached layout. "Bottleneck bandwidth": intranode NVL = received rows (own ones included) x
  row bytes / time; internode RDMA = (token, node) pairs (own node included) x row bytes /
  time. Internode routing: one expert group per node, min(nodes, 4) groups kept.
- Low-latency kernels: 128 tokens/rank, hidden 7168, top-8, FP8 dispatch / BF16 combine,
  tests/test_low_latency.py (288 experts; 256 where 288 does not divide over the ranks);
  the latency of each kernel.

Predictions use the spec-derived `h800` profile and `Topology.parse("Nx8", gpu="h800")`: no
constant here or in the profile was fitted to these rows (see epmoe/plan/specs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.config import QuantConfig, get_preset
from epmoe.plan.comm_cost import CommCase, combine_cost, dispatch_cost
from epmoe.plan.profile import load_profile
from epmoe.plan.routing import RoutingSpec, routing_stats
from epmoe.plan.topology import Topology

SOURCE = "deepseek-ai/DeepEP docs/legacy.md (v1 README), H800 + CX7 400 Gb/s"
HT_SMS = 24  # tests/test_intranode.py / test_internode.py: `for i in (24, )`, num_sms = 24


@dataclass(frozen=True)
class Row:
    """One published figure: mode ht|ll, ep ranks, direction, value, unit (GB/s or us)."""

    mode: str
    ep: int
    direction: str
    published: float
    unit: str

    @property
    def name(self) -> str:
        return f"{self.mode.upper()} EP{self.ep} {self.direction}"


PUBLISHED = (
    Row("ht", 8, "dispatch", 153.0, "GB/s"), Row("ht", 8, "combine", 158.0, "GB/s"),
    Row("ht", 16, "dispatch", 43.0, "GB/s"), Row("ht", 16, "combine", 43.0, "GB/s"),
    Row("ht", 32, "dispatch", 58.0, "GB/s"), Row("ht", 32, "combine", 57.0, "GB/s"),
    Row("ht", 64, "dispatch", 51.0, "GB/s"), Row("ht", 64, "combine", 50.0, "GB/s"),
    Row("ll", 8, "dispatch", 77.0, "us"), Row("ll", 8, "combine", 114.0, "us"),
    Row("ll", 16, "dispatch", 118.0, "us"), Row("ll", 16, "combine", 195.0, "us"),
    Row("ll", 32, "dispatch", 155.0, "us"), Row("ll", 32, "combine", 273.0, "us"),
    Row("ll", 64, "dispatch", 173.0, "us"), Row("ll", 64, "combine", 314.0, "us"),
    Row("ll", 128, "dispatch", 192.0, "us"), Row("ll", 128, "combine", 369.0, "us"),
    Row("ll", 256, "dispatch", 194.0, "us"), Row("ll", 256, "combine", 360.0, "us"),
)
HIDDEN = 7168
FP8 = QuantConfig("fp8_block")


@dataclass(frozen=True)
class Result:
    row: Row
    predicted: float
    kernel_us: float
    link: str  # the bottleneck link class in the model

    @property
    def error(self) -> float:
        return (self.predicted - self.row.published) / self.row.published


def _case(row: Row, prof) -> tuple[CommCase, object]:
    nodes = max(1, row.ep // 8)
    topo = Topology.parse(f"{nodes}x{min(row.ep, 8)}", gpu="h800")
    base = get_preset("deepseek-v3")
    if row.mode == "ht":
        tokens, e = 4096, 256
        groups = (nodes, min(nodes, 4)) if nodes > 1 else (1, 1)
    else:
        tokens, e = 128, 288 if 288 % row.ep == 0 else 256
        groups = (1, 1)
    cfg = base.replace(num_experts=e, hidden=HIDDEN, top_k=8, n_group=groups[0],
                       topk_group=groups[1], router="sigmoid_grouped")
    stats = routing_stats(cfg, RoutingSpec(), topo.world, topo.gpus_per_node)
    case = CommCase(cfg, FP8, topo, prof, stats, tokens, tokens,
                    sms=HT_SMS if row.mode == "ht" else None, reuse_layout=True)
    return case, stats


def predict(row: Row, prof=None) -> Result:
    prof = load_profile(prof or "h800")
    case, stats = _case(row, prof)
    backend = "deepep-ht" if row.mode == "ht" else "deepep-ll"
    cost = (dispatch_cost if row.direction == "dispatch" else combine_cost)(backend, case)
    t = cost.kernel_us
    d = row.direction
    link = max(("nvlink", "rdma"), key=lambda c: cost.notes.get(f"{d}.{c}_bytes", 0.0) /
               cost.notes.get(f"{d}.{c}_GBps", 1.0))  # the class that takes longest
    if row.mode == "ll":
        return Result(row, t, t, link)
    row_bytes = HIDDEN + HIDDEN / 128 * 4 if row.direction == "dispatch" else 2.0 * HIDDEN
    if row.ep <= 8:  # received rows, own ones included
        units = case.topo.world * case.tokens * stats.hit_rank[0]
    else:  # (token, node) pairs, own node included
        units = case.tokens * stats.nodes_per_token
    return Result(row, units * row_bytes / (t * 1e3), t, link)


def validate(prof=None) -> list[Result]:
    return [predict(r, prof) for r in PUBLISHED]


def table(results: list[Result]) -> str:
    lines = ["DeepEP published (H800) vs this model (the spec-derived h800 profile)",
             f"source: {SOURCE}",
             f"{'case':<22}{'published':>12}{'model':>12}{'error':>9}  {'limit':<7}"
             f"{'kernel us':>10}", "-" * 74]
    for r in results:
        lines.append(f"{r.row.name:<22}{r.row.published:>8.0f} {r.row.unit:<4}"
                     f"{r.predicted:>7.0f} {r.row.unit:<4}{100 * r.error:>+8.1f}%  {r.link:<7}"
                     f"{r.kernel_us:>10.0f}")
    return "\n".join(lines)
