"""Every parallel form x comm backend against the float64 oracle, on 2 and 4 gloo ranks.

One spawned group per world size runs every case (`cases(world)`) through
`Runtime(run, rank, group)` and returns each rank's per-layer (x, out); the parent gathers them
and compares each layer with `reference_moe` on the gathered tokens:

| form  | backends           | tokens                     | models                                |
|-------|--------------------|----------------------------|---------------------------------------|
| ep_dp | allgather, all2all | own per rank (oracle: all) | deepseek-v3-tiny (+2 redundant, w=2), |
|       |                    |                            | gpt-oss-tiny + 2 redundant (w=2)      |
| ep    | local              | replicated                 | deepseek-v3-tiny                      |
| tp    | local              | replicated                 | deepseek-v3-tiny (bf16), mixtral-tiny,|
|       |                    |                            | gpt-oss-tiny (biases: b2 on slice 0)  |

Every recipe x form: bf16 and fp8_block. tp splits the intermediate into world slices, which
must tile the recipe's 128 quant group: mixtral-tiny (I=256) runs fp8_block at tp 2 only, and
tp 4 fp8_block is refused before any worker starts (pinned below).
"""

from __future__ import annotations

import functools

import pytest
import torch

from epmoe.ranks import run_ranks
from epmoe.config import QuantConfig
from epmoe.plan.run import RunConfig
from epmoe.reference import TOLERANCE, max_rel_err, reference_moe
from epmoe.runtime import Runtime
from epmoe.weights import dequantized_full_layer

WORLDS = (2, 4)
TOKENS = 16
LAYERS = 2


@functools.cache
def cases(world: int) -> dict[str, RunConfig]:
    """name -> RunConfig for every (form, backend, model, recipe) that runs at this world."""
    out = {}
    for recipe in ("bf16", "fp8_block"):
        base = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig(recipe), world=world,
                         experts="torch", tokens=TOKENS, layers=LAYERS, steps=1)
        for backend in ("allgather", "all2all"):
            out[f"ep_dp-{backend}-deepseek-v3-tiny-{recipe}"] = base.replace(
                form="ep_dp", backend=backend)
        if world == 2:  # slots != experts: 2 redundant replicas, 9 slots a rank
            for model in ("deepseek-v3-tiny", "gpt-oss-tiny"):  # replicas carry the biases
                out[f"ep_dp-all2all-{model}-redundant2-{recipe}"] = base.replace(
                    model=model, form="ep_dp", backend="all2all", redundant_experts=2)
        out[f"ep-local-deepseek-v3-tiny-{recipe}"] = base.replace(form="ep", backend="local")
        tp = base.replace(form="tp", backend="local")
        for model in ("deepseek-v3-tiny", "mixtral-tiny", "gpt-oss-tiny"):
            run = tp.replace(model=model)
            inter = run.cfg.moe_intermediate // world
            if recipe == "bf16" or inter % 128 == 0:
                out[f"tp-local-{model}-{recipe}"] = run
    return out


def _forms_rank(rank: int, world: int, group, runs: dict[str, RunConfig]) -> dict:
    """Every case on this rank: name -> [(x, out, physical ids) per layer] of step 0."""
    res = {}
    for name, run in runs.items():
        rt = Runtime(run, rank=rank, group=group, device="cpu")  # gloo ranks: CPU tensors
        assert rt.backend == run.backend, (name, rt.backend, rt.backend_reason)
        rt.step(0)
        res[name] = [(d["x"], d["out"], d["phys"]) for d in rt.last]
    return res


_RESULTS: dict[int, list[dict] | Exception] = {}


def results(world: int) -> list[dict]:
    """Each rank's results for every case at this world: one spawned group, cached (a failure
    too, so the other cases of that world fail at once instead of spawning again)."""
    if world not in _RESULTS:
        try:
            _RESULTS[world] = run_ranks(_forms_rank, world, cases(world), timeout=150.0)
        except Exception as e:  # noqa: BLE001  (re-raised by every case of this world)
            _RESULTS[world] = e
    if isinstance(_RESULTS[world], Exception):
        raise _RESULTS[world]
    return _RESULTS[world]


