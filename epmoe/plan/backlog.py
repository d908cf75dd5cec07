"""Which layers of a step start behind earlier GPU work: the step's first layer starts on an
idle GPU (each step begins after a synchronize), a later one behind the layers before
whenever the host issues faster than the GPU runs them. Such a layer's host-bound stages
(router, the dispatch quantizer, the local backend's work) and the shared MLP beside it take
the profile's queued figures (`HardwareProfile.as_queued`). The launch report and the
planner walk a stack with it."""

from __future__ import annotations

from epmoe.plan.comm_cost import issue_us


class Backlog:
    """Which layers of a step start behind earlier work on the GPU. A step starts on an idle
    GPU (after a synchronize); the host then issues layer l in the profile's `issue` time
    (kernels["layer"]["issue"]) while the GPU runs the layers before, so the GPU's backlog
    after layer l is max(0, backlog + its predicted time - its issue time). A layer that
    starts with a backlog (every layer under --timing device or a replayed CUDA graph:
    `all_queued`) is predicted from the profile's queued figures
    (`HardwareProfile.as_queued`: its host-bound stages' GPU time)."""

    def __init__(self, prof, all_queued: bool, out_bytes: float):
        self.plain, self.queued = prof, prof.as_queued()
        self.differs = self.queued != prof  # the profile has queued figures
        self.out_bytes, self.issued = out_bytes, []
        self.all_queued, self.us, self.layers = all_queued, 0.0, []

    def is_queued(self) -> bool:
        """Whether the next layer starts behind earlier work (and the profile can tell)."""
        return self.differs and (self.all_queued or self.us > 0.0)

    def profile(self, layer: int):
        """The profile to predict layer `layer` (the next one) with."""
        if self.is_queued():
            self.layers.append(layer)
            return self.queued
        return self.plain

    def ran(self, layer_us: float, experts: str, backend: str = "local") -> None:
        """Layer l ran for layer_us (predicted) on `experts` and comm `backend`, issued in the
        profile's time of that experts backend (its host syncs: the torch backend's loop) or
        the pooled, calibrated at one rank (the local backend), plus what issuing `backend`'s
        dispatch and combine costs beyond the local backend's (comm_cost.issue_us: a symm
        call's Triton launches)."""
        fit = self.plain.most_specific("layer", f"issue.{experts}", "issue")
        us = fit.time_us(self.out_bytes) if fit is not None else 0.0
        if fit is not None and backend != "local":
            us += sum(issue_us(self.plain, backend, d) - issue_us(self.plain, "local", d)
                      for d in ("dispatch", "combine"))
        self.issued.append(max(us, 0.0))
        self.us = max(0.0, self.us + layer_us - self.issued[-1])

    def note(self) -> str | None:
        if not self.layers:
            return None
        return (f"layers {_ranges(self.layers)} predicted as queued behind the layers "
                f"before (host issue {max(self.issued) / 1e3:.3f} ms a layer at most): their "
                f"host-bound stages and the shared MLP from the profile's queued figures")


def _ranges(xs: list[int]) -> str:
    if xs != list(range(xs[0], xs[-1] + 1)):
        return ",".join(map(str, xs))
    return str(xs[0]) if len(xs) == 1 else f"{xs[0]}-{xs[-1]}"
