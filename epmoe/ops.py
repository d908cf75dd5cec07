"""The MoE layer as a torch custom op, so torch.compile and CUDA graphs can hold it.

    handle = register_layer(layer)                   # once, at build time
    out_TD = torch.ops.epmoe.moe_forward(x_TD, handle)

`epmoe::moe_forward` is opaque to the compiler: its fake (meta) implementation says only that
the output is a new [T, D] tensor like x, so `torch.compile(fullgraph=True)` traces through a
model that calls it without a graph break, whatever comm / experts backend the layer holds.
A layer is named by an int handle (custom ops take tensors and scalars, not Python objects);
handles live in a weak map, so a dropped layer frees its weights.

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

_LAYERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def register_layer(layer) -> int:
    """-> the int handle that names `layer` in torch.ops.epmoe.moe_forward."""
    handle = next(_NEXT)
    _LAYERS[handle] = layer
    return handle


def _layer(handle: int):
    layer = _LAYERS.get(handle)
    if layer is None:
        raise ValueError(f"no MoE layer is registered under handle {handle}; call "
                         f"epmoe.ops.register_layer(layer) and keep the layer alive")
    return layer


@torch.library.custom_op("epmoe::moe_forward", mutates_args=())
def moe_forward(x_TD: torch.Tensor, handle: int) -> torch.Tensor:
    """x [T, D] bf16 -> the registered layer's output [T, D] (router -> dispatch -> experts ->
    combine -> shared)."""
    return _layer(handle).forward(x_TD)


@moe_forward.register_fake
def _(x_TD: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(x_TD)


__all__ = ["moe_forward", "register_layer"]
