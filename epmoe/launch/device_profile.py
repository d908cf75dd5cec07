"""Which shipped profile a launch predicts with, from its device, ranks, nodes and timing
(epmoe.launch.planning; README "Planning")."""

from __future__ import annotations

from epmoe.plan.topology import gpu_kind_of

# measured profiles that ship, by (GPU kind, ranks on one node, timing): a run on a machine
# like the one measured predicts with what was measured there; any other shape gets the
# kind's spec profile, whose mechanisms (links, fan-out to ranks and nodes, SMs) carry to
# setups nobody measured (README "Planning")
MEASURED_PROFILES = {("h200", 1, "launched"): "h200-calibrated",
                     ("h200", 1, "device"): "h200-device-timed",
                     ("h200", 2, "launched"): "h200x2-calibrated",
                     ("h100", 1, "launched"): "h100-calibrated",
                     ("h100", 1, "device"): "h100-device-timed"}


def profile_for_device(device: str, sm_arch: int = 0, ranks: int = 0, nodes: int = 1,
                       timing: str = "launched") -> tuple[str, str | None]:
    """(shipped profile, warning or None) for a device description: "cpu", a GPU name, or a
    worker's "cuda (NVIDIA H200, visible 0)"; sm_arch (capability x 10) picks the nearest.
    With the run's ranks, nodes and timing ("device" also for CUDA-graph replays): the measured
    profile of that setup when one ships (MEASURED_PROFILES), else the spec one."""
    d = device.lower()
    if "cuda" not in d and "nvidia" not in d:
        return "cpu", None
    key = gpu_kind_of(d)
    if key is not None:
        measured = MEASURED_PROFILES.get((key, ranks, timing)) if nodes == 1 else None
        return measured or key, None
    near = "b200" if sm_arch >= 100 else "h100"
    return near, (f"no shipped profile for {device!r}: predicting with the nearest spec "
                  f"profile {near!r} (SM{sm_arch or '?'}); calibrate this machine with python "
                  f"-m epmoe.bench.calibrate --out mine.json and pass --profile mine.json")


def timing_kind(timing: str, cuda_graph: bool) -> str:
    """The timing a run's stages are measured under, as profiles record it (a CUDA-graph
    replay issues nothing from the host: GPU time, as "device")."""
    return "device" if cuda_graph else timing


def device_and_arch(device_flag: str = "auto") -> tuple[str, int]:
    """(device name, sm_arch) of this process's first device ("cpu", 0 without CUDA)."""
    import torch

    if device_flag != "cpu" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return torch.cuda.get_device_name(0), 10 * major + minor
    return "cpu", 0
