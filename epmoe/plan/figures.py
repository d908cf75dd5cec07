"""The figures a hardware profile holds (epmoe.plan.profile): where each number comes from
(`Provenance`), a device figure, the alpha-beta fits of kernels and comm paths, and the
GEMM and shared-MLP curves. Plain frozen values; the profile owns the lookups and JSON."""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from typing import Literal

from epmoe.docfile import is_int, is_number

Source = Literal["measured", "spec", "derived", "inherited", "estimate"]
SOURCES = ("measured", "spec", "derived", "inherited", "estimate")
SCHEMA = 1
QUEUED = ".queued"  # a kernel fit's name suffix: timed behind earlier GPU work (as_queued)
OVERLAPPED = ".overlapped"  # a kernel fit's name suffix: timed beside the shared MLP
DEVICE_FIGURES = ("sm_arch", "sms", "hbm_GBps", "hbm_GiB", "peak_tflops_fp8", "peak_tflops_bf16",
                  "peak_tflops_fp32", "launch_us", "sync_us")
HOST_OP = "host_op_us"  # optional device figure: the host's time per tiny eager op (host speed)
SCHED_SLICE = "sched_slice_us"  # optional (CPU): the scheduler's slice (plan/timeslice.py)
HOST_PREFIX = "host."  # a kernel fit's name prefix: the host's time to issue a call (alpha only)
KERNELS = ("permute", "gather", "act_quant")  # per experts backend; kernels["comm"]: quantize
LOCAL_KERNELS = ("dispatch", "combine")  # kernels["local"]: the local comm backend's own work
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# an absolute or home-relative path (not "GB/s", not a relative one): the file name is kept
_MACHINE_PATH = re.compile(r"(?<![\w.~/-])(?:~|\.{1,2})?/(?:[\w.~-]+/)*([\w.~-]+)")


def public_note(note: str) -> str:
    """A provenance note with every absolute path reduced to its file name: where a file
    went on the measuring machine is not the profile's business (nor the repository's)."""
    return _MACHINE_PATH.sub(lambda m: m.group(1), note)


@dataclass(frozen=True)
class Provenance:
    """source: one of SOURCES; note: machine+date+command, the data sheet, the derivation or
    the assumption."""

    source: Source
    note: str

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"provenance source ({self.source!r}) must be one of {SOURCES}")
        if not self.note:
            raise ValueError("provenance note is empty: say where the number comes from")

    def inherit(self, frm: str) -> "Provenance":
        return Provenance("inherited", f"from profile {frm}: {self.source}: {self.note}")


@dataclass(frozen=True)
class Figure:
    value: float
    prov: Provenance


@dataclass(frozen=True)
class AlphaBeta:
    """t_us = max(floor_us, alpha_us + bytes / (beta_GBps * 1e3)). floor_us: the fastest a
    calibration measured the kernel at any size (a small call costs its launch or one wave of
    CTAs however few bytes it moves, which a straight line through all sizes under-predicts);
    0 where nothing was measured. calls: the calls a stage made where alpha and floor were
    measured, when it makes one per busy expert (the torch experts run each expert's ops on
    their own): `time_us(nbytes, calls)` then scales both by calls / this; 0: one call."""

    alpha_us: float
    beta_GBps: float
    prov: Provenance
    floor_us: float = 0.0
    calls: float = 0.0

    def __post_init__(self):
        _check(self, "alpha_us", self.alpha_us, 0.0, "kernel fit")
        _check(self, "beta_GBps", self.beta_GBps, None, "kernel fit")
        _check(self, "floor_us", self.floor_us, 0.0, "kernel fit")
        _check(self, "calls", self.calls, 0.0, "kernel fit")

    def time_us(self, nbytes: float, calls: float = 0.0) -> float:
        s = calls / self.calls if self.calls > 0 and calls > 0 else 1.0
        return max(self.floor_us * s, self.alpha_us * s + nbytes / (self.beta_GBps * 1e3))


@dataclass(frozen=True)
class LinkFit:
    """One comm path on one link class (one direction of a backend, or a collective).

    alpha_us     fixed cost per call (launch, signalling), excluding the count exchange
    beta_GBps    asymptotic bandwidth measured on a link of `link_GBps` nominal per direction
                 (it scales with the topology's link: beta * link / link_GBps)
    per_sm_GBps  SM-driven copy rate per SM given to comm, on every row the SMs move, the
                 rank's own rows included (None: not SM-limited)
    sms          SMs the backend takes by default (None: not SM-driven, or all of them)
    count_us     count/layout exchange per call when the layout is not cached (0: none)
    peer_us      fixed cost per peer beyond the first (the flags a call polls and publishes
                 per peer): alpha_us is the cost with one peer (`alpha_at`)
    """

    alpha_us: float
    beta_GBps: float
    link_GBps: float
    prov: Provenance
    per_sm_GBps: float | None = None
    sms: int | None = None
    count_us: float = 0.0
    peer_us: float = 0.0

    def __post_init__(self):
        for name, low in (("alpha_us", 0.0), ("beta_GBps", None), ("link_GBps", None),
                          ("count_us", 0.0), ("peer_us", 0.0)):
            _check(self, name, getattr(self, name), low, "link fit")
        if self.per_sm_GBps is not None:
            _check(self, "per_sm_GBps", self.per_sm_GBps, None, "link fit")
        if self.sms is not None and (not is_int(self.sms) or self.sms < 1):
            raise ValueError(f"link fit sms ({self.sms!r}) must be an int >= 1 or null "
                             f"({self.prov.note[:60]})")

    def alpha_at(self, world: int) -> float:
        """The fixed cost per call in a world of `world` ranks."""
        return self.alpha_us + self.peer_us * max(0, world - 2)

    def bandwidth_GBps(self, link_GBps: float) -> float:
        """Usable bandwidth on a link of `link_GBps` nominal per direction."""
        return self.beta_GBps * link_GBps / self.link_GBps

    def sm_GBps(self, sms: int | None = None) -> float | None:
        """What `sms` SMs (default: self.sms) copy per second, or None: not SM-driven."""
        n = self.sms if sms is None else sms
        return None if self.per_sm_GBps is None or n is None else n * self.per_sm_GBps


