"""What one rank's comm backends share: the process group and the buffers they allocate once.

The Runtime creates one `CommContext` per rank and closes it at shutdown; every layer's comm
gets the same context. Buffers that must exist once per process (DeepEP's NVSHMEM/IPC buffers,
the symmetric arena of `comm.symm`) are `resource`s of the context, never module-level caches.

    ctx = CommContext(group, rank, world, device, max_tokens_per_rank=4096)
    buf = ctx.resource("deepep-ht", lambda: make_buffer(...))   # made once, then shared
    ...
    ctx.close()                                                  # collective: every rank calls it
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch

R = TypeVar("R")


@dataclass
class CommContext:
    """group                torch process group of the EP ranks (None: one rank, no group)
    rank, world          this rank and the group size
    device               where tokens and buffers live
    max_tokens_per_rank  the most tokens any dispatch of this run carries from one rank (sizes
                         preallocated buffers: DeepEP low-latency, the symmetric arena)"""

    group: Any = None
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    max_tokens_per_rank: int = 0
    _resources: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.device = torch.device(self.device)
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank ({self.rank}) must lie in [0, world={self.world}) and world "
                             f">= 1")
        if self.max_tokens_per_rank < 0:
            raise ValueError(f"max_tokens_per_rank ({self.max_tokens_per_rank}) must be >= 0")

    def resource(self, key: str, make: Callable[[], R]) -> R:
        """The shared resource under `key`, made by `make()` on first use. A resource with a
        `close()` method is closed by `CommContext.close`, in reverse order of creation."""
        if key not in self._resources:
            self._resources[key] = make()
        return self._resources[key]

    def has(self, key: str) -> bool:
        return key in self._resources

    def close(self) -> None:
        """Free every resource (collective for the ones that need it: call on every rank)."""
        while self._resources:
            _, res = self._resources.popitem()
            close = getattr(res, "close", None)
            if close is not None:
                close()
