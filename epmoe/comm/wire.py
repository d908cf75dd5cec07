"""Moving tensors through torch.distributed portably (gloo and NCCL).

gloo rejects fp8 and int16 (and a failed collective can wedge the group): every floating
payload travels as its raw bytes (a uint8 view, last dim times the element size): bit-exact,
and valid on every backend. Packed UE8M0 scales travel as their fp32 values
(`wire_quant`), packing happens next to the GEMM that reads them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epmoe.config import QuantConfig
from epmoe.quant import QTensor

# torch 2.13 renamed the tensor collectives (the old names warn on every call); older torch
# has only the old names. Same signatures.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def as_wire(t: torch.Tensor) -> torch.Tensor:
    """Floating tensors as contiguous uint8 bytes [..., D * itemsize]; integers unchanged."""
    t = t.contiguous()
    if not t.is_floating_point():
        return t
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8)


def from_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.view(dtype)


def wire_quant(quant: QuantConfig) -> QuantConfig:
    if quant.scale_fmt == "ue8m0_packed":
        return QuantConfig(quant.recipe, "ue8m0_fp32")
    return quant


def all_to_all_rows(x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    group) -> torch.Tensor:
    """Rows of x (grouped by destination) -> rows received (grouped by source)."""
    if x.dim() == 1:  # a 1-D float's byte view has itemsize rows per element: keep one
        return all_to_all_rows(x[:, None], send_splits, recv_splits, group)[:, 0]
    w = as_wire(x)
    out = torch.empty((sum(recv_splits), *w.shape[1:]), dtype=w.dtype, device=x.device)
    dist.all_to_all_single(out, w, recv_splits, send_splits, group=group)
    return from_wire(out, x.dtype)


def all_to_all_qtensor(x: QTensor, send_splits, recv_splits, group) -> QTensor:
    data = all_to_all_rows(x.data, send_splits, recv_splits, group)
    scale = None if x.scale is None else all_to_all_rows(x.scale, send_splits, recv_splits,
                                                          group)
    return QTensor(data, scale, x.recipe, x.group, x.scale_fmt)


def all_gather_rows(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """Equal-size row blocks from every rank, concatenated in rank order."""
    w = as_wire(x)
    out = torch.empty((world * w.shape[0], *w.shape[1:]), dtype=w.dtype, device=x.device)
    all_gather_single(out, w, group=group)
    return from_wire(out, x.dtype)
