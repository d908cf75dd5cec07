"""Everything the launcher checks before any rank starts; a failure is exit 2 (InputError or
ValueError, one line: the value, the rule, the fix)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os

from epmoe.argtypes import given_flags
from epmoe.config import DEFAULT_PRESET, PRESETS, RECIPES, QuantConfig, get_preset
from epmoe.launch.cluster import ClusterAddress, parse_address
from epmoe.launch.errors import InputError
from epmoe.outputs import dir_problem, file_problem

MAX_SEED = 2**32  # seeds feed torch generators through small products: keep them in range


def check_launch(a: argparse.Namespace, run) -> ClusterAddress | None:
    """The checks beyond the run itself (outputs, fault injection, the address) for the run
    the launch will start (the flags' own, or the planner's): -> the address to join."""
    _check_writable_file(a.out, "--out")
    if a.plot:
        _check_plot_dir(a.plot)
    _check_fault(run.world)
    return parse_address(a.address) if a.address else None


def build_run(a: argparse.Namespace):
    """Flags -> RunConfig (no files, no network: usable from tests)."""
    from epmoe.plan.run import RunConfig

    if a.ep < 1 or a.tp < 1:
        raise ValueError(f"--ep ({a.ep}) and --tp ({a.tp}) must be >= 1")
    if a.ep > 1 and a.tp > 1:
        raise ValueError(f"--ep {a.ep} with --tp {a.tp}: one parallel form per run (the planner "
                         f"mixes them per layer); pick --ep or --tp")
    weights = getattr(a, "weights", None)
    if weights and not os.path.isdir(weights):
        raise ValueError(f"--weights {weights!r}: no such folder (a Hugging Face checkpoint: "
                         f"safetensors + config.json)")
    model = weights if weights and a.model == DEFAULT_PRESET else a.model
    cfg = get_preset(model)
    if a.quant not in RECIPES:
        raise ValueError(f"--quant {a.quant!r} is not a recipe; choose one of {', '.join(RECIPES)}")
    quant = QuantConfig(a.quant, a.scale_fmt)
    if a.tp > 1:
        form, world = "tp", a.tp
    elif a.ep > 1:
        form, world = ("ep_dp" if a.dp else "ep"), a.ep
    else:
        form, world = "ep_dp", 1
    if not 0 <= a.seed < MAX_SEED:
        raise ValueError(f"--seed ({a.seed}) must be in [0, 2**32)")
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        raise ValueError(f"--timeout ({a.timeout}) must be a finite number of seconds > 0")
    start_timeout = getattr(a, "start_timeout", None)
    start_timeout = max(a.timeout, 300.0) if start_timeout is None else start_timeout
    if not (math.isfinite(start_timeout) and start_timeout > 0):
        raise ValueError(f"--start-timeout ({start_timeout}) must be a finite number of "
                         f"seconds > 0")
    if a.redundant_experts < 0:
        raise ValueError(f"--redundant-experts ({a.redundant_experts}) must be >= 0")
    if a.redundant_experts and not a.eplb:
        raise ValueError("--redundant-experts needs --eplb (replicas are placed by EPLB)")
    if a.eplb and form == "tp":
        raise ValueError("--eplb places experts across EP ranks: use --ep, not --tp")
    _check_paired(a)
    ll_max, window = flag(a, "ll_max_tokens"), flag(a, "eplb_window")
    if ll_max < 1:
        raise ValueError(f"--ll-max-tokens ({ll_max}) must be >= 1")
    if a.eplb and flag(a, "rebalance_every") < 1:
        raise ValueError(f"--rebalance-every ({flag(a, 'rebalance_every')}) must be >= 1")
    if a.eplb and window < 1:
        raise ValueError(f"--eplb-window ({window}) must be >= 1 step (the load a "
                         f"rebalance looks at)")
    slots = cfg.num_experts + a.redundant_experts
    if a.redundant_experts and form != "tp" and slots % world:
        raise ValueError(f"physical expert slots ({cfg.num_experts} experts + "
                         f"{a.redundant_experts} redundant = {slots}) must be divisible by ep "
                         f"({world}), each rank holding the same number; choose "
                         f"--redundant-experts so that {cfg.num_experts} + R is a multiple of "
                         f"{world}")
    rpg = getattr(a, "ranks_per_gpu", 1)
    if rpg != 1:
        _check_shared_gpus(a, rpg, form, world)
    graph = getattr(a, "cuda_graph", False)
    comm_options = _comm_options(a)
    if weights:
        _check_weights(weights, cfg, model, a.layers)
    # a config.json is read here, once: the ranks get its MoEConfig, not the path
    run = RunConfig(model=model, model_config=None if model in PRESETS else cfg, quant=quant,
                    weights=weights, form=form, world=world, backend=a.backend,
                    experts=a.experts, tokens=a.tokens, layers=a.layers, steps=a.steps,
                    seed=a.seed, routing=a.routing, redundant_experts=a.redundant_experts,
                    timeout_s=a.timeout, start_timeout_s=start_timeout, check=a.check,
                    ll_max_tokens=ll_max,
                    eplb=a.eplb, eplb_window=window, eplb_migration=flag(a, "eplb_migration"),
                    micro_batches=getattr(a, "micro_batches", 1),
                    timing=getattr(a, "timing", "launched"), ranks_per_gpu=rpg,
                    cuda_graph=graph, comm_options=comm_options)
    run.validate()
    if graph and local_device(a) == "cpu":  # (a cluster's device: check_runnable)
        raise ValueError("--cuda-graph captures CUDA work; drop it with --device cpu"
                         if a.device == "cpu" else
                         "--cuda-graph captures CUDA work, but the ranks run on cpu (this "
                         "machine has no CUDA device): drop it, or give --address of a GPU "
                         "cluster")
    if (form != "ep_dp" or world == 1) and a.backend not in ("auto", "local"):
        raise ValueError(f"--backend {a.backend} moves tokens between ranks, which form {form} "
                         f"on {world} rank(s) does not do: use --ep > 1 with --dp, or "
                         f"--backend auto")
    _check_routing(run)
    return run


SHARED_GPU_BACKENDS = ("symm-ht", "symm-ll")  # NCCL and DeepEP need a GPU per rank


# flags that mean something only beside another (None when not given) and their defaults
EPLB_FLAGS = {"rebalance_every": 2, "eplb_window": 8, "eplb_migration": "sync"}
AUTO_FLAGS = {"ll_max_tokens": 256}


def flag(a: argparse.Namespace, name: str):
    """A paired flag's value: as given, else its default."""
    v = getattr(a, name, None)
    return {**EPLB_FLAGS, **AUTO_FLAGS}[name] if v is None else v


