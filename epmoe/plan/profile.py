"""Hardware profiles: the measured or spec-derived figures the cost model reads.

A `HardwareProfile` holds, for one GPU kind (or the CPU):
- `device`: SMs, HBM bandwidth and size, peak FP8 / BF16 / FP32 TFLOPS, per-op launch and
  host-sync costs (`Figure`s);
- `gemm`: grouped-GEMM throughput curves, TFLOPS vs rows per expert, per experts backend,
  recipe, layout and (N, K) (`GemmCurve`);
- `kernels`: the bandwidth kernels (permute, gather, act_quant) as alpha-beta fits per
  experts backend, the comm side's activation quantizer under "comm" (and there the host's
  time to issue one call of a comm backend, "host.<backend>.<dispatch|combine>"), the local comm
  backend's own work under "local" (dispatch beyond its quantize: the id mapping and its
  launches; combine: the output cast) and the router per router kind under "router"
  (`AlphaBeta`: t = alpha + bytes / beta);
- `mlp`: the shared experts' dense MLP as the layer runs it (quantize, gate/up GEMM, act,
  down GEMM), measured time vs tokens per experts backend and recipe, alone or overlapped
  with the routed path on its side stream (`MlpCurve`);
- `comm`: per comm backend, per link class, dispatch and combine fits (`LinkFit`: alpha, beta
  on a reference link, optional per-SM rate and SM count, count-exchange cost);
- `collectives`: all_reduce / all_gather / reduce_scatter / all_to_all per link class
  (`LinkFit`, beta = NCCL bus bandwidth).
Every figure and fit carries a `Provenance`: `measured` (machine, date, command), `spec`
(the data sheet), `derived` (computed from other figures: says how), `inherited` (copied
from another profile because this machine could not measure it) or `estimate` (a stated
modelling assumption, to be replaced by a measurement).

Profiles are JSON (`save` / `load`); the shipped ones live in `epmoe/plan/profiles/` and are
loaded by name (`load_profile("h200")`) or path.
"""


from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Mapping

from epmoe.docfile import read_doc
from epmoe.plan.figures import (COLLECTIVES, DEVICE_FIGURES, HOST_OP, HOST_PREFIX, KERNELS,
                                LOCAL_KERNELS, OVERLAPPED, QUEUED, SCHED_SLICE, SCHEMA, SOURCES,
                                AlphaBeta, Figure, GemmCurve, LinkFit, MlpCurve, Provenance,
                                Source)

# device figures that must be > 0 (counts, rates, sizes); the others >= 0 (a CPU's sm_arch 0)
POSITIVE_FIGURES = ("sms", "hbm_GBps", "hbm_GiB", "peak_tflops_fp8", "peak_tflops_bf16",
                    "peak_tflops_fp32")

__all__ = ["COLLECTIVES", "DEVICE_FIGURES", "HOST_OP", "KERNELS", "LOCAL_KERNELS", "OVERLAPPED",
           "QUEUED", "SCHED_SLICE", "SCHEMA", "SOURCES", "AlphaBeta", "Figure", "GemmCurve",
           "HardwareProfile", "LinkFit", "MlpCurve", "Provenance", "Source", "from_dict",
           "load_profile", "shipped_profiles", "to_dict"]


