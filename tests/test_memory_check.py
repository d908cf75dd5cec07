"""Weights that cannot fit are refused before anything starts (exit 2) or, on a cluster, by
the rank before it builds (named); the launcher's oracle holds one float64 expert at a time."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.launch.cli import main
from epmoe.memory import (GiB, DoesNotFit, check_fits_here, check_rank_fits, rank_activation_bytes,
                          rank_bytes, rank_weight_bytes)
from epmoe.plan.forms import LayerSpec
from epmoe.plan.run import RunConfig
from epmoe.reference import reference_moe
from epmoe.weights import dequantized_full_layer


def _run(**kw):
    base = dict(model="deepseek-v3", quant=QuantConfig("bf16"), world=2, layers=3, tokens=8)
    return RunConfig(**{**base, **kw})


def test_the_weights_per_rank_by_form():
    """ep_dp / ep: the rank's 128 of 256 experts; tp: all 256 at a half intermediate; plus
    the fp32 router and the bf16 shared MLP, per layer."""
    d, i, e = 7168, 2048, 256
    shared = 3 * 2048 * d * 2 + e * d * 4
    ep = rank_weight_bytes(_run())
    assert ep.total == pytest.approx(3 * (e // 2 * 3 * i * d * 2 + shared))
    assert ep.layers == 3 and ep.per_layer_max == pytest.approx(ep.total / 3)
    tp = rank_weight_bytes(_run(form="tp", backend="local"))
    assert tp.total == pytest.approx(ep.total)  # the same bytes, split the other way
    fp8 = rank_weight_bytes(_run(quant=QuantConfig("fp8_block")))
    assert fp8.total < 0.51 * ep.total
    cpu = rank_weight_bytes(_run(), 0, "cpu")  # auto on CPU: the torch experts, + fp32 copy
    assert cpu.torch_copy and cpu.total == pytest.approx(ep.total + 3 * e // 2 * 3 * i * d * 4)
    assert rank_weight_bytes(_run(experts="triton"), 0, "cpu").total == ep.total
    mixed = rank_weight_bytes(_run(stack=(LayerSpec("ep_dp", "all2all"), LayerSpec("tp"),
                                          LayerSpec("ep", "local"))))
    assert mixed.total == pytest.approx(ep.total)


def test_a_steps_activation_floor_by_form():
    """bf16 throughout: the token batch, 3 stream rows and the logits per row a layer holds;
    ep_dp across ranks the rows received (one per token, as sent: fp8 + scales); grouped GEMMs
    GEMM1's 2 x I and GEMM2's D per mean (token, k) pair, per micro-batch; the torch experts
    (auto on CPU) one expert at a time: no pair term."""
    d, i, e, k, t = 7168, 2048, 256, 8, 1000
    stream = (t * d + (3 * d + e) * t) * 2
    pairs = t * k * (2 * i + d) * 2
    assert rank_activation_bytes(_run(tokens=t)) == pytest.approx(stream + t * 2 * d + pairs)
    fp8 = _run(tokens=t, quant=QuantConfig("fp8_block"))
    assert rank_activation_bytes(fp8) == pytest.approx(stream + t * (d + d / 128 * 4) + pairs)
    assert rank_activation_bytes(_run(tokens=t), 0, "cpu") == pytest.approx(stream + t * 2 * d)
    assert rank_activation_bytes(_run(tokens=t, world=1)) == pytest.approx(stream + pairs)
    assert rank_activation_bytes(_run(tokens=t, micro_batches=2)) == pytest.approx(
        stream + (t * 2 * d + pairs) / 2)
    # replicated forms: t is every rank's batch; ep keeps its experts' share of the pairs, tp
    # every pair at half the intermediate
    ep = rank_activation_bytes(_run(tokens=t, form="ep", backend="local"))
    assert ep == pytest.approx(stream + pairs / 2)
    tp = rank_activation_bytes(_run(tokens=t, form="tp", backend="local"))
    assert tp == pytest.approx(stream + t * k * (i + d) * 2)


def test_a_run_whose_step_cannot_fit_exits_2(monkeypatch, capsys):
    """Weights that fit and a step that cannot: refused before any rank starts, naming the
    tokens (not the layers) as what to lower."""
    monkeypatch.setattr("epmoe.memory.mem_available_bytes", lambda: 2 * GiB)
    rc = main(["--ep", "2", "--tokens", "2000000", "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "of a step's activations (2000000 token(s)) x 2 rank(s)" in err, err
    assert "lower --tokens (now 2000000)" in err and "--layers" not in err
    check_fits_here(_run(model="deepseek-v3-tiny", tokens=20000), "cpu")


def test_a_run_that_cannot_fit_this_machine_exits_2(monkeypatch, capsys):
    monkeypatch.setattr("epmoe.memory.mem_available_bytes", lambda: 20 * GiB)
    rc = main(["--model", "deepseek-v3", "--ep", "2", "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "does not fit this machine's memory" in err and "58 layer(s) of deepseek-v3" in err
    assert "with the torch experts' fp32 copy" in err and "lower --layers" in err
    # one layer: 21.1 GiB over the machine's ranks in bf16 (+ 42 in fp32 with the torch
    # experts), whatever their number; fp8 on Triton's kernels fits
    for world in (1, 2, 4):
        for run in (_run(layers=1, world=world), _run(layers=1, world=world, experts="triton"),
                    _run(layers=1, world=world, quant=QuantConfig("fp8_block"))):
            with pytest.raises(ValueError, match="does not fit"):
                check_fits_here(run, "cpu")
        check_fits_here(_run(layers=1, world=world, quant=QuantConfig("fp8_block"),
                             experts="triton"), "cpu")


def test_a_rank_that_cannot_fit_is_named(monkeypatch):
    monkeypatch.setattr("epmoe.memory.mem_available_bytes", lambda: 4 * GiB)
    with pytest.raises(ValueError, match=r"rank 1: 94\.8 GiB of weights per rank .* fp32 "
                                         r"copy, .* do not fit: its host has 4\.0 GiB free"):
        check_rank_fits(_run(), 1, torch.device("cpu"))
    check_rank_fits(_run(model="deepseek-v3-tiny"), 1, torch.device("cpu"))


def test_the_oracle_holds_one_expert_at_a_time(seed):
    """reference_moe goes expert by expert: the launcher's lazy oracle keeps one float64
    expert, and the result equals the full oracle's."""
    from epmoe.launch.oracle import LazyOracleLayer

    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("fp8_block"), tokens=16,
                    seed=seed)
    lazy, held = LazyOracleLayer(run, 0), []
    build = lazy._expert

    def counting(e):
        out = build(e)
        held.append(len(lazy._cache))
        return out

    lazy._expert = counting
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, run.cfg.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(run.cfg.num_experts, generator=g)[:run.cfg.top_k]
                       for _ in range(16)])
    w = torch.rand(16, run.cfg.top_k, generator=g)
    got = reference_moe(x, lazy.as_tuple(), run.cfg, run.quant, ids, w)
    full = reference_moe(x, dequantized_full_layer(run.cfg, run.quant, 0, seed), run.cfg,
                         run.quant, ids, w)
    assert max(held) == 1 and len(set(ids.flatten().tolist())) > 1
    torch.testing.assert_close(got, full, rtol=0, atol=0)