def _check_paired(a: argparse.Namespace) -> None:
    """An EPLB flag without --eplb, or --ll-max-tokens beside a fixed --backend, is refused
    (both were ignored)."""
    if not a.eplb and (names := given_flags(a, EPLB_FLAGS)):
        raise ValueError(f"{', '.join(names)} need{'' if len(names) > 1 else 's'} --eplb "
                         f"(without it nothing rebalances)")
    if getattr(a, "backend", "auto") != "auto" and (names := given_flags(a, AUTO_FLAGS)):
        raise ValueError(f"{names[0]} chooses between DeepEP's modes for --backend auto; "
                         f"--backend {a.backend} is fixed")


def _comm_options(a: argparse.Namespace) -> tuple:
    """--comm-option KNOB=VALUE ... -> RunConfig.comm_options (symm-ht / symm-ll only)."""
    items = getattr(a, "comm_option", None) or []
    if not items:
        return ()
    from epmoe.comm import SYMM
    from epmoe.comm.symm.options import GATHER_KNOBS, parse_knobs

    if a.backend not in ("auto", *SYMM):
        raise ValueError(f"--comm-option tunes symm-ht / symm-ll (SymmOptions); --backend "
                         f"{a.backend} takes none")
    knobs = parse_knobs(items)
    for knob, backend in GATHER_KNOBS.items():
        if dict(knobs).get(knob) and a.experts != "triton":
            raise ValueError(f"--comm-option {knob} leaves {backend}'s rows for an expert GEMM "
                             f"that reads them through an index: it needs --experts triton "
                             f"(got --experts {a.experts})")
    return knobs


def _check_weights(path: str, cfg, model: str, layers: int | None) -> None:
    """--weights: a checkpoint of this model's layers, with as many MoE layers as the run."""
    import dataclasses

    from epmoe.checkpoint import SafetensorsCheckpoint
    from epmoe.hf_config import read_hf_config

    hf = read_hf_config(path)  # the naming and layer indices the ranks will read by
    if hf.naming is None:
        raise ValueError(f"--weights {path!r}: epmoe does not read {hf.model_type} "
                         f"checkpoints (their config.json runs on synthetic weights: --model)")
    try:
        SafetensorsCheckpoint(path)
    except FileNotFoundError as exc:
        raise ValueError(f"--weights {path!r}: {exc}") from None
    for f in dataclasses.fields(cfg):
        mine, theirs = getattr(cfg, f.name), getattr(hf.cfg, f.name)
        if f.name not in ("name", "num_moe_layers") and mine != theirs:
            raise ValueError(f"--weights {path!r}: its config.json has {f.name} {theirs!r}, "
                             f"--model {model} has {mine!r}")
    n = cfg.num_moe_layers if layers is None else layers
    if n > len(hf.moe_layers):
        raise ValueError(f"--layers {n}: the checkpoint {path!r} has {len(hf.moe_layers)} MoE "
                         f"layers")