@dataclass(frozen=True)
class HardwareProfile:
    """gpu: the GPU kind (topology.LINK_SPECS key: h200, b200, cpu, ...); device["sm_arch"]:
    compute capability x 10 (90 Hopper, 100 Blackwell; 0 for the CPU)."""

    name: str
    gpu: str
    description: str
    device: Mapping[str, Figure]
    gemm: tuple[GemmCurve, ...] = ()
    kernels: Mapping[str, Mapping[str, AlphaBeta]] = field(default_factory=dict)
    comm: Mapping[str, Mapping[str, Mapping[str, LinkFit]]] = field(default_factory=dict)
    collectives: Mapping[str, Mapping[str, LinkFit]] = field(default_factory=dict)
    mlp: tuple[MlpCurve, ...] = ()

    def __post_init__(self):
        missing = [f for f in DEVICE_FIGURES if f not in self.device]
        if missing:
            raise ValueError(f"profile {self.name!r} lacks device figures {missing}")
        if not isinstance(self.gpu, str) or not self.gpu:
            raise ValueError(f"profile {self.name!r}: gpu ({self.gpu!r}) must be a GPU kind")
        for k, f in self.device.items():  # counts and rates > 0; the rest >= 0 (CPU: sm_arch 0)
            v, pos = f.value, k in POSITIVE_FIGURES
            if not (math.isfinite(v) and (v > 0 if pos else v >= 0)):
                raise ValueError(f"profile {self.name!r}: device figure {k} ({v}) must be "
                                 f"finite and {'> 0' if pos else '>= 0'}")
        object.__setattr__(self, "gemm", tuple(self.gemm))
        object.__setattr__(self, "mlp", tuple(self.mlp))

    # ------------------------------------------------------------------ lookups
    def fig(self, name: str) -> float:
        return self.device[name].value

    def curve(self, backend: str, recipe: str, layout: str, n: int, k: int,
              overlapped: bool = False) -> GemmCurve:
        """The curve of (backend, recipe, layout) nearest to (n, k) in log space; a masked
        layout falls back to the contiguous curves, a recipe to bf16 / fp8_block; overlapped
        (the shared MLP runs beside it): the curve timed so when measured, else the alone one.
        The recipe is matched first, then the layout, then the side (another recipe's curve
        timed beside the shared MLP is no stand-in for this recipe's alone curve)."""
        for rec in dict.fromkeys((recipe, "fp8_block" if recipe != "bf16" else "bf16")):
            for lay in dict.fromkeys((layout, "contiguous")):
                for side in dict.fromkeys((overlapped, False)):
                    cands = [c for c in self.gemm if (c.backend, c.recipe, c.layout,
                                                      c.overlapped) == (backend, rec, lay, side)]
                    if cands:
                        return min(cands, key=lambda c: abs(math.log(c.n / n)) +
                                   abs(math.log(c.k / k)))
        have = sorted({f"{c.backend}/{c.recipe}" for c in self.gemm})
        raise KeyError(f"profile {self.name!r} has no GEMM curve for {backend}/{recipe} "
                       f"(has {have}); calibrate on a machine that runs it")

    def mlp_curve(self, backend: str, recipe: str, width: int, hidden: int,
                  overlapped: bool) -> MlpCurve | None:
        """The shared-MLP curve of (backend, recipe) nearest to (width, hidden) in log space,
        the overlapped one if asked and measured, else the one timed alone; None when the
        profile has none (the model then adds up its GEMM curves and kernel fits)."""
        for side in dict.fromkeys((overlapped, False)):
            cands = [c for c in self.mlp if not c.queued and
                     (c.backend, c.recipe, c.overlapped) == (backend, recipe, side)]
            if cands:
                return min(cands, key=lambda c: abs(math.log(c.width / width)) +
                           abs(math.log(c.hidden / hidden)))
        return None

    def as_queued(self) -> "HardwareProfile":
        """The profile as a layer sees it that starts behind earlier work on the GPU (a
        stack's later layers when the host issues ahead): each figure timed so (a kernel
        fit named "<name>.queued", an MLP curve with `queued`) stands in for its plain one;
        the rest as they are. The calibration times the host-bound stages both ways, and the
        routed kernels (permute, gather, act_quant) in a forward that runs the shared MLP on
        its side stream as a later layer does: their queued fit also stands in for the one
        timed beside the shared MLP on an idle GPU ("<name>.overlapped", then dropped)."""
        kern = {}
        for b, t in self.kernels.items():
            twins = {k[:-len(QUEUED)] for k in t if k.endswith(QUEUED)}
            kern[b] = {**{k: v for k, v in t.items() if not k.endswith(QUEUED) and not (
                k.endswith(OVERLAPPED) and k[:-len(OVERLAPPED)] in twins)},
                **{k[:-len(QUEUED)]: v for k, v in t.items() if k.endswith(QUEUED)}}
        over = {c.key.replace("/queued", ""): replace(c, queued=False)
                for c in self.mlp if c.queued}
        plain = {c.key: c for c in self.mlp if not c.queued}
        return replace(self, kernels=kern, mlp=tuple({**plain, **over}.values()))

    @property
    def host_op_us(self) -> float | None:
        """The calibrating host's time per tiny eager op (`epmoe.timing.host_op_us`), None
        where the profile does not say (spec-derived ones)."""
        f = self.device.get(HOST_OP)
        return None if f is None else f.value

    def at_host(self, host_op_us: float) -> tuple["HardwareProfile", str | None]:
        """-> (this profile at a host issuing a tiny op in `host_op_us`, None), or (itself,
        why not) when it records no host speed of its own: figures a calibration inherits
        must describe the host whose speed the new profile records."""
        if self.host_op_us is None:
            return self, f"the inherited figures at this host's speed ({self.name} records " \
                         f"no host speed: they stay as timed on its host)"
        return self.at_host_speed(host_op_us / self.host_op_us), None

    def at_host_speed(self, factor: float) -> "HardwareProfile":
        """The profile on a host `factor` times as slow per op as the calibrating one (a run's
        `host_op_us` over the profile's). Host time scales by it: the host's issue time of a
        forward (kernels["layer"]["issue*"]) and of a comm call (kernels["comm"]["host.*"])
        wholly; a stage fit timed on an idle GPU (alone or beside the shared MLP) that has a
        queued twin by what it takes beyond the twin (`_host_part_scaled`: the twin, timed
        behind earlier GPU work, is the stage's GPU time, which no host changes); the shared
        MLP beside the routed path on an idle GPU by what it takes beyond the MLP timed alone
        (`_mlp_host_scaled`). GEMMs, copies, links, twins: unchanged."""
        if factor == 1.0:
            return self

        kern = {}
        for b, t in self.kernels.items():
            kern[b] = dict(t)
            for k, fit in t.items():
                # a fit timed beside the shared MLP: its twin is the plain one's (as_queued)
                twin = t.get(k.removesuffix(OVERLAPPED) + QUEUED) if not k.endswith(QUEUED) \
                    else None
                if twin is not None:
                    kern[b][k] = _host_part_scaled(fit, twin, factor)
                elif (b == "layer" and k.split(".")[0] == "issue") or k.startswith(HOST_PREFIX):
                    kern[b][k] = AlphaBeta(fit.alpha_us * factor, fit.beta_GBps / factor,
                                           fit.prov, fit.floor_us * factor, fit.calls)
        alone = {(c.backend, c.recipe, c.width, c.hidden): c for c in self.mlp
                 if not c.overlapped and not c.queued}
        mlp = tuple(_mlp_host_scaled(c, alone.get((c.backend, c.recipe, c.width, c.hidden)),
                                     factor) for c in self.mlp)
        dev = dict(self.device)
        if HOST_OP in dev:  # the profile now describes that host
            f = dev[HOST_OP]
            dev[HOST_OP] = Figure(f.value * factor, Provenance("derived", (
                f"{f.value:.2f} us x{factor:.3f} (at_host_speed), from: {f.prov.note}")))
        return replace(self, kernels=kern, mlp=mlp, device=dev)

    def has_kernel(self, table: str, name: str) -> bool:
        return name in self.kernels.get(table, {})

    def most_specific(self, table: str, *names: str) -> AlphaBeta | None:
        """The first of `names` (most specific first, e.g. "act_quant.fp8_block" then the
        pooled "act_quant") this profile has a fit for in `table`, else None."""
        fits = self.kernels.get(table, {})
        return next((fits[n] for n in names if n in fits), None)

    def kernel(self, experts: str, name: str) -> AlphaBeta:
        """experts: an experts backend, "comm" for the dispatch-side quantizer, or "local"
        for the local comm backend's own work (LOCAL_KERNELS)."""
        table = self.kernels.get(experts, {})
        if name not in table:
            raise KeyError(f"profile {self.name!r} has no {name!r} kernel fit for {experts!r}")
        return table[name]

    def comm_fit(self, backend: str, link: str, direction: str) -> LinkFit:
        try:
            return self.comm[backend][link][direction]
        except KeyError:
            raise KeyError(f"profile {self.name!r} has no {backend} {direction} fit on "
                           f"{link} (has {sorted(self.comm)})") from None

    def collective(self, name: str, link: str) -> LinkFit:
        try:
            return self.collectives[name][link]
        except KeyError:
            raise KeyError(f"profile {self.name!r} has no {name} fit on {link}") from None

    def provenance_counts(self) -> dict[str, int]:
        """How many figures/fits come from each source (the report's one-line summary)."""
        out = dict.fromkeys(SOURCES, 0)
        for p in _walk_provenance(to_dict(self)):
            out[p] += 1
        return out

    def replace(self, **kw) -> "HardwareProfile":
        return replace(self, **kw)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=1, sort_keys=False) + "\n"

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())


