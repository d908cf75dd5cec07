"""Tuning knobs of the symm backends (a frozen dataclass; no environment variables)."""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.kernels._common import INTERPRET


@dataclass(frozen=True)
class SymmOptions:
    """num_sms     CTAs of every persistent kernel (all resident: <= the GPU's SMs); the link
                   kernels of symm-ht are meant to use <= 24
    timeout_s   bound of every spin-wait; a timeout raises naming rank, peer and phase (under
                the interpreter it bounds polls: 1000 per second)
    exact_rows  symm-ht: sync once after the receive and return only the used rows (M exact)
                instead of the worst-case row count (no host sync, CUDA-graph safe)
    """

    num_sms: int = 24
    timeout_s: float = 10.0
    exact_rows: bool = False

    def __post_init__(self):
        if self.num_sms < 1:
            raise ValueError(f"num_sms ({self.num_sms}) must be >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s ({self.timeout_s}) must be > 0")

    @property
    def spin_limit(self) -> int:
        """The kernels' `limit`: nanoseconds of %globaltimer on GPU, polls when interpreting."""
        return max(1, int(self.timeout_s * 1000)) if INTERPRET else int(self.timeout_s * 1e9)


def grid(opts: SymmOptions, device) -> int:
    """Persistent grid size: num_sms, capped by the device's SMs (CPU: num_sms)."""
    import torch  # noqa: PLC0415

    dev = torch.device(device)
    if dev.type == "cuda" and not INTERPRET:
        return min(opts.num_sms, torch.cuda.get_device_properties(dev).multi_processor_count)
    return opts.num_sms