def _check(obj, name: str, v: float, low: float | None, what: str) -> None:
    """v finite and >= low (None: > 0), else a ValueError naming the figure and its source."""
    ok = is_number(v) and math.isfinite(v) and (v > 0 if low is None else v >= low)
    if not ok:
        need = "> 0" if low is None else f">= {low:g}"
        raise ValueError(f"{what} {name} ({v!r}) must be a finite number {need} "
                         f"({obj.prov.note[:60]})")


def _points(points, what: str, x: str, y: str) -> tuple[tuple[float, float], ...]:
    """A curve's (x, y) points as floats: both positive, x strictly increasing."""
    pts = tuple((float(a), float(b)) for a, b in points)
    if not pts or any(a <= 0 or b <= 0 for a, b in pts):
        raise ValueError(f"{what} needs points ({x} > 0, {y} > 0), got {points}")
    if any(q[0] <= p[0] for p, q in zip(pts, pts[1:])):
        raise ValueError(f"{what}: {x} must increase, got {pts}")
    return pts


@dataclass(frozen=True)
class GemmCurve:
    """Grouped-GEMM throughput of one backend/recipe/layout at one (N, K): points are
    (rows per expert m, TFLOPS), m ascending. Between points: linear in log m; outside them
    TFLOPS stays at the nearest point's value. Small m is weight-read bound: the caller
    takes max(FLOPs / TFLOPS, bytes / HBM), so the HBM floor sets the time there."""

    backend: str
    recipe: str
    layout: str
    n: int
    k: int
    points: tuple[tuple[float, float], ...]
    prov: Provenance
    overlapped: bool = False  # timed beside the shared MLP on its side stream (a launch's way)

    def __post_init__(self):
        object.__setattr__(self, "points", _points(self.points, f"GEMM curve {self.key}",
                                                   "m", "TFLOPS"))

    @property
    def key(self) -> str:
        side = "+overlapped" if self.overlapped else ""
        return f"{self.backend}/{self.recipe}/{self.layout}{side}/{self.n}x{self.k}"

    def tflops(self, m: float) -> float:
        pts = self.points
        if m <= pts[0][0]:
            return pts[0][1]
        if m >= pts[-1][0]:
            return pts[-1][1]
        i = bisect.bisect_left([p[0] for p in pts], m)
        (m0, t0), (m1, t1) = pts[i - 1], pts[i]
        f = (math.log(m) - math.log(m0)) / (math.log(m1) - math.log(m0))
        return t0 + f * (t1 - t0)


@dataclass(frozen=True)
class MlpCurve:
    """The shared experts' MLP of one experts backend and recipe, timed as the layer's "shared"
    stage: points are (tokens, us), tokens ascending, at width `width` (its intermediate) and
    hidden `hidden`. overlapped: timed on the side stream while the routed path runs (the
    CUDA default, layer.py), else alone. Between points: linear in log-log; below the first,
    the first point's time (weight-read and launch bound); above the last, linear in tokens.
    Another (width, hidden) scales the time by the FLOP ratio. queued: timed behind earlier
    work on the GPU (a stack's later layers; `HardwareProfile.as_queued`)."""

    backend: str
    recipe: str
    width: int
    hidden: int
    overlapped: bool
    points: tuple[tuple[float, float], ...]
    prov: Provenance
    queued: bool = False

    def __post_init__(self):
        object.__setattr__(self, "points", _points(self.points, f"MLP curve {self.key}",
                                                   "tokens", "us"))

    @property
    def key(self) -> str:
        side = "overlapped" if self.overlapped else "alone"
        return f"{self.backend}/{self.recipe}/{side}{'/queued' * self.queued}/" \
               f"{self.width}x{self.hidden}"

    def time_us(self, tokens: float, width: int | None = None, hidden: int | None = None) -> float:
        pts = self.points
        if tokens <= 0:
            return 0.0
        if tokens <= pts[0][0]:
            us = pts[0][1]
        elif tokens >= pts[-1][0]:
            us = pts[-1][1] * tokens / pts[-1][0]
        else:
            i = bisect.bisect_left([p[0] for p in pts], tokens)
            (n0, t0), (n1, t1) = pts[i - 1], pts[i]
            f = (math.log(tokens) - math.log(n0)) / (math.log(n1) - math.log(n0))
            us = math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
        return us * (width or self.width) * (hidden or self.hidden) / (self.width * self.hidden)