def _host_part_scaled(plain: AlphaBeta, gpu: AlphaBeta, factor: float) -> AlphaBeta:
    """`plain` (a stage timed on an idle GPU) on a host `factor` times as slow: each of its
    terms (fixed cost, time per byte, floor) beyond the same term of `gpu` (its queued twin:
    the GPU time) was the host's and scales; the rest is the GPU's and does not. A 300 MB
    copy timed on an idle GPU is its HBM time plus a launch: only the launch scales. Scaling
    by f then g is scaling by f x g (the twin is never scaled)."""
    def term(p: float, g: float) -> float:
        return p + (factor - 1.0) * max(0.0, p - g)

    inv = term(1.0 / plain.beta_GBps, 1.0 / gpu.beta_GBps)
    return AlphaBeta(term(plain.alpha_us, gpu.alpha_us), 1.0 / inv, plain.prov,
                     term(plain.floor_us, gpu.floor_us), plain.calls)


def _mlp_host_scaled(c: MlpCurve, alone: MlpCurve | None, factor: float) -> MlpCurve:
    """The shared MLP timed on its side stream beside the routed path of an idle GPU (the
    first layer's), on a host `factor` times as slow: each point's time beyond the same
    MLP timed alone at that size was the host's and scales. The alone stage runs after the
    routed path, behind its kernels, so it times the GPU's work; beside the routed path at
    decode sizes the stage ends when the host has issued it (BENCHMARKS.md section 39). Not
    overlapped, queued (behind a device hold: GPU time), or without an alone twin: as is."""
    if alone is None or not c.overlapped or c.queued:
        return c
    pts = tuple((n, t + (factor - 1.0) * max(0.0, t - alone.time_us(n))) for n, t in c.points)
    return replace(c, points=pts)


