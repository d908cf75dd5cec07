"""bench.router_tune's candidates, its agreement check and its pick (CPU, the interpreter; the
timings are the GPU's, here a stand-in timer)."""

import pytest
import torch

from epmoe.bench import router_tune as rt
from epmoe.kernels.gate_topk import (FUSED_FROM_TOKENS, TUNED_ROUTER, TUNED_ROUTERS,
                                     RouterConfig, gate_logits, gate_way, router_config)


def test_router_config_caps_tokens_per_program_by_row_width():
    assert router_config(128) == TUNED_ROUTER and router_config(256) == TUNED_ROUTERS[256]
    assert router_config(384).block_m == 16384 // 512  # Kimi-K2: 384 experts in a 512 row
    assert router_config(384).block_k == TUNED_ROUTER.block_k
    for e in (8, 128, 160, 256, 384, 512):
        assert router_config(e).block_m * max(16, 1 << (e - 1).bit_length()) <= 16384


def test_gate_way_fuses_only_small_gates_at_many_tokens():
    """The measured crossover (BENCHMARKS.md 45): split below FUSED_FROM_TOKENS[128] for
    rows of <= 128 experts, fused from there; split always for wider rows."""
    start = FUSED_FROM_TOKENS[128]
    for e in (16, 32, 100, 128):
        assert gate_way(e, start - 1) == "split" and gate_way(e, start) == "fused"
    for e in (129, 256, 384, 512):
        assert gate_way(e, 1) == gate_way(e, 1 << 20) == "split"


def test_gate_logits_are_the_fp32_product_of_the_bf16_values(seed):
    x = torch.randn(37, 200).to(torch.bfloat16)
    gate = torch.randn(24, 200).to(torch.bfloat16)
    got = gate_logits(x, gate)
    want = x.double() @ gate.double().T
    assert got.dtype == torch.float32 and got.shape == (37, 24)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_logits_candidates_are_distinct_powers_of_two_with_the_launch_config():
    got = rt.logits_candidates()
    assert len(got) == len(set(got)) == 16 and rt.LOGITS_ROUTER in got
    assert all(c.block_m & (c.block_m - 1) == 0 and c.num_stages == 1 for c in got)
    assert min(c.block_m for c in got) == 1


@pytest.mark.parametrize("block_e,bms", [(512, {16, 32}), (256, {32, 64}), (128, {64, 128})])
def test_candidates_stay_under_the_register_cap(block_e, bms):
    got = rt.candidates(block_e)
    assert {c.block_m for c in got} == bms
    assert len(got) == len(set(got)) == 2 * 2 * 3 * 2


def test_mismatch_counts_tokens_whose_expert_set_differs():
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 1, 2]])
    same_sets = ids.flip(-1)  # order within a token does not matter
    assert rt.mismatch(same_sets, ids) == 0.0
    one_off = ids.clone()
    one_off[2, 0] = 3
    assert rt.mismatch(one_off, ids) == 0.25


def _tune(monkeypatch, ways=rt.WAYS, launch_way=None):
    """tune_model on the interpreter with a stand-in timer: a config that routes wrongly
    (every token's experts shifted) timed fastest, one token a program next."""
    real = rt.triton_gate_route
    wrong, fast, four = RouterConfig(16, 32, 4, 3), RouterConfig(32, 64, 8, 3), \
        RouterConfig(4, 64, 2, 1)

    def route(x, gate, cfg, bias, config, way):
        ids, w = real(x, gate, cfg, bias, config=config, way=way)
        return ((ids + 1) % cfg.num_experts if config == wrong else ids), w

    monkeypatch.setattr(rt, "triton_gate_route", route)
    if launch_way:
        monkeypatch.setattr(rt, "gate_way", lambda e, t: launch_way)
    us = {wrong: 1.0, fast: 5.0, four: 6.0, rt.LOGITS_ROUTER: 4.0}
    r = rt.tune_model("kimi-k2-tiny", 40, 1, 0.05, device="cpu",
                      timer=lambda fn, iters: us.get(fn.__defaults__[0], 10.0),
                      configs=[wrong, fast], split_configs=[rt.LOGITS_ROUTER, four],
                      ways=ways)
    rows = [(row["way"], RouterConfig(**row["config"])) for row in r["rows"]]
    return r, rows, (wrong, fast, four)


def test_tune_picks_the_fastest_config_that_routes_right(monkeypatch):
    """A config that routes wrongly is not picked however fast it is; the launch's way is
    timed first (40 tokens: the split way at LOGITS_ROUTER), then the other routing-kernel
    configs, then the launch's fused config and the fused candidates, each once; ratios and
    the speedup are to the first."""
    r, rows, (wrong, fast, four) = _tune(monkeypatch)
    cur = router_config(24)
    assert rows == [("split", rt.LOGITS_ROUTER), ("split", four), ("fused", cur),
                    ("fused", wrong), ("fused", fast)]
    assert r["launch_way"] == "split" and r["rows"][0]["current"]
    assert not any(row["current"] for row in r["rows"][1:]) and r["current_us"] == 4.0
    assert r["rows"][3]["mismatch"] == 1.0  # every token's experts shifted
    assert all(r["rows"][i]["mismatch"] <= 0.05 for i in (0, 1, 2, 4))
    best = (r["best"]["way"], RouterConfig(**r["best"]["config"]))
    assert best == ("split", rt.LOGITS_ROUTER) and r["speedup"] == 1.0
    assert r["kernel_us"] == 4.0  # the routing kernel alone, at the split way's config


def test_tune_times_the_launch_way_first_even_when_its_candidates_are_not_asked_for(
        monkeypatch):
    r, rows, (_, _, four) = _tune(monkeypatch, ways=("split",), launch_way="fused")
    cur = router_config(24)
    assert rows == [("fused", cur), ("split", rt.LOGITS_ROUTER), ("split", four)]
    assert r["rows"][0]["current"] and r["current_us"] == 10.0
    assert RouterConfig(**r["best"]["config"]) == rt.LOGITS_ROUTER and r["speedup"] == 2.5


def test_ways_are_checked_on_the_command_line():
    assert rt.parser().parse_args(["--ways", "split"]).ways == ("split",)
    assert rt.parser().parse_args([]).ways == rt.WAYS
    with pytest.raises(SystemExit):
        rt.parser().parse_args(["--ways", "fast"])
