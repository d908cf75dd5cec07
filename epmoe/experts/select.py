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


def _auto_candidates(cfg: MoEConfig, quant: QuantConfig,
                     device) -> tuple[list[type], list[str]]:
    """The classes `auto` may pick here, best first, and a note on each one it may not."""
    from epmoe.experts.torch_experts import TorchExperts

    notes, ok = [], []
    if device.type == "cuda":
        cls, why = _deepgemm_class()
        why = why or (cls.supports(cfg, quant, device) or "")
        if why:
            notes.append(f"deepgemm: {why}")
        else:
            ok.append(cls)
        order = [_triton_class(), TorchExperts]
    else:
        notes.append(f"deepgemm: device {device} is not CUDA")
        order = [TorchExperts, _triton_class()]  # triton: the CPU interpreter
    for cls in order:
        why = cls.supports(cfg, quant, device)
        if why:
            notes.append(f"{cls.name}: {why}")
        else:
            ok.append(cls)
    return ok, notes


def _none_can_run(quant: QuantConfig, device, notes: list[str]) -> ValueError:
    return ValueError(f"no experts backend can run {quant.recipe} with scale_fmt "
                      f"{quant.scale_fmt} on {device}: {'; '.join(notes)}")


def resolve_experts(name: str, cfg: MoEConfig, quant: QuantConfig,
                    device) -> tuple[type[Experts], str]:
    """-> (the Experts class that `name` picks here, reason), or ValueError saying why the
    requested backend cannot run. No weights needed: the launcher asks before any rank starts.
    Reason: one line, e.g. "deepgemm: not installed (ImportError: ...); triton: chosen"."""
    if name not in NAMES:
        raise ValueError(f"experts backend ({name!r}) must be one of {NAMES}")
    device = torch.device(device)
    if name == "auto":
        ok, notes = _auto_candidates(cfg, quant, device)
        if not ok:
            raise _none_can_run(quant, device, notes)
        return ok[0], "; ".join(notes + [f"{ok[0].name}: chosen"])
    if name == "deepgemm":
        cls, why = _deepgemm_class()
        why = why or (cls.supports(cfg, quant, device) or "")
        others = "'triton', 'torch' or 'auto'"
    else:
        from epmoe.experts.torch_experts import TorchExperts

        cls = TorchExperts if name == "torch" else _triton_class()
        why = cls.supports(cfg, quant, device)
        others = "'triton' or 'auto'" if name == "torch" else "'torch' or 'auto'"
    if why:
        raise ValueError(f"experts backend '{name}' cannot run here: {why}; pick {others}")
    return cls, f"{name}: chosen"


def make_experts(name: str, weights: ExpertWeights, cfg: MoEConfig, quant: QuantConfig,
                 device) -> tuple[Experts, str]:
    """-> (experts, reason): `resolve_experts`'s choice built on these weights; under `auto` a
    backend that refuses these weights at construction falls through to the next."""
    if name != "auto":
        cls, reason = resolve_experts(name, cfg, quant, device)
        return cls(weights, cfg, quant), reason
    device = torch.device(device)
    ok, notes = _auto_candidates(cfg, quant, device)
    for cls in ok:
        try:
            return cls(weights, cfg, quant), "; ".join(notes + [f"{cls.name}: chosen"])
        except ValueError as exc:
            notes.append(f"{cls.name}: {str(exc).splitlines()[0]}")
    raise _none_can_run(quant, device, notes)


__all__ = ["make_experts", "resolve_experts", "NAMES"]
