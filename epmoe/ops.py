"""The MoE layer as a torch custom op, so torch.compile and CUDA graphs can hold it.

    layers = LayerRegistry()                          # owned by the model that builds them
    handle = layers.register(layer)                  # once, at build time
    out_TD = torch.ops.epmoe.moe_forward(x_TD, handle)
    layers.close()                                   # at shutdown: handles stop resolving

`epmoe::moe_forward` is opaque to the compiler: its fake (meta) implementation says only that
the output is a new [T, D] tensor like x, so `torch.compile(fullgraph=True)` traces through a
model that calls it without a graph break, whatever comm / experts backend the layer holds.
A layer is named by an int handle (custom ops take tensors and scalars, not Python objects).
The `LayerRegistry` that issued it owns the layer (a strong reference, until `unregister` or
`close`); the op finds that registry from the handle's high bits through the one process-wide
index an int-taking op needs, which holds registries weakly and never a layer.

CUDA graphs, per comm backend:
- deepep-ll: graph-safe. Buffers are preallocated for the run's max tokens per rank; dispatch
  and combine make no host sync; the masked experts take a fixed `expected_m` hint. Capture the
  layer after one warm-up call (DeepGEMM / Triton compile on first use).
- deepep-ht, all2all, allgather: not graph-safe as they stand. HT needs the received-token
  count on the host (get_dispatch_layout -> dispatch syncs to size its outputs). DeepEP allows
  a graph with `num_worst_tokens` (worst-case receive size, intranode only), but the experts'
  contiguous layout then has to be sized for the worst case too (T x ranks x top_k rows plus
  alignment padding) and skip padded rows without reading counts on the host; until both are
  in place, run HT eagerly (or compiled with the op as a graph break-free opaque call).
"""

from __future__ import annotations

import itertools
import weakref

import torch

_SHIFT = 32  # handle = registry id << 32 | layer number in that registry
# The op's only way from an int back to an owner: registry id -> registry (weak: a dropped or
# closed registry disappears; the registries own the layers).
_REGISTRIES: "weakref.WeakValueDictionary[int, LayerRegistry]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


class LayerRegistry:
    """The layers one model exposes to torch.ops.epmoe.moe_forward, by int handle."""

    def __init__(self):
        self.id = next(_IDS)
        self._layers: dict[int, object] = {}
        self._next = itertools.count(1)
        _REGISTRIES[self.id] = self

    def register(self, layer) -> int:
        """-> the handle naming `layer` in torch.ops.epmoe.moe_forward (kept alive here)."""
        if self.id not in _REGISTRIES:
            raise ValueError(f"layer registry {self.id} is closed; create a new LayerRegistry")
        n = next(self._next)
        self._layers[n] = layer
        return self.id << _SHIFT | n

    def unregister(self, handle: int) -> None:
        self._layers.pop(handle & ((1 << _SHIFT) - 1), None)

    def get(self, handle: int):
        layer = self._layers.get(handle & ((1 << _SHIFT) - 1))
        if layer is None or handle >> _SHIFT != self.id:
            raise ValueError(f"no MoE layer is registered under handle {handle} in layer "
                             f"registry {self.id}; register it with LayerRegistry.register")
        return layer

    def close(self) -> None:
        """Drop every layer; handles of this registry stop resolving."""
        self._layers.clear()
        _REGISTRIES.pop(self.id, None)

    def __len__(self) -> int:
        return len(self._layers)


def _layer(handle: int):
    reg = _REGISTRIES.get(handle >> _SHIFT)
    if reg is None:
        raise ValueError(f"handle {handle} names no open layer registry; register the layer "
                         f"with LayerRegistry.register and keep the registry open")
    return reg.get(handle)


@torch.library.custom_op("epmoe::moe_forward", mutates_args=())
def moe_forward(x_TD: torch.Tensor, handle: int) -> torch.Tensor:
    """x [T, D] bf16 -> the registered layer's output [T, D] (router -> dispatch -> experts ->
    combine -> shared)."""
    return _layer(handle).forward(x_TD)


@moe_forward.register_fake
def _(x_TD: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(x_TD)


__all__ = ["LayerRegistry", "moe_forward"]
