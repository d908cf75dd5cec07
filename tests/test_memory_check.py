"""Weights that cannot fit are refused before anything starts (exit 2) or, on a cluster, by
the rank before it builds (named); the launcher's oracle holds one float64 expert at a time."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.launch.cli import main
from epmoe.memory import GiB, check_fits_here, check_rank_fits, rank_weight_bytes
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