def test_a_rank_killed_by_rays_memory_monitor_is_one_line():
    """Ray's OutOfMemoryError (not an actor-died error) once fell through as "an internal
    error of the launcher" with Ray's page of text; the driver now reports the rank died,
    in one line with the node's memory."""
    from epmoe.launch.blame import oom_detail

    page = ("1 worker(s) were killed due to the node running low on memory. Memory on the "
            "node (IP: 127.0.0.1, ID: 92c1e42e) was 22.74GB used / 23.54GB limit (0.96)\n"
            "OOM kill reason: ...\nObject store memory usage: [- objects spillable: 0\n")
    line = oom_detail(page)
    assert "\n" not in line and line.startswith("its process was killed by Ray's out-of-memory")
    assert "(node 127.0.0.1: 22.74GB used of 23.54GB)" in line
    assert "lower --layers" in oom_detail("no node line")


def test_a_gpu_counts_the_blocks_this_process_holds_free(monkeypatch):
    """The caching allocator's free blocks are this process's to reuse: a calibration that
    built and dropped a layer before keeps them reserved, and the next layer must not be
    refused for them (what the driver calls free is then far below what fits)."""
    import epmoe.memory as mem

    run = _run(layers=1, world=1)  # 21.1 GiB of bf16 weights
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (10 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 50 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 30 * GiB)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert mem.gpu_free_bytes(0) == 30 * GiB
    check_rank_fits(run, 0, torch.device("cuda", 0))
    check_fits_here(run, "cuda")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 45 * GiB)  # in use
    with pytest.raises(ValueError, match=r"rank 0: .* its GPU has 15\.0 GiB free"):
        check_rank_fits(run, 0, torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"does not fit GPU 0: .* 15\.0 GiB free"):
        check_fits_here(run, "cuda")


