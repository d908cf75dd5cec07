"""The cost model against published numbers nobody here measured.

A published table is a TOML file (the shipped ones are in `epmoe/sim/published/`): its
`name`, `source` (where the figures were printed), the `gpu` (a shipped profile) and the
defaults of the measured case (`tokens` per rank, `hidden`, `top_k`, the `dispatch` recipe,
`gpus_per_node`), then `rows`, one inline table per figure:

    rows = [
      { mode = "ht", ep = 8, direction = "dispatch", published = 153.0, unit = "GB/s",
        experts = 256, sms = 24 },
    ]

with `mode` ht (DeepEP's normal kernels) or ll (low latency), `unit` us (the kernel's
latency) or GB/s in DeepEP's convention: intranode, every received row (the rank's own
included) x row bytes / time; internode, every (token, destination node) pair (own node
included) x row bytes / time; low-latency (`tests/test_low_latency.py`), every (token,
expert) selection the rank sends x (an FP8 row with its scales and 16 header bytes for
dispatch, whatever the recipe, as that test counts; a BF16 row for combine) / time.
Optional per row (or as a table default): `n_group` / `topk_group` (group-limited routing),
`sms` (SMs given to the HT kernels), `tokens`, `kernels` ("v1", the default, or "v2": DeepEP
V2's normal kernels, modelled as bound by their links alone: epmoe.plan.comm_cost),
`ll_nvlink` (ll only; default true: false for DeepEP's LL kernels with NVLink off,
`allow_nvlink_for_low_latency_mode=False` and every table of theirs before 2025-06-05: each
peer, the same node's too, over RDMA). Rows are predicted with the table's
GPU profile (or one given) and `Topology.parse("Nx8")`; no constant in a profile is fitted to
any row (see epmoe/plan/specs.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from pathlib import Path

from epmoe.config import QuantConfig, get_preset
from epmoe.docfile import is_int, is_number, read_doc
from epmoe.plan.comm_cost import CommCase, combine_cost, dispatch_cost
from epmoe.plan.profile import load_profile
from epmoe.plan.routing import RoutingSpec, routing_stats
from epmoe.plan.topology import Topology
from epmoe.plan.traffic import LL_HEADER_BYTES, act_row_bytes

PUBLISHED_DIR = Path(__file__).parent / "published"
MODES, DIRECTIONS, UNITS = ("ht", "ll"), ("dispatch", "combine"), ("GB/s", "us")
KERNELS = ("v1", "v2")  # DeepEP's kernel generation (V2: normal kernels only)
BACKEND = {("ht", "v1"): "deepep-ht", ("ll", "v1"): "deepep-ll", ("ht", "v2"): "deepep-v2"}


@dataclass(frozen=True)
class Row:
    """One published figure and the case it was measured on."""

    table: str
    source: str
    gpu: str
    mode: str
    ep: int
    direction: str
    published: float
    unit: str
    experts: int
    tokens: int
    hidden: int
    top_k: int
    dispatch: str  # the recipe of the dispatched rows (combine rows are bf16)
    gpus_per_node: int = 8
    n_group: int = 1
    topk_group: int = 1
    sms: int | None = None
    kernels: str = "v1"
    ll_nvlink: bool = True

    @property
    def name(self) -> str:
        return f"{self.mode.upper()} EP{self.ep} {self.direction}"


@dataclass(frozen=True)
class Table:
    name: str
    source: str
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class Result:
    row: Row
    predicted: float
    kernel_us: float
    limit: str  # what bounds the transfer in the model: nvlink, rdma or sm

    @property
    def error(self) -> float:
        return (self.predicted - self.row.published) / self.row.published


ROW_KEYS = {f.name for f in fields(Row)} - {"table", "source", "gpu"}
TABLE_KEYS = {"name", "source", "gpu", "tokens", "hidden", "top_k", "dispatch",
              "gpus_per_node", "kernels", "n_group", "topk_group", "ll_nvlink", "rows"}
DEFAULT_KEYS = ("tokens", "hidden", "top_k", "dispatch", "gpus_per_node", "kernels", "n_group",
                "topk_group", "ll_nvlink")


def load_table(path) -> Table:
    p = Path(path)
    d = read_doc(p, "published table")
    extra = set(d) - TABLE_KEYS
    missing = {"name", "source", "gpu", "rows"} - set(d)
    if extra or missing:
        raise ValueError(f"published table {p.name}: unknown keys {sorted(extra)}, missing "
                         f"{sorted(missing)}; allowed: {sorted(TABLE_KEYS)}")
    defaults = {k: d[k] for k in DEFAULT_KEYS if k in d}
    if not isinstance(d["rows"], list) or not d["rows"]:
        raise ValueError(f"published table {p.name}: rows must be a list of at least one row")
    rows = []
    for i, r in enumerate(d["rows"]):
        bad = set(r) - ROW_KEYS if isinstance(r, dict) else {"(not a table)"}
        if bad:
            raise ValueError(f"published table {p.name} row {i}: unknown keys {sorted(bad)}; "
                             f"allowed: {sorted(ROW_KEYS)}")
        try:
            row = Row(table=d["name"], source=d["source"], gpu=d["gpu"], **{**defaults, **r})
        except TypeError as exc:
            raise ValueError(f"published table {p.name} row {i}: {exc}") from None
        _check(row, f"published table {p.name} row {i}")
        rows.append(row)
    return Table(d["name"], d["source"], tuple(rows))


def _check(r: Row, where: str) -> None:
    for f in fields(Row):  # each figure of the type its field says: no "8", no true
        v, kind = getattr(r, f.name), f.type
        if kind.startswith("int") and v is None and "None" in kind:
            continue
        ok = isinstance(v, str) if kind == "str" else isinstance(v, bool) if kind == "bool" \
            else is_int(v) if kind.startswith("int") else is_number(v)
        if not ok:
            need = {"str": "a string", "bool": "true or false"}.get(kind) or \
                ("an integer" if kind.startswith("int") else "a number")
            raise ValueError(f"{where}: {f.name} ({v!r}) must be {need}")
    for what, value, allowed in (("mode", r.mode, MODES), ("direction", r.direction, DIRECTIONS),
                                 ("unit", r.unit, UNITS), ("kernels", r.kernels, KERNELS)):
        if value not in allowed:
            raise ValueError(f"{where}: {what} ({value!r}) must be one of {allowed}")
    if not r.ll_nvlink and r.mode != "ll":
        raise ValueError(f"{where}: ll_nvlink = false is for the ll mode (DeepEP's normal "
                         f"kernels always forward over NVLink)")
    if (r.mode, r.kernels) not in BACKEND:
        raise ValueError(f"{where}: DeepEP {r.kernels}'s {r.mode} kernels are not modelled "
                         f"(modelled: {sorted(BACKEND)})")
    if r.published <= 0 or r.ep < 2 or r.experts % r.ep:
        raise ValueError(f"{where}: needs published > 0, ep >= 2 and experts ({r.experts}) "
                         f"divisible by ep ({r.ep})")
    low = [f"{k} ({getattr(r, k)})" for k in ("tokens", "gpus_per_node", "sms")
           if getattr(r, k) is not None and getattr(r, k) < 1]
    if low:
        raise ValueError(f"{where}: {', '.join(low)} must be >= 1")
    if r.ep > r.gpus_per_node and r.ep % r.gpus_per_node:
        raise ValueError(f"{where}: ep ({r.ep}) spans nodes of gpus_per_node "
                         f"({r.gpus_per_node}): it must be a multiple of it")
    try:
        QuantConfig(r.dispatch).check_shapes(_cfg(r))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _cfg(row: Row):
    """The MoE layer of a row's case: DeepSeek-V3's router at the row's figures."""
    return get_preset("deepseek-v3").replace(num_experts=row.experts, hidden=row.hidden,
                                             top_k=row.top_k, n_group=row.n_group,
                                             topk_group=row.topk_group,
                                             router="sigmoid_grouped")