def _check_shared_gpus(a: argparse.Namespace, rpg: int, form: str, world: int) -> None:
    """--ranks-per-gpu N > 1: ranks time-slice a GPU over a gloo group; only our symm backends
    run there (NCCL refuses two ranks on one GPU, DeepEP wants a GPU per rank)."""
    if rpg < 1:
        raise ValueError(f"--ranks-per-gpu ({rpg}) must be >= 1")
    if a.device == "cpu":
        raise ValueError("--ranks-per-gpu shares GPUs; with --device cpu every rank is a CPU "
                         "process already: drop --ranks-per-gpu")
    if getattr(a, "plan", None) is not None:
        raise ValueError(f"--ranks-per-gpu {rpg} with --plan {a.plan}: ranks sharing a GPU "
                         f"run one named backend; drop --plan and give --ep and --backend")
    if form != "ep_dp" or world < 2 or a.backend not in SHARED_GPU_BACKENDS:
        raise ValueError(f"--ranks-per-gpu {rpg} runs --ep > 1 with --backend "
                         f"{' or '.join(SHARED_GPU_BACKENDS)} (NCCL refuses two ranks on one "
                         f"GPU and DeepEP needs a GPU per rank); this run has form {form}, "
                         f"{world} rank(s), --backend {a.backend}")
    if a.eplb:
        raise ValueError("--eplb with --ranks-per-gpu > 1 is not supported (its weight "
                         "moves were never checked over a gloo group on a shared GPU): drop "
                         "one of them")


def _check_routing(run) -> None:
    kind, _, rest = run.routing.partition(":")
    if kind == "router":
        return
    if kind == "trace" and rest:
        check_trace(rest, run)
        return
    from epmoe.eplb.routing import make_routing

    make_routing(run.routing, 1, run.cfg.num_experts, run.cfg.top_k, 2, 0, run.seed)


def check_trace(path: str, run) -> None:
    """A routing trace fits this run: readable, [steps, layers, tokens of all ranks, top_k],
    ids in [0, experts), distinct within a token."""
    from epmoe.eplb.routing import load_trace

    t = load_trace(path)  # a ValueError naming the file when it cannot be read or is not one
    cfg = run.cfg
    steps, shape = t.shape[0], tuple(t.shape[1:])
    want = (run.num_layers, run.global_tokens, cfg.top_k)
    if steps < 1 or shape != want:
        per = f"{run.tokens} per rank x {run.world} ranks" if run.own_tokens else "all ranks"
        raise InputError(f"trace {path!r} has (layers, tokens, top_k) = {shape} over {steps} "
                         f"step(s), but this run needs {want} ({run.num_layers} layers, "
                         f"{want[1]} tokens = {per}, top_k {cfg.top_k} of {run.model}): record "
                         f"the trace with the run's shape, or change --layers/--tokens/--ep")
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= cfg.num_experts:
        raise InputError(f"trace {path!r}: expert ids span [{lo}, {hi}] but {run.model} has "
                         f"{cfg.num_experts} experts (ids in [0, {cfg.num_experts}))")
    s = t.sort(dim=-1).values
    if bool((s[..., 1:] == s[..., :-1]).any()):
        raise InputError(f"trace {path!r}: a token lists the same expert twice in its top_k; "
                         f"each token's {cfg.top_k} experts must be distinct")


def local_device(a: argparse.Namespace) -> str | None:
    """The ranks' device type when it is known before connecting (None: ask the cluster)."""
    import torch

    if a.device == "cuda" and a.address is None and not torch.cuda.is_available():
        raise InputError("--device cuda, but this machine has no CUDA device "
                         "(torch.cuda.is_available() is False): use --device cpu, or --address "
                         "of a GPU cluster")
    if a.device != "auto":
        return a.device
    if a.address is not None:
        return None
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_runnable(run, device: str) -> None:
    """The comm and experts backends can run on the ranks' device type (checked here when this
    machine can tell: always for cpu, for cuda only on a CUDA machine)."""
    import torch

    if run.cuda_graph and device != "cuda":
        raise InputError(f"--cuda-graph captures CUDA work, but the ranks run on {device}: "
                         f"drop it, or run on a GPU (--device cuda)")
    if device == "cuda" and not torch.cuda.is_available():
        return  # the ranks' machines decide; they fail with the reason (exit 3)
    from epmoe.comm import resolve_backend
    from epmoe.experts.select import resolve_experts

    dev = torch.device(device)
    backend, _ = resolve_backend(run.backend, run, dev)
    experts, _ = resolve_experts(run.experts, run.cfg, run.quant, dev)
    if run.cuda_graph:  # what "auto" picked here must be capturable too
        from epmoe.graph import capture_violation

        why = capture_violation(run.form, backend, experts.name)
        if why:
            raise InputError(f"--cuda-graph: {why}")


def _check_writable_file(path: str | None, flag: str) -> None:
    why = path and file_problem(path)
    if why:
        raise InputError(f"{flag} {why}")


def _check_plot_dir(path: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise InputError("--plot needs matplotlib: pip install matplotlib")
    why = dir_problem(path)
    if why:
        raise InputError(f"--plot {why}")


def _check_fault(world: int) -> None:
    from epmoe.env import fault_spec
    from epmoe.launch.faults import Fault

    f = Fault.parse(fault_spec())
    if f is not None and f.rank >= world:
        raise ValueError(f"EPMOE_FAULT names rank {f.rank}, but the run has {world} rank(s)")


__all__ = ["ClusterAddress", "build_run", "check_launch", "check_runnable", "check_trace",
           "local_device"]
