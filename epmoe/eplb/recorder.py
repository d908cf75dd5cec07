"""Expert load recorder: (token, k) pairs per layer x physical slot, per step, on device, in a
sliding window; summed across ranks by one small all-reduce when a rebalance asks for it."""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist


def count_pairs_(counts_S: torch.Tensor, ids: torch.Tensor) -> None:
    """counts_S[e] += number of (token, k) slots routed to e (-1 = empty), in place, on the
    counts' device without a host sync (no bincount / boolean indexing)."""
    ids = ids.reshape(-1).long().to(counts_S.device)
    counts_S.index_add_(0, ids.clamp(min=0), (ids >= 0).long())


class LoadRecorder:
    def __init__(self, num_layers: int, num_slots: int, window: int, device="cpu"):
        if window < 1:
            raise ValueError(f"load window ({window}) must be >= 1 step")
        self.num_layers, self.num_slots, self.window = num_layers, num_slots, window
        self.device = torch.device(device)
        self._steps: deque[torch.Tensor] = deque(maxlen=window)
        # the step under way counts into one buffer that lives as long as the recorder (a
        # step replayed from a CUDA graph writes where the capture saw it); a finished step
        # is kept in the window as a copy
        self._cur = torch.zeros(num_layers, num_slots, dtype=torch.long, device=self.device)

    def begin_step(self) -> None:
        if self._steps and self._steps[-1] is self._cur:
            self._steps[-1] = self._cur.clone()
        self._cur.zero_()
        self._steps.append(self._cur)

    def record(self, layer: int, physical_ids: torch.Tensor) -> None:
        """Count a layer's routed (token, k) pairs; no host sync."""
        count_pairs_(self._cur[layer], physical_ids)

    def clear(self) -> None:
        self._steps.clear()

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def window_load(self, group=None, reduce: bool = True) -> torch.Tensor:
        """[L, slots] counts over the window, summed over ranks (one all-reduce) when reduce."""
        if not self._steps:
            total = torch.zeros(self.num_layers, self.num_slots, dtype=torch.long,
                                device=self.device)
        else:
            total = torch.stack(list(self._steps)).sum(0)
        if reduce and group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return total


def balancedness_per_layer(load_LS: torch.Tensor, world: int) -> torch.Tensor:
    """mean/max of (token, k) pairs per rank, per layer (slots split evenly across ranks)."""
    per_rank = load_LS.double().view(load_LS.shape[0], world, -1).sum(-1)
    mx = per_rank.max(-1).values
    return torch.where(mx > 0, per_rank.mean(-1) / mx.clamp(min=1), torch.ones_like(mx))