_PEAK = """
import resource, sys, torch
from epmoe.config import QuantConfig
from epmoe.memory import rank_bytes
from epmoe.plan.run import RunConfig
from epmoe.runtime import Runtime

torch.set_num_threads(1)
run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("bf16"), world=1, tokens=65536,
                layers=2, steps=1, seed=int(sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
Runtime(run, device="cpu").step(0)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(rank_bytes(run, 0, "cpu").total, grew)
"""


def test_the_floor_is_below_what_a_step_holds_on_cpu(seed):
    """A floor: what a fresh process's peak resident memory grows by while it builds a layer
    stack and runs a step (65,536 tokens: 0.16 GB of floor) is at least the estimate."""
    out = subprocess.run([sys.executable, "-c", _PEAK, str(seed)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    floor, grew = map(float, out.stdout.split())
    assert 0.1e9 < floor <= grew, (floor, grew)


@pytest.mark.gpu
@pytest.mark.parametrize("experts,recipe", [("triton", "bf16"), ("triton", "fp8_block")])
def test_the_floor_is_below_what_a_step_allocates_on_a_gpu(experts, recipe, seed):
    """On a GPU, the allocator's peak over building the stack and one step is at least the
    floor (weights + activations)."""
    from epmoe.runtime import Runtime

    run = RunConfig(model="qwen3-30b-a3b", quant=QuantConfig(recipe), world=1, tokens=8192,
                    layers=2, steps=1, experts=experts, seed=seed)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    rt = Runtime(run, device="cuda")
    rt.step(0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    need = rank_bytes(run, 0, "cuda")
    assert need.activations > 0.2 * GiB
    assert need.total <= peak, (need.total / GiB, peak / GiB)
    rt.close()


def test_a_size_the_runtimes_floor_refuses_is_dropped_by_the_calibration(monkeypatch):
    """The Runtime refuses a build whose floor exceeds the GPU's free memory (DoesNotFit)
    before it allocates: the calibration drops that size as it drops one that ran out of
    memory, instead of stopping."""
    from epmoe.bench import calibrate_layer as cl
    from epmoe.bench.calibrate import Clock
    from epmoe.config import get_preset

    class Layer:
        def forward(self, x, routing):
            pass

    built = []

    def build(model, quant, experts, tokens, dev):
        built.append(tokens)
        if tokens > 500:
            raise DoesNotFit("rank 0: ... do not fit: its GPU has 1.0 GiB free")
        if tokens > 300:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return object(), Layer(), experts

    monkeypatch.setattr(cl, "_build", build)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    clock = Clock([], 100.0, "test")
    *_, ns = cl._build_fitting("deepseek-v3-tiny", get_preset("deepseek-v3-tiny"),
                               QuantConfig("bf16"), "triton", [10, 100, 250, 400, 1000],
                               torch.device("cpu"), clock)
    assert built == [1000, 400, 250] and ns == [10, 100, 250]
    assert clock.skipped == [f"triton/bf16 tokens>={n}: out of device memory"
                             for n in (1000, 400)]
    with pytest.raises(DoesNotFit):
        cl._build_fitting("deepseek-v3-tiny", get_preset("deepseek-v3-tiny"),
                          QuantConfig("bf16"), "triton", [1000], torch.device("cpu"), clock)
