"""A run's input tokens for each step, made so that making them does not slow what the step
times.

Each step's tokens are the rows of one Gaussian batch, drawn once on the host from the run's
seed and kept on the device, in a per-step order and with per-step signs on the hidden
columns (a row permutation and column sign flips of an i.i.d. Gaussian matrix are again one,
so every step routes as on fresh tokens). A step draws only its permutation and signs on the
host (tokens + hidden numbers) and forms its batch on the device, before the step starts.

Why: drawing a fresh [tokens, hidden] batch on the host every step (hundreds of MB of host
memory at prefill sizes) evicts the host's caches just before the step, and a launched
step's first stage then waits ~100 us longer for its first launch (one H200: the first
rms_norm after the step's synchronize at 4096 tokens took 193-215 us after that host work, 94
us without it; BENCHMARKS.md 37).

Every rank draws the same batch for the same (seed, source), so replicated forms see one
batch everywhere; `src` picks a rank's own rows when the stack has ep_dp layers.
"""

from __future__ import annotations

import torch


class StepTokens:
    """tokens_for(step) of a Runtime: [tokens, hidden] bf16 on `device`."""

    def __init__(self, tokens: int, hidden: int, seed: int, src: int, device: torch.device):
        self.tokens, self.hidden, self.seed, self.src = tokens, hidden, seed, src
        self.device = device
        self._base: torch.Tensor | None = None

    def base(self) -> torch.Tensor:
        """The batch every step reorders (drawn on the first call)."""
        if self._base is None:
            g = torch.Generator().manual_seed(self.seed * 7919 + self.src + 1)
            x = torch.randn(self.tokens, self.hidden, generator=g)
            self._base = x.to(torch.bfloat16).to(self.device)
        return self._base

    def __call__(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 7919 + self.src + 1) * 1_000_003 + step)
        order = torch.randperm(self.tokens, generator=g)
        signs = torch.randint(0, 2, (self.hidden,), generator=g).mul_(2).sub_(1)
        base = self.base()
        return base[order.to(base.device)] * signs.to(base.device, torch.bfloat16)