def shipped_tables() -> list[Path]:
    return sorted(PUBLISHED_DIR.glob("*.toml"))


def predict(row: Row, prof=None) -> Result:
    prof = load_profile(prof or row.gpu)
    g = min(row.ep, row.gpus_per_node)
    topo = Topology.parse(f"{row.ep // g}x{g}", gpu=row.gpu)
    cfg = _cfg(row)
    stats = routing_stats(cfg, RoutingSpec(), topo.world, topo.gpus_per_node)
    case = CommCase(cfg, QuantConfig(row.dispatch), topo, prof, stats, row.tokens, row.tokens,
                    sms=row.sms if row.mode == "ht" else None, reuse_layout=True,
                    ll_nvlink=row.ll_nvlink)
    cost = (dispatch_cost if row.direction == "dispatch" else combine_cost)(
        BACKEND[row.mode, row.kernels], case)
    t, d = cost.kernel_us, row.direction
    limit = max(("nvlink", "rdma", "sm"), key=lambda c: cost.notes.get(f"{d}.{c}_bytes", 0.0)
                / cost.notes.get(f"{d}.{c}_GBps", 1.0))
    if row.unit == "us":
        return Result(row, t, t, limit)
    if d == "combine":
        row_bytes = 2.0 * row.hidden
    elif row.mode == "ll":  # DeepEP's LL test counts an FP8 message whatever the recipe
        row_bytes = act_row_bytes(row.hidden, QuantConfig("fp8_block")) + LL_HEADER_BYTES
    else:
        row_bytes = act_row_bytes(row.hidden, QuantConfig(row.dispatch))
    if row.mode == "ll":  # the selections sent, own rank's included
        units = row.tokens * row.top_k
    elif topo.num_nodes == 1:  # received rows, own ones included
        units = topo.world * row.tokens * stats.hit_rank[0]
    else:  # (token, node) pairs, own node included
        units = row.tokens * stats.nodes_per_token
    return Result(row, units * row_bytes / (t * 1e3), t, limit)


def validate(tables=None, prof=None) -> list[Result]:
    """Every row of the given table files (default: the shipped ones)."""
    out = []
    for path in tables or shipped_tables():
        out += [predict(r, prof) for r in load_table(path).rows]
    return out


def table(results: list[Result], prof=None) -> str:
    """80 columns: a header per published table, one line per row."""
    out = []
    for name, group in itertools.groupby(results, key=lambda r: r.row.table):
        group = list(group)
        out += ["", f"{name}: published vs this model (profile {prof or group[0].row.gpu})",
                f"source: {group[0].row.source}"[:80],
                f"{'case':<22}{'published':>12}{'model':>12}{'error':>9}  {'limit':<7}"
                f"{'kernel us':>10}", "-" * 74]
        out += [f"{r.row.name:<22}{r.row.published:>8.0f} {r.row.unit:<4}{r.predicted:>7.0f} "
                f"{r.row.unit:<4}{100 * r.error:>+8.1f}%  {r.limit:<7}{r.kernel_us:>10.0f}"
                for r in group]
    return "\n".join(out[1:])
