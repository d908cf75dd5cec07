"""Pick the experts backend: one call, one instance, one line saying why.

| name     | picks                                                                           |
| auto     | DeepGEMM if CUDA, importable and it supports the config; else Triton on CUDA;   |
|          | else torch (CPU), or Triton's interpreter for what torch cannot run             |
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


def resolve_experts(name: str, cfg: MoEConfig, quant: QuantConfig,
                    device) -> tuple[type[Experts], str]:
    """-> (the Experts class that `name` picks here, reason), or ValueError saying why the
    requested backend cannot run. No weights needed: the launcher asks before any rank starts.
    Reason: one line, e.g. "deepgemm: not installed (ImportError: ...); triton: chosen"."""
    if name not in NAMES:
        raise ValueError(f"experts backend ({name!r}) must be one of {NAMES}")
    device = torch.device(device)
    from epmoe.experts.torch_experts import TorchExperts

    if name == "torch":
        why = TorchExperts.supports(cfg, quant, device)
        if why:
            raise ValueError(f"experts backend 'torch' cannot run here: {why}; pick 'triton' "
                             f"or 'auto'")
        return TorchExperts, "torch: chosen"
    if name == "deepgemm":
        cls, why = _deepgemm_class()
        why = why or (cls.supports(cfg, quant, device) or "")
        if why:
            raise ValueError(f"experts backend 'deepgemm' cannot run here: {why}; pick "
                             f"'triton', 'torch' or 'auto'")
        return cls, "deepgemm: chosen"
    if name == "triton":
        cls = _triton_class()
        why = cls.supports(cfg, quant, device)
        if why:
            raise ValueError(f"experts backend 'triton' cannot run here: {why}; pick 'torch' "
                             f"or 'auto'")
        return cls, "triton: chosen"
    # auto
    notes = []
    if device.type == "cuda":
        cls, why = _deepgemm_class()
        why = why or (cls.supports(cfg, quant, device) or "")
        if not why:
            return cls, "deepgemm: chosen"
        notes.append(f"deepgemm: {why}")
        candidates = [_triton_class(), TorchExperts]
    else:
        notes.append(f"deepgemm: device {device} is not CUDA")
        candidates = [TorchExperts, _triton_class()]  # triton: the CPU interpreter
    for cls in candidates:
        why = cls.supports(cfg, quant, device)
        if not why:
            return cls, "; ".join(notes + [f"{cls.name}: chosen"])
        notes.append(f"{cls.name}: {why}")
    raise ValueError(f"no experts backend can run {quant.recipe} with scale_fmt "
                     f"{quant.scale_fmt} on {device}: {'; '.join(notes)}")


def make_experts(name: str, weights: ExpertWeights, cfg: MoEConfig, quant: QuantConfig,
                 device) -> tuple[Experts, str]:
    """-> (experts, reason): `resolve_experts`'s choice, built on these weights."""
    cls, reason = resolve_experts(name, cfg, quant, device)
    return cls(weights, cfg, quant), reason


__all__ = ["make_experts", "resolve_experts", "NAMES"]
