"""Pick the experts backend: one call, one instance, one line saying why.

| name     | picks                                                                           |
| auto     | DeepGEMM if CUDA, importable and it supports the config; else Triton on CUDA;   |
|          | else torch (CPU)                                                                |
| torch    | the plain-torch reference (runs everywhere)                                     |
| triton   | Triton kernels (CUDA, or the CPU interpreter)                                   |
| deepgemm | DeepGEMM (CUDA, SM90/SM100)                                                     |
"""

from __future__ import annotations

import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import ExpertWeights, Experts

NAMES = ("auto", "torch", "triton", "deepgemm")


def _deepgemm_class() -> tuple[type | None, str]:
    """(class, "") or (None, why it is unavailable). Imported lazily: deep_gemm raises OSError
    (missing libnvrtc) rather than ImportError on machines without CUDA."""
    if not torch.cuda.is_available():
        return None, "no CUDA"
    try:
        from epmoe.experts import deepgemm_experts as mod
    except (ImportError, OSError, RuntimeError) as exc:
        return None, f"not installed ({type(exc).__name__}: {exc})"
    for obj in vars(mod).values():
        if isinstance(obj, type) and issubclass(obj, Experts) and obj.name == "deepgemm":
            return obj, ""
    return None, "epmoe.experts.deepgemm_experts defines no Experts class named 'deepgemm'"


def _triton_class():
    from epmoe.experts.triton_experts import TritonExperts

    return TritonExperts


def make_experts(name: str, weights: ExpertWeights, cfg: MoEConfig, quant: QuantConfig,
                 device) -> tuple[Experts, str]:
    """-> (experts, reason), reason one line, e.g.
    "deepgemm: not installed (ImportError: ...); triton: chosen"."""
    if name not in NAMES:
        raise ValueError(f"experts backend ({name!r}) must be one of {NAMES}")
    device = torch.device(device)
    if name == "torch":
        from epmoe.experts.torch_experts import TorchExperts

        return TorchExperts(weights, cfg, quant), "torch: chosen"
    if name == "deepgemm":
        cls, why = _deepgemm_class()
        why = why or (cls.supports(cfg, quant, device) or "")
        if why:
            raise ValueError(f"experts backend 'deepgemm' cannot run here: {why}; pick "
                             f"'triton', 'torch' or 'auto'")
        return cls(weights, cfg, quant), "deepgemm: chosen"
    if name == "triton":
        cls = _triton_class()
        why = cls.supports(cfg, quant, device)
        if why:
            raise ValueError(f"experts backend 'triton' cannot run here: {why}; pick 'torch' "
                             f"or 'auto'")
        return cls(weights, cfg, quant), "triton: chosen"
    # auto
    notes = []
    if device.type == "cuda":
        cls, why = _deepgemm_class()
        why = why or (cls.supports(cfg, quant, device) or "")
        for name, make in (("deepgemm", cls), ("triton", _triton_class())):
            if name == "triton":
                why = make.supports(cfg, quant, device) or ""
            if not why:
                try:  # a backend that refuses these weights at construction falls through too
                    return make(weights, cfg, quant), "; ".join(notes + [f"{name}: chosen"])
                except ValueError as exc:
                    why = str(exc).splitlines()[0]
            notes.append(f"{name}: {why}")
    else:
        notes.append(f"deepgemm, triton: device {device} is not CUDA")
    from epmoe.experts.torch_experts import TorchExperts

    return TorchExperts(weights, cfg, quant), "; ".join(notes + ["torch: chosen"])


__all__ = ["make_experts", "NAMES"]