def _walk_provenance(d):
    if isinstance(d, dict):
        if "source" in d and "note" in d and d["source"] in SOURCES:
            yield d["source"]
        for v in d.values():
            yield from _walk_provenance(v)
    elif isinstance(d, (list, tuple)):
        for v in d:
            yield from _walk_provenance(v)


def to_dict(p: HardwareProfile) -> dict:
    return {"schema": SCHEMA, **asdict(p)}


def _prov(d) -> Provenance:
    if not isinstance(d, Mapping):
        raise ValueError(f"provenance must be {{'source': ..., 'note': ...}}, got {d!r}")
    return Provenance(d["source"], d["note"])


def _linkfit(d) -> LinkFit:
    return LinkFit(float(d["alpha_us"]), float(d["beta_GBps"]), float(d["link_GBps"]),
                   _prov(d["prov"]), None if d.get("per_sm_GBps") is None
                   else float(d["per_sm_GBps"]), d.get("sms"), float(d.get("count_us", 0.0)),
                   float(d.get("peer_us", 0.0)))


def from_dict(d: Mapping) -> HardwareProfile:
    if not isinstance(d, Mapping):
        raise ValueError(f"a profile is a JSON object, got {type(d).__name__}")
    if d.get("schema") != SCHEMA:
        raise ValueError(f"profile schema {d.get('schema')!r} is not {SCHEMA}; regenerate it "
                         f"with python -m epmoe.bench.calibrate")
    try:
        return HardwareProfile(
            name=d["name"], gpu=d["gpu"], description=d["description"],
            device={k: Figure(float(v["value"]), _prov(v["prov"]))
                    for k, v in d["device"].items()},
            gemm=tuple(GemmCurve(c["backend"], c["recipe"], c["layout"], int(c["n"]),
                                 int(c["k"]), tuple(tuple(p) for p in c["points"]),
                                 _prov(c["prov"]), bool(c.get("overlapped", False)))
                 for c in d.get("gemm", ())),
            kernels={b: {k: AlphaBeta(float(v["alpha_us"]), float(v["beta_GBps"]),
                                      _prov(v["prov"]), float(v.get("floor_us", 0.0)),
                                      float(v.get("calls", 0.0)))
                         for k, v in t.items()}
                     for b, t in d.get("kernels", {}).items()},
            comm={b: {l: {dr: _linkfit(f) for dr, f in t.items()} for l, t in lt.items()}
                  for b, lt in d.get("comm", {}).items()},
            collectives={c: {l: _linkfit(f) for l, f in t.items()}
                         for c, t in d.get("collectives", {}).items()},
            mlp=tuple(MlpCurve(c["backend"], c["recipe"], int(c["width"]), int(c["hidden"]),
                               bool(c["overlapped"]), tuple(tuple(p) for p in c["points"]),
                               _prov(c["prov"]), bool(c.get("queued", False)))
                      for c in d.get("mlp", ())))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"profile {d.get('name', '?')!r} is malformed: missing or bad "
                         f"{exc}") from None
    except ValueError as exc:
        head = f"profile {d.get('name', '?')!r}"
        raise ValueError(str(exc) if str(exc).startswith(head) else f"{head}: {exc}") from None


def shipped_profiles() -> list[str]:
    root = resources.files("epmoe.plan") / "profiles"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_profile(spec) -> HardwareProfile:
    """A HardwareProfile, a shipped profile's name (h200, h100, h800, h20, b200, gb200, cpu) or a
    path to a JSON file."""
    if isinstance(spec, HardwareProfile):
        return spec
    return from_dict(profile_document(str(spec)))


def profile_document(spec: str):
    """The JSON document of a shipped profile's name or of a profile file, as written."""
    path = Path(spec)
    if not spec.endswith(".json") and not path.is_file():
        root = resources.files("epmoe.plan") / "profiles" / f"{spec.lower()}.json"
        if not root.is_file():
            raise ValueError(f"profile {spec!r} is neither a shipped profile "
                             f"({', '.join(shipped_profiles())}) nor a JSON file")
        return json.loads(root.read_text())
    return read_doc(path, "profile file", f"; write one with python -m "
                                          f"epmoe.bench.calibrate --out {spec}")
