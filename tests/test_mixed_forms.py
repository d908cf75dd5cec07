"""Stacks whose layers run different parallel forms, against the float64 oracle (2 and 4 ranks).

A stack with any ep_dp layer gives every rank its own `tokens` rows; a replicated layer (tp / ep)
then runs on every rank's rows gathered (an all-gather at the boundary, rank order), and the next
ep_dp layer takes its own slice back. Each layer's output is checked against `reference_moe` on
the layer's whole batch: the concatenation of the ranks' rows (ep_dp) or rank 0's gathered batch
(replicated, which every rank must hold identically).
"""

from __future__ import annotations

import functools

import pytest
import torch

from epmoe.ranks import run_ranks
from epmoe.config import QuantConfig
from epmoe.plan.forms import LayerSpec
from epmoe.plan.run import RunConfig
from epmoe.reference import TOLERANCE, max_rel_err, reference_moe
from epmoe.runtime import Runtime
from epmoe.weights import dequantized_full_layer

TOKENS = 8  # per rank
STACKS = {
    "dp-tp-ep-dp": (LayerSpec("ep_dp", "all2all", "torch"), LayerSpec("tp", "local", "torch"),
                    LayerSpec("ep", "local", "torch"), LayerSpec("ep_dp", "allgather", "torch")),
    "ep-dp-dp-tp": (LayerSpec("ep", "auto", "torch"), LayerSpec("ep_dp", "all2all", "torch"),
                    LayerSpec("ep_dp", "auto", "torch"), LayerSpec("tp", "auto", "torch")),
}


@functools.cache
def cases(world: int) -> dict[str, RunConfig]:
    out = {}
    for recipe in ("bf16", "fp8_block"):
        for name, stack in STACKS.items():
            if recipe != "bf16":  # tp slices of the tiny I=128 would fall below the 128 group
                stack = tuple(LayerSpec("ep", s.backend, s.experts) if s.form == "tp" else s
                              for s in stack)
                name = name.replace("tp", "ep")
            out[f"{name}-{recipe}"] = RunConfig(
                model="deepseek-v3-tiny", quant=QuantConfig(recipe), world=world, tokens=TOKENS,
                layers=len(stack), steps=1, seed=5, stack=stack)
    return out


def _mixed_rank(rank: int, world: int, group, runs: dict[str, RunConfig]) -> dict:
    res = {}
    for name, run in runs.items():
        rt = Runtime(run, rank=rank, group=group, device="cpu")  # gloo ranks: CPU tensors
        rt.step(0)
        res[name] = dict(layers=[(d["x"], d["out"]) for d in rt.last],
                         backends=[b for b, _ in rt.layer_backends],
                         stages=sorted(rt.timer.collect()))
    return res


_RESULTS: dict[int, list] = {}


def results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_mixed_rank, world, cases(world), timeout=150.0)
    return _RESULTS[world]


def _cases():
    return [(w, n) for w in (2, 4) for n in cases(w)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,name", _cases(), ids=[f"w{w}-{n}" for w, n in _cases()])
def test_mixed_stack_matches_oracle(world, name):
    run = cases(world)[name]
    per_rank = [r[name] for r in results(world)]
    cfg, quant = run.cfg, run.quant
    errs = []
    for l, spec in enumerate(run.stack):
        if spec.form == "ep_dp":
            x = torch.cat([r["layers"][l][0] for r in per_rank])
            out = torch.cat([r["layers"][l][1] for r in per_rank])
            assert not torch.equal(per_rank[0]["layers"][l][0], per_rank[1]["layers"][l][0])
        else:  # replicated: every rank holds all ranks' rows and the same output
            x, out = per_rank[0]["layers"][l]
            for r, rr in enumerate(per_rank[1:], 1):
                assert torch.equal(rr["layers"][l][0], x), f"rank {r} saw other rows, layer {l}"
                assert torch.equal(rr["layers"][l][1], out), f"rank {r} differs, layer {l}"
        assert x.shape == (world * TOKENS, cfg.hidden), (l, x.shape)
        ref = reference_moe(x, dequantized_full_layer(cfg, quant, l, run.seed), cfg, quant)
        errs.append(max_rel_err(out, ref))
        assert errs[-1] < TOLERANCE[quant.recipe], (name, world, l, errs[-1])
    # the layer boundaries between forms moved tokens, the others did not
    assert "relayout" in per_rank[0]["stages"]
    backends = per_rank[0]["backends"]
    for spec, b in zip(run.stack, backends):
        assert (b == "local") == (spec.form != "ep_dp"), (spec, b)
    print(f"{name} {world=}: max_rel_err per layer " + ", ".join(f"{e:.1e}" for e in errs))


def test_layer_token_rule_has_one_owner():
    run = cases(4)["dp-tp-ep-dp-bf16"]
    assert run.own_tokens and run.global_tokens == 4 * TOKENS and run.mixed
    assert [run.layer_tokens(l) for l in range(4)] == [TOKENS, 4 * TOKENS, 4 * TOKENS, TOKENS]
    assert [run.token_offset(l, 2) for l in range(4)] == [2 * TOKENS, 0, 0, 2 * TOKENS]
    uniform = RunConfig(form="ep", world=4, tokens=16)
    assert not uniform.own_tokens and uniform.global_tokens == 16 and not uniform.mixed


def test_stack_must_match_the_layer_count_and_eplb_rules():
    stack = STACKS["dp-tp-ep-dp"]
    with pytest.raises(ValueError, match=r"the stack plan has 4 layer entries but the run has 2"):
        RunConfig(world=2, layers=2, stack=stack).validate()
    with pytest.raises(ValueError, match=r"--eplb places experts across EP ranks, but the plan "
                                         r"has tp layers"):
        RunConfig(world=2, layers=4, stack=stack, eplb=True).validate()
    with pytest.raises(ValueError, match=r"form \('dp'\) must be one of"):
        LayerSpec("dp")
