"""Will the layers' weights and a step's activations fit? Checked before anything starts on this
machine (exit 2) and by each rank before it builds (a cluster's ranks: exit 3 naming the rank),
instead of a process killed by the kernel's or Ray's out-of-memory killer halfway through.

The estimate is a floor: the weights each rank holds in the run's recipe (its experts, the
router, the shared MLP) and the activations a step cannot do without (`rank_activation_bytes`),
nothing for workspaces, comm buffers or the process itself; a run it refuses cannot fit. A
run it passes may still run out of memory near the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.plan.run import RunConfig
from epmoe.plan.traffic import act_row_bytes, expert_weight_bytes, weight_bytes_per_elem

GiB = 2.0**30


class DoesNotFit(ValueError):
    """The floor exceeds the memory there is (a ValueError: bad input, exit 2 at launch)."""


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of the weights one rank holds, and what they are."""

    total: float
    layers: int
    per_layer_max: float
    torch_copy: bool = False  # the torch experts' fp32 copy is counted

    def describe(self, run: RunConfig) -> str:
        copy = ", with the torch experts' fp32 copy" if self.torch_copy else ""
        return (f"{self.total / GiB:.1f} GiB of weights per rank ({self.layers} layer(s) of "
                f"{run.model} in {run.quant.recipe}{copy}, up to "
                f"{self.per_layer_max / GiB:.2f} GiB each)")


TORCH_COPY_BYTES = 4.0  # the torch experts keep every weight dequantized in fp32 besides
# [rows, hidden] bf16 alive at a layer's residual add besides the run's token batch (kept for
# every step: step_tokens): the residual rows, the layer's input and its output
STREAM_TENSORS = 3


def _torch_experts(experts: str, device_type: str) -> bool:
    return experts == "torch" or (experts == "auto" and device_type == "cpu")


def rank_weight_bytes(run: RunConfig, rank: int = 0, device_type: str = "cuda") -> WeightBytes:
    """The weights `rank` builds: per layer its experts (all of them, intermediate split, for
    tp; its slots for ep and ep_dp; with the torch experts, the default on CPU, their fp32
    copy too), the router (fp32) and the shared MLP."""
    cfg, quant, world = run.cfg, run.quant, run.world
    total, worst, copy = 0.0, 0.0, False
    for l in range(run.num_layers):
        plan = run.layer_plan(l, rank, "auto")
        if plan.form == "tp":
            experts, inter = cfg.num_experts, cfg.moe_intermediate // world
        else:
            experts, inter = len(plan.local_slots(cfg)), cfg.moe_intermediate
        b = expert_weight_bytes(experts, cfg.hidden, inter, quant) + cfg.num_experts * \
            cfg.hidden * 4.0
        if _torch_experts(plan.experts, device_type):
            b += experts * 3.0 * inter * cfg.hidden * TORCH_COPY_BYTES
            copy = True
        if cfg.num_shared_experts:
            b += 3.0 * cfg.shared_intermediate * cfg.hidden * weight_bytes_per_elem(quant)
        total, worst = total + b, max(worst, b)
    return WeightBytes(total, run.num_layers, worst, copy)


def rank_activation_bytes(run: RunConfig, rank: int = 0, device_type: str = "cuda") -> float:
    """A floor on one step's activations on `rank`, at its largest layer (bf16 throughout):
    the run's token batch, the residual stream (`STREAM_TENSORS` x the rows the layer holds x
    hidden), the router's logits; under ep_dp with more than one rank one received row per
    token it holds, quantized as sent (all2all's output holds a row per (token, rank); the
    DeepEP and symm backends' buffers are sized for the worst case); with grouped GEMMs (not the torch
    experts, which run one expert at a time) GEMM1's and GEMM2's outputs for the mean (token,
    k) pairs of a rank, per micro-batch. Means, not the hottest rank: summed over a machine's
    ranks they are exact."""
    cfg, d, k = run.cfg, run.cfg.hidden, run.cfg.top_k
    worst = 0.0
    for l in range(run.num_layers):
        plan, rows = run.layer_plan(l, rank, "auto"), float(run.layer_tokens(l))
        b = (run.tokens * d + (STREAM_TENSORS * d + cfg.num_experts) * rows) * 2.0
        if plan.form == "ep_dp" and run.world > 1:
            b += rows * act_row_bytes(d, run.quant) / run.micro_batches
        if not _torch_experts(plan.experts, device_type):
            pairs = rows * k / (run.world if plan.form == "ep" else 1)
            inter = cfg.moe_intermediate // (run.world if plan.form == "tp" else 1)
            b += pairs * (2.0 * inter + d) * 2.0 / run.micro_batches
        worst = max(worst, b)
    return worst


