"""A whole step replayed from one CUDA graph per rank (`launch --cuda-graph`).

Eagerly, the host issues a step one launch at a time: at decode sizes it needs longer to issue
a DeepSeek-V3 layer than the GPU needs to run it (BENCHMARKS.md 6e, 6f). Replayed from a
graph, the step costs the host one call.

    step 0      eager: compiles the Triton kernels, JIT-builds DeepGEMM's, makes the first
                call on every comm arena (their first-call timeouts are longer)
    step 1      captured before it is timed: the layers' forward with the step's tokens and
                routing in static buffers (nothing runs while capturing)
    steps 1..   timed replays: the step's tokens and routing are copied into those buffers,
                then one replay

Stage events recorded in the capture are nodes of the graph (`StageTimer.capturing`), so a
replayed step is timed per stage like an eager one, and the last step's tensors the oracle
checks are the graph's own outputs.

What can be captured: paths that never wait on the host and keep their shapes (the symm
backends' counts and epochs live on the device; the Triton and DeepGEMM experts size their
layouts for the worst case), in ep_dp layers (the replicated forms' all-reduce and the
relayout's all-gather are collectives this module does not capture). With EPLB the Runtime
captures again after every placement switch (a switch swaps the experts' weights and the
replica maps the old graph holds by address); the load recorder counts into one buffer that
lives as long as the run, so replays record every step's load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from epmoe.router import Routing, TokenIds

CAPTURABLE_BACKENDS = ("local", "symm-ht", "symm-ll")
CAPTURABLE_EXPERTS = ("triton", "deepgemm")


def capture_violation(form: str, backend: str, experts: str) -> str | None:
    """Why a layer of this form / comm backend / experts backend cannot be captured (None:
    it can). `backend` / `experts` may still be "auto" (then only the form is judged)."""
    if form != "ep_dp":
        return (f"form {form} runs collectives inside the step (all-reduce); --cuda-graph "
                f"captures ep_dp layers only")
    if backend not in CAPTURABLE_BACKENDS + ("auto",):
        return (f"comm backend {backend} waits on the host inside the step (its counts); "
                f"--cuda-graph needs one of {', '.join(CAPTURABLE_BACKENDS)}")
    if experts not in CAPTURABLE_EXPERTS + ("auto",):
        return (f"experts backend {experts} waits on the host inside the step (a loop over "
                f"experts); --cuda-graph needs one of {', '.join(CAPTURABLE_EXPERTS)}")
    return None


def _static(r: Routing | TokenIds | None) -> Routing | TokenIds | None:
    if isinstance(r, TokenIds):
        return TokenIds(r.token_ids_T.clone())
    return None if r is None else Routing(r.topk_ids_TK.clone(), r.topk_weights_TK.clone())


@dataclass
class StepGraph:
    """One rank's captured step: the graph, its static inputs, and what it keeps per layer
    (the check records, holding the graph's own tensors)."""

    graph: torch.cuda.CUDAGraph
    x: torch.Tensor
    routes: list[Routing | TokenIds | None]
    keep: list[dict]

    @classmethod
    def capture(cls, issue: Callable, x: torch.Tensor, routes: list, timer) -> "StepGraph":
        """Capture `issue(x, routes) -> keep` on static copies of x and routes."""
        sx, sroutes = x.clone(), [_static(r) for r in routes]
        torch.cuda.synchronize(x.device)  # the copies above, and every eager step, are done
        graph = torch.cuda.CUDAGraph()
        with timer.capturing(), torch.cuda.graph(graph):
            keep = issue(sx, sroutes)
        return cls(graph, sx, sroutes, keep)

    def replay(self, x: torch.Tensor, routes: list) -> list[dict]:
        """Copy this step's tokens and routing in, replay (asynchronous, like an eager step)."""
        if x.shape != self.x.shape or len(routes) != len(self.routes):
            raise ValueError(f"a captured step takes tokens {tuple(self.x.shape)} and "
                             f"{len(self.routes)} routings; got {tuple(x.shape)}, {len(routes)}")
        self.x.copy_(x, non_blocking=True)
        for s, r in zip(self.routes, routes):
            if type(s) is not type(r):
                raise ValueError("a captured step's routing source changed (router, token ids "
                                 "or given)")
            if isinstance(s, TokenIds):
                s.token_ids_T.copy_(r.token_ids_T, non_blocking=True)
            elif s is not None:
                s.topk_ids_TK.copy_(r.topk_ids_TK, non_blocking=True)
                s.topk_weights_TK.copy_(r.topk_weights_TK, non_blocking=True)
        self.graph.replay()
        return self.keep


__all__ = ["CAPTURABLE_BACKENDS", "CAPTURABLE_EXPERTS", "StepGraph", "capture_violation"]
