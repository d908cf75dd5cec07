"""One calibration forward's stage times -> the points of the layer's fits (bench.calibrate_layer
measures; this turns a forward into points and the pooled points into fits)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from epmoe.plan import traffic as tr
from epmoe.plan.beside import fully_beside
from epmoe.plan.cost import BETWEEN, layer_body_us
from epmoe.plan.profile import OVERLAPPED, QUEUED, AlphaBeta


@dataclass
class LayerFits:
    """What the layer runs gave: curves, kernel fits per table, shared-MLP curves."""

    gemm: list = field(default_factory=list)
    kernels: dict = field(default_factory=dict)
    mlp: list = field(default_factory=list)
    points: dict = field(default_factory=dict)  # (table, name) -> [(bytes, us)], pooled
    calls: dict = field(default_factory=dict)  # (table, name) -> [busy experts], per point
    host_op_us: list = field(default_factory=list)  # the host's speed beside each issue time

    def add_point(self, table: str, name: str, nbytes: float, us: float | None,
                  calls: int = 0) -> None:
        """calls: the stage's calls in this forward when it makes one per busy expert."""
        if us and nbytes > 0:
            self.points.setdefault((table, name), []).append((nbytes, us))
            self.calls.setdefault((table, name), []).append(calls)


@dataclass(frozen=True)
class Size:
    """One calibration size: tokens, (token, expert) pairs, the layout's alignment, aligned
    GEMM rows, act+quant rows, experts given rows."""

    tokens: int
    real: int
    align: int
    rows: int
    aq_rows: int
    busy: int = 0

    @staticmethod
    def of(ids, e: int, align: int, experts: str) -> "Size":
        """The size of a routing (ids [n, k]) over e experts."""
        import torch

        counts = torch.bincount(ids.flatten().long().cpu(), minlength=e).tolist()
        real = ids.numel()
        return Size(ids.shape[0], real, align, sum(-(-c // align) * align for c in counts),
                     real if experts == "torch" else sum(  # the rows act+quant computes
                         -(-c // tr.ACT_BLOCK_ROWS) * tr.ACT_BLOCK_ROWS for c in counts),
                     sum(c > 0 for c in counts))


def routed_points(fits: LayerFits, gemm: dict, st: dict, size: Size, cfg, quant,
                   experts: str, recipe: str, overlapped: bool) -> None:
    """The routed stages of one forward on balanced routing -> GEMM points (per aligned size
    the least padded run; below one aligned group per expert keyed by the real rows, as
    cost.py looks them up) and the permute / gather / act_quant fits (".overlapped": the
    stages that ran entirely beside the shared MLP, in a forward that ran it on its side)."""
    e, d, inter, align = cfg.num_experts, cfg.hidden, cfg.moe_intermediate, size.align
    if overlapped:  # only what ran entirely beside the shared MLP (plan/beside.py)
        inside = fully_beside(st)
        st = {s: v for s, v in st.items() if not s.startswith("experts.") or s in inside}
    for g, nn, kk in (("gemm1", 2 * inter, d), ("gemm2", d, inter)):
        if st.get(f"experts.{g}"):
            m_key = size.real / e if size.real / e < align else size.rows / e
            prev = gemm[(g, overlapped)].get(m_key)
            if prev is None or size.real > prev[0]:
                gemm[(g, overlapped)][m_key] = (size.real, tr.gemm_flops(size.rows, nn, kk) /
                                                st[f"experts.{g}"] / 1e6)
    kernel_points(fits, st, size, cfg, quant, experts, recipe,
                   OVERLAPPED if overlapped else "")


def kernel_points(fits: LayerFits, st: dict, size: Size, cfg, quant, experts: str,
                   recipe: str, sfx: str) -> None:
    """permute / gather / act_quant (pooled and per recipe) of one forward as "<name><sfx>"
    (".overlapped": beside the shared MLP; ".queued": behind a device hold, a later layer's)."""
    n, d, inter = size.tokens, cfg.hidden, cfg.moe_intermediate
    for r in ("", f".{recipe}"):  # pooled, and per recipe (its rows, and beside the shared
        # MLP its kernels: a W4A8 GEMM slows what runs beside it more than an fp8 one)
        if r or tr.permute_copies_rows(experts, recipe):  # pooled: the permutes that copy
            fits.add_point(experts, f"permute{r}{sfx}",
                           tr.permute_bytes(n, size.real, d, quant, experts),
                           st.get("experts.permute"))
        fits.add_point(experts, f"gather{r}{sfx}", tr.gather_bytes(n, size.real, d),
                       st.get("experts.gather"))
        fits.add_point(experts, f"act_quant{r}{sfx}",  # torch: its ops once per busy expert
                       tr.act_quant_bytes(size.aq_rows, inter, quant), st.get("experts.act_quant"),
                       size.busy if experts == "torch" else 0)


def host_bound_points(fits: LayerFits, st: dict, n: int, cfg, quant, experts: str,
                       overlapped: bool, queued: bool = False) -> None:
    """Router, dispatch.quantize (pooled, per experts backend, per backend and recipe), the
    local backend's dispatch (pooled, per recipe) and combine (pooled, per experts backend:
    a bf16 output has no cast), and the layer's tail and the host's issue time, from one
    forward with the layer's router (queued: behind a device hold -> the ".queued" fits,
    the tail among them; no issue time)."""
    d, e, k = cfg.hidden, cfg.num_experts, cfg.top_k
    sfx = QUEUED if queued else ""
    qbytes = tr.quantize_bytes(n, d, quant)
    # bf16 runs no quantize kernel and the model predicts none (comm_cost.quantize_us): its
    # empty stage's host time stays in the local dispatch's fit of the recipe
    q = st.get("dispatch.quantize", 0.0) if qbytes else 0.0
    for name in ("quantize", f"quantize.{experts}", f"quantize.{experts}.{quant.recipe}"):
        if qbytes:  # pooled, per backend, per backend and recipe
            fits.add_point("comm", name + sfx, qbytes, q or None)
    if st.get("dispatch"):  # pooled, and per recipe (what runs beside the mapping differs)
        for name in ("dispatch", f"dispatch.{quant.recipe}"):
            fits.add_point("local", name + sfx, tr.local_dispatch_bytes(n, k),
                           max(st["dispatch"] - q, 1e-3))
    for name in ("combine", f"combine.{experts}"):  # pooled, per backend (bf16 out: no cast)
        fits.add_point("local", name + sfx, tr.local_combine_bytes(n, d), st.get("combine"))
    fits.add_point("router", cfg.router + sfx, tr.router_bytes(n, d, e), st.get("router"))
    for stage in BETWEEN:  # the pre-norm and the residual add around the forward
        fits.add_point("layer", stage + sfx, tr.BETWEEN_BYTES[stage](n, d), st.get(stage))
    if not queued:
        for name in ("issue", f"issue.{experts}"):  # pooled, per backend (torch: host syncs)
            fits.add_point("layer", name, n * d * 2.0, st.get("issue"))
    tail = st["forward"] - layer_body_us(st, overlapped)  # queued: without the host's gaps
    for name in ("tail", f"tail.{experts}"):  # pooled, and per backend (the torch
        fits.add_point("layer", name + sfx, n * d * 2.0, max(tail, 1e-3))  # backend syncs)


def finish(fits: LayerFits, clock, fit_ab) -> dict:
    """The pooled points -> {table: {name: AlphaBeta}} (each fit says what it pooled). A fit's
    floor is the fastest time it measured, but not for the ".overlapped" fits: their points
    are the sizes whose stage ran entirely beside the shared MLP, often only the largest, whose
    time is no floor for the sizes below them."""
    out: dict = {}
    for (table, name), pts in fits.points.items():
        src = {"comm": "dispatch.quantize stage", "local": f"{name} stage of the local backend",
               "router": f"router stage ({name})",
               "layer": "the host's issue of a whole forward (median)" if name.startswith("issue")
               else f"{name.split('.')[0]} stage around it (runtime.run_layer)"
               if _between(table, name)
               else "whole forward minus its stages as the model composes them"}
        note = src.get(table, f"experts.{name} stage") + f", {len(pts)} sizes x recipes"
        if name.endswith(QUEUED):
            note += ", behind a device hold (queued)"
        floor = min((t for b, t in pts if b > 0 and t > 0), default=0.0)
        calls = fits.calls.get((table, name), [0])
        out.setdefault(table, {})[name] = AlphaBeta(*fit_ab(pts), clock.prov(
            f"MoELayer.forward at ep 1: {note}; floor: the fastest size"),
            floor if (table != "layer" or _between(table, name))
            and not name.endswith(OVERLAPPED) else 0.0,
            statistics.fmean(calls) if all(calls) else 0.0)
    return out


def _between(table: str, name: str) -> bool:
    """A fit of a stage between two layers (cost.BETWEEN), kept in the "layer" table."""
    return table == "layer" and name.split(".")[0] in BETWEEN
