"""Every environment variable epmoe reads, in one place (debugging and caches only).

Configuration is typed dataclasses (epmoe.config); nothing here changes numerics.
| variable | meaning |
| EPMOE_LOG_LEVEL | log level of the `epmoe` logger (default WARNING) |
| EPMOE_TRITON_INTERPRET | 1: force Triton's CPU interpreter even with CUDA present (debugging) |
| EPMOE_RAY_TMPDIR | parent of the private temp dir of each local Ray cluster (default: the |
|                  | system temp dir); it must be short: Ray's socket paths are length-limited |
| EPMOE_FAULT | tests only: "RANK:WHERE:KIND" makes that rank fail there (see launch/faults.py) |
| EPMOE_FAULT_MARK | tests only: a file the failing rank appends "RANK PID" to as its fault fires |
Without CUDA, TRITON_INTERPRET=1 is set before any Triton kernel is defined, so kernels run on CPU.
"""

from __future__ import annotations

import logging
import os

LOG_LEVEL = os.environ.get("EPMOE_LOG_LEVEL", "WARNING").upper()
FORCE_TRITON_INTERPRET = os.environ.get("EPMOE_TRITON_INTERPRET", "0") == "1"
RAY_TMPDIR = os.environ.get("EPMOE_RAY_TMPDIR") or None


def fault_spec() -> str:
    """EPMOE_FAULT, read when asked (a Ray worker receives it after its modules were imported)."""
    return os.environ.get("EPMOE_FAULT", "")


def fault_mark() -> str:
    """EPMOE_FAULT_MARK, read when a fault fires ("" = none)."""
    return os.environ.get("EPMOE_FAULT_MARK", "")


def forwarded_env() -> dict[str, str]:
    """The variables of this process that every rank must see too: all EPMOE_* and the ones
    that choose how the GPU and network libraries behave."""
    keep = ("TRITON_INTERPRET", "PYTHONPATH", "LD_LIBRARY_PATH", "NVSHMEM_REMOTE_TRANSPORT",
            "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    return {k: v for k, v in os.environ.items() if k.startswith("EPMOE_") or k in keep}


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


if FORCE_TRITON_INTERPRET or not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

logger = logging.getLogger("epmoe")
if not logger.handlers:
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("[epmoe %(levelname)s] %(message)s"))
    logger.addHandler(_h)
logger.setLevel(LOG_LEVEL)

# The variables every GPU worker must carry (NVLink multicast off; single-node NVSHMEM).
SAFETY_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# Single node over NVLink (no remote transport), NVLink multicast off: NVSHMEM (DeepEP's
# low-latency buffers, the symmetric arena) reads these when it initializes.
NVSHMEM_SINGLE_NODE_ENV = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def use_single_node_nvshmem() -> None:
    """The one place epmoe writes the process environment: before NVSHMEM initializes in a
    single-node CUDA process (the Runtime calls it), unless the user set the variables."""
    for k, v in NVSHMEM_SINGLE_NODE_ENV.items():
        os.environ.setdefault(k, v)
