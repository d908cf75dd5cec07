"""epmoe: an expert-parallel Mixture-of-Experts runtime.

Tensor names carry their shape as a suffix; the legend (README "Naming"):
T tokens on this rank, N tokens received by this rank, K top-k slots, D hidden,
I moe intermediate (per partition), F = 2*I (gate and up fused), E experts (global or local,
as the name says), M rows of the contiguous expert layout, C capacity per expert (masked layout),
G quant groups along a row, L layers, R replicas / physical slots.
"""

from epmoe import env as _env  # noqa: F401  (sets EPMOE_ / interpreter defaults first)

__version__ = "0.1.0"