def _all_cases():
    return [(w, name) for w in WORLDS for name in cases(w)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,name", _all_cases(), ids=[f"w{w}-{n}" for w, n in _all_cases()])
def test_form_matches_oracle(world, name):
    run = cases(world)[name]
    per_rank = [r[name] for r in results(world)]
    cfg, quant = run.cfg, run.quant
    tol = TOLERANCE[quant.recipe]
    errs = []
    for l in range(LAYERS):
        if run.form == "ep_dp":  # each rank its own tokens: the oracle runs on all of them
            x = torch.cat([r[l][0] for r in per_rank])
            out = torch.cat([r[l][1] for r in per_rank])
            assert x.shape == (world * TOKENS, cfg.hidden)
            assert not torch.equal(per_rank[0][l][0], per_rank[1][l][0]), "tokens not per rank"
        else:  # replicated tokens: after the all-reduce every rank holds the same output
            x, out = per_rank[0][l][:2]
            for r, rr in enumerate(per_rank[1:], 1):
                assert torch.equal(rr[l][0], x), f"rank {r} saw other input tokens"
                assert torch.equal(rr[l][1], out), f"rank {r} output differs from rank 0"
        assert torch.isfinite(out.float()).all()
        if run.redundant_experts:  # some (token, k) pairs went to a replica slot
            assert any(int(r[l][2].max()) >= cfg.num_experts for r in per_rank)
        ref = reference_moe(x, dequantized_full_layer(cfg, quant, l, run.seed), cfg, quant)
        err = max_rel_err(out, ref)
        errs.append(err)
        assert err < tol, (f"{name=}, {world=}, layer {l}: max_rel_err {err:.2e} >= "
                           f"tolerance {tol:.0e}")
    print(f"{name}, {world=}, tokens/rank={TOKENS}: max_rel_err per layer "
          + ", ".join(f"{e:.2e}" for e in errs))


def test_every_form_and_backend_is_covered():
    for w in WORLDS:
        names = set(cases(w))
        for recipe in ("bf16", "fp8_block"):
            for prefix in ("ep_dp-allgather", "ep_dp-all2all", "ep-local", "tp-local"):
                assert any(n.startswith(prefix) and n.endswith(recipe) for n in names) or (
                    prefix == "tp-local" and w == 4 and recipe == "fp8_block"), (w, prefix,
                                                                                  recipe)


@pytest.mark.parametrize("model,world", [("mixtral-tiny", 4), ("deepseek-v3-tiny", 2)])
def test_tp_fp8_block_refuses_slices_below_the_quant_group(model, world):
    run = RunConfig(model=model, quant=QuantConfig("fp8_block"), form="tp", world=world,
                    backend="local", experts="torch", tokens=16, layers=2, steps=1)
    inter = run.cfg.moe_intermediate // world
    msg = (rf"moe intermediate per partition \({inter}\) must be a multiple of fp8_block's "
           rf"quant group \(128\); lower tp or pick recipe bf16")
    with pytest.raises(ValueError, match=msg):
        run.validate()
    with pytest.raises(ValueError, match=msg):  # also when a worker builds its runtime
        Runtime(run, rank=0, group=None)


def test_tp_world_must_divide_intermediate():
    run = RunConfig(model="mixtral-tiny", form="tp", world=3, backend="local", tokens=16)
    with pytest.raises(ValueError, match=r"moe intermediate \(256\) must be divisible by tp "
                                         r"\(3\)"):
        run.validate()


def test_token_moving_backend_refused_for_replicated_forms():
    run = RunConfig(form="ep", world=2, backend="all2all", tokens=16)
    with pytest.raises(ValueError, match="moves tokens between ranks"):
        Runtime(run, rank=0, group=None)