@dataclass(frozen=True)
class RankBytes:
    """What one rank needs at the least: its weights and a step's activations."""

    weights: WeightBytes
    activations: float

    @property
    def total(self) -> float:
        return self.weights.total + self.activations

    def describe(self, run: RunConfig) -> str:
        return (f"{self.weights.describe(run)} + {self.activations / GiB:.1f} GiB of a step's "
                f"activations ({run.tokens} token(s))")


def rank_bytes(run: RunConfig, rank: int = 0, device_type: str = "cuda") -> RankBytes:
    return RankBytes(rank_weight_bytes(run, rank, device_type),
                     rank_activation_bytes(run, rank, device_type))


def mem_available_bytes() -> float | None:
    """This host's MemAvailable (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_free_bytes(device) -> float:
    """What this process can still allocate on a GPU: the driver's free memory and the
    blocks torch's caching allocator holds but no tensor uses (a process that built and
    dropped a model before, e.g. a calibration going from layer to layer, keeps them)."""
    import torch

    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return float(torch.cuda.mem_get_info(device)[0] + max(cached, 0))


def _advice(run: RunConfig, need: RankBytes) -> str:
    if need.activations > need.weights.total:
        return (f"lower --tokens (now {run.tokens}), or spread them over more ranks or "
                f"machines")
    return (f"lower --layers (now {run.num_layers}), spread the experts over more ranks or "
            f"machines, or pick a smaller recipe or model")


def check_fits_here(run: RunConfig, device: str) -> None:
    """Every rank of a local run on this machine: its CPUs share the host's memory; on CUDA
    each GPU holds ranks_per_gpu ranks. ValueError (exit 2) when the floor exceeds it."""
    need = rank_bytes(run, 0, device)
    if device == "cpu":
        avail = mem_available_bytes()
        if avail is not None and need.total * run.world > avail:
            raise DoesNotFit(f"the run does not fit this machine's memory: "
                             f"{need.describe(run)} x {run.world} rank(s) = "
                             f"{need.total * run.world / GiB:.1f} GiB, {avail / GiB:.1f} GiB "
                             f"available: {_advice(run, need)}")
        return
    import torch

    gpus = min(torch.cuda.device_count(), -(-run.world // run.ranks_per_gpu))
    for i in range(gpus):
        free = gpu_free_bytes(i)
        if need.total * run.ranks_per_gpu > free:
            raise DoesNotFit(f"the run does not fit GPU {i}: {need.describe(run)} x "
                             f"{run.ranks_per_gpu} rank(s) on it, {free / GiB:.1f} GiB free: "
                             f"{_advice(run, need)}")


def check_rank_fits(run: RunConfig, rank: int, device) -> None:
    """One rank, before it builds (on a cluster the launcher cannot see the ranks' memory):
    ValueError naming the rank when its floor exceeds its device's free memory."""
    need = rank_bytes(run, rank, device.type)
    if device.type == "cuda":
        free, where = gpu_free_bytes(device) / run.ranks_per_gpu, "its GPU"
    else:
        free, where = mem_available_bytes(), "its host"
    if free is not None and need.total > free:
        raise DoesNotFit(f"rank {rank}: {need.describe(run)} do not fit: {where} has "
                         f"{free / GiB:.1f} GiB free; {_advice(run, need)}")
