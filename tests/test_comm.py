"""The comm contract on real gloo ranks: dispatch, an identity "expert", combine.

The identity expert returns, per received row, dequant(x) * sum of its local top-k weights, so
combine must give back sum_k w_k * dequant(x) for each own token (the weights of -1 slots
excluded), in bf16 (reduced in fp32, cast once). Every rank rebuilds every rank's inputs from
the case seed, so it also knows exactly which rows it must receive, and checks them byte for
byte.

Legend: T own tokens, N received rows, K top-k, D hidden, E physical expert slots.
"""

from __future__ import annotations

import time

import pytest
import torch

from epmoe.ranks import RankError, RankTimeout, run_ranks
from epmoe.comm import CommContext, make_comm, resolve_backend
from epmoe.comm.base import TokenBatch
from epmoe.comm.wire import all_gather_rows, all_to_all_rows, as_wire, from_wire
from epmoe.config import QuantConfig, get_preset
from epmoe.plan.forms import LayerPlan
from epmoe.plan.run import RunConfig
from epmoe.quant import FP8_DTYPE, dequantize_act, quantize_act

CFG = get_preset("deepseek-v3-tiny")  # E=16, K=4, D=256
QUANTS = (QuantConfig("bf16"), QuantConfig("fp8_block"), QuantConfig("fp8_block", "ue8m0_packed"),
          QuantConfig("mxfp8"), QuantConfig("w4a8_mxfp4"))
SCENARIOS = ("uneven", "zero_tokens", "one_owner", "empty_slots", "all_empty", "no_tokens")
BACKENDS = ("allgather", "all2all")
# combine casts to bf16 once (2^-9 relative); all2all also sends its partial sums in bf16 (as
# DeepEP): one more rounding per partial
COMBINE_TOL = {"allgather": 4e-3, "all2all": 8e-3}


# --------------------------------------------------------------------------------------------
# inputs every rank can rebuild

def case_inputs(scenario: str, src: int, world: int, seed: int = 0):
    """Rank src's (x_TD bf16, topk_ids_TK int32, topk_weights_TK fp32) for a scenario.

    uneven       3 + 5*src tokens, K distinct random experts each
    zero_tokens  rank 1 holds no tokens, the others 6
    one_owner    every expert of every token lives on the last rank (the others receive none)
    empty_slots  ~40% of the slots are -1, and token 0 has no expert at all
    all_empty    every slot of every token is -1 (nothing travels)
    no_tokens    no rank holds a token
    """
    g = torch.Generator().manual_seed(seed * 1009 + SCENARIOS.index(scenario) * 101 + src)
    e, k = CFG.num_experts, CFG.top_k
    t = {"uneven": 3 + 5 * src, "zero_tokens": 0 if src == 1 else 6, "no_tokens": 0}.get(
        scenario, 7)
    x = (torch.randn(t, CFG.hidden, generator=g) * 3).to(torch.bfloat16)
    per = e // world
    first, span = ((world - 1) * per, per) if scenario == "one_owner" else (0, e)
    ids = torch.zeros(t, k, dtype=torch.int32)
    for n in range(t):
        ids[n] = first + torch.randperm(span, generator=g)[:k]
    if scenario == "empty_slots":
        ids[torch.rand(t, k, generator=g) < 0.4] = -1
        ids[0] = -1
    if scenario == "all_empty":
        ids[:] = -1
    w = torch.rand(t, k, generator=g) + 0.1
    return x, ids, w


def identity_experts(batch: TokenBatch, num_local_experts: int) -> torch.Tensor:
    """fp32 [N, D]: dequant(x[n]) * sum of w[n, k] over the slots on this rank."""
    assert isinstance(batch, TokenBatch), type(batch)
    ids = batch.topk_ids_NK
    assert ids.shape == batch.topk_weights_NK.shape == (batch.x.data.shape[0], CFG.top_k)
    if ids.numel():
        assert int(ids.min()) >= -1 and int(ids.max()) < num_local_experts, ids
    wsum = (batch.topk_weights_NK.float() * (ids >= 0)).sum(1)
    return dequantize_act(batch.x) * wsum[:, None]


def expected_out(x, ids, w, quant) -> torch.Tensor:
    return dequantize_act(quantize_act(x, quant)) * (w * (ids >= 0)).sum(1)[:, None]


def u8(t: torch.Tensor) -> torch.Tensor:
    return as_wire(t).contiguous().view(torch.uint8)


def check_received(backend, batch, rank, world, quant, inputs, expert_map_E):
    """The rows this rank must receive, byte for byte, with their local routing."""
    if backend == "allgather":  # every rank's rows, padded to the largest count
        tmax = max(x.shape[0] for x, _, _ in inputs)
        assert batch.x.data.shape[0] == world * tmax
        rows = [(src, torch.arange(x.shape[0]), src * tmax) for src, (x, _, _) in
                enumerate(inputs)]
        pad_ids = batch.topk_ids_NK.reshape(world, tmax, CFG.top_k)
        for src, (x, _, _) in enumerate(inputs):
            assert (pad_ids[src, x.shape[0]:] == -1).all(), "padding rows must route nowhere"
    else:  # the tokens with at least one expert here, by source rank then token order
        rows, start = [], 0
        for src, (_, ids, _) in enumerate(inputs):
            here = (expert_map_E[ids.long().clamp(min=0)] >= 0) & (ids >= 0)
            sel = here.any(1).nonzero().flatten()
            rows.append((src, sel, start))
            start += sel.numel()
        assert batch.x.data.shape[0] == start, (batch.x.data.shape, start)
    for src, sel, start in rows:
        x, ids, w = inputs[src]
        n = sel.numel()
        want = quantize_act(x, quant).index_select(sel)
        got = batch.x.index_select(torch.arange(start, start + n))
        assert torch.equal(u8(got.data), u8(want.data)), f"payload from rank {src} changed"
        torch.testing.assert_close(dequantize_act(got), dequantize_act(want), rtol=0, atol=0)
        local = expert_map_E[ids[sel].long().clamp(min=0)]
        local = torch.where(ids[sel] >= 0, local, -1)
        assert torch.equal(batch.topk_ids_NK[start:start + n].long(), local.long())
        assert torch.equal(batch.topk_weights_NK[start:start + n].float(), w[sel].float())


def _contract_rank(rank: int, world: int, group) -> list[tuple]:
    """Every backend x recipe x scenario on this rank; -> [(backend, recipe, scenario, N, err)]."""
    plan = LayerPlan("ep_dp", rank, world, "all2all")
    emap = plan.expert_map(CFG)
    report = []
    for backend in BACKENDS:
        for quant in QUANTS:
            for scenario in SCENARIOS:
                what = f"{backend=}, {quant=}, {scenario=}, {rank=}, {world=}"
                inputs = [case_inputs(scenario, src, world) for src in range(world)]
                x, ids, w = inputs[rank]
                comm = make_comm(backend, CFG, quant, emap, CommContext(group, rank, world))
                batch, handle = comm.dispatch(x, ids, w)
                try:
                    check_received(backend, batch, rank, world, quant, inputs, emap)
                except AssertionError as e:
                    raise AssertionError(f"{what}: {e}") from e
                y = identity_experts(batch, comm.num_local_experts)
                out = comm.combine(y, handle)
                want = expected_out(x, ids, w, quant)
                assert out.dtype == torch.bfloat16 and out.shape == want.shape, (what, out.shape)
                err = ((out.float() - want).abs().max()
                       / want.abs().max().clamp(min=1e-30)).item() \
                    if want.numel() else 0.0
                assert err <= COMBINE_TOL[backend], f"{what}: combine error {err:.2e}"
                report.append((backend, quant.recipe + "/" + quant.scale_fmt, scenario,
                               batch.x.data.shape[0], err))
    report.append(("wire", *_wire_checks(rank, world, group)))
    return report


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def rolled(p: torch.Tensor, shift: int) -> torch.Tensor:
    """p with its rows rolled by shift (through an integer view: fp8 cannot roll)."""
    return torch.roll(p.view(_INT_VIEW[p.element_size()]), shift, 0).view(p.dtype)


def _wire_checks(rank: int, world: int, group):
    """Every bit pattern of fp8 e4m3, e8m0, bf16 and fp32 payloads (NaN payloads, -0, inf,
    subnormals; 1-D, 2-D and 3-D rows) through gloo, both ops, uneven all_to_all splits."""
    pats = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    f32 = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, -3.5, 2.0 ** 100])
    payloads = {
        "float8_e4m3fn": pats.view(FP8_DTYPE).reshape(16, 16),
        "float8_e8m0fnu": pats.view(torch.float8_e8m0fnu).reshape(16, 16),
        "bfloat16": torch.arange(-32768, 32768, 97, dtype=torch.int32).to(torch.int16)
        .view(torch.bfloat16)[:672].reshape(-1, 4, 8),
        "float32": f32.repeat(4).reshape(8, 3),
        "float32-1d": torch.cat([f32, -f32]),
    }
    for name, p in payloads.items():
        mine = rolled(p, rank)  # different rows on each rank
        assert torch.equal(u8(from_wire(as_wire(mine), p.dtype)), u8(mine)), name
        assert not as_wire(mine).is_floating_point(), name
        got = all_gather_rows(mine, world, group)
        assert got.dtype == p.dtype and got.shape == (world * p.shape[0], *p.shape[1:]), name
        for src in range(world):
            want = rolled(p, src)
            assert torch.equal(u8(got[src * p.shape[0]:(src + 1) * p.shape[0]]), u8(want)), name
        # uneven all_to_all: rank r sends (r + dst) % 3 rows to dst
        send = [(rank + dst) % 3 for dst in range(world)]
        recv = [(src + rank) % 3 for src in range(world)]
        got = all_to_all_rows(torch.cat([mine[:n] for n in send]), send, recv, group)
        want = torch.cat([rolled(p, src)[:n] for src, n in enumerate(recv)])
        assert got.dtype == p.dtype and got.shape == want.shape, (name, got.shape, want.shape)
        assert torch.equal(u8(got), u8(want)), name
    return tuple(payloads)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_contract(world):
    report = run_ranks(_contract_rank, world, timeout=180.0)
    for rank, rows in enumerate(report):
        for backend, recipe, scenario, n, err in rows[:-1]:
            print(f"{world=} {rank=} {backend=} {recipe=} {scenario=} received={n} "
                  f"err={err:.1e}")
        assert rows[-1][0] == "wire"
    # the scenarios did what they say: all2all ranks other than the owner receive nothing
    received = {rank: n for rank, rows in enumerate(report) for b, _, sc, n, _ in rows[:-1]
                if b == "all2all" and sc == "one_owner"}
    assert all(received[r] == 0 for r in range(world - 1)) and received[world - 1] > 0


# --------------------------------------------------------------------------------------------
# single process: the local backend, id mapping, the backend choice

@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: f"{q.recipe}-{q.scale_fmt}")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_local_comm_contract(quant, scenario):
    x, ids, w = case_inputs(scenario, 0, 1)
    plan = LayerPlan("ep", 0, 1)
    comm = make_comm("local", CFG, quant, plan.expert_map(CFG))
    batch, handle = comm.dispatch(x, ids, w)
    assert torch.equal(batch.topk_ids_NK.long(), ids.long())
    out = comm.combine(identity_experts(batch, comm.num_local_experts), handle)
    want = expected_out(x, ids, w, quant).to(torch.bfloat16)  # same fp32 values, one cast
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_local_comm_maps_ids_of_a_partial_expert_map():
    plan = LayerPlan("ep", 1, 4)  # slots 4..7 local as 0..3
    comm = make_comm("local", CFG, QuantConfig(), plan.expert_map(CFG),
                     CommContext(rank=1, world=4))
    ids = torch.tensor([[0, 4, 7, -1], [5, 6, 15, 3]], dtype=torch.int32)
    got = comm.to_local(ids)
    assert got.dtype == ids.dtype
    assert got.tolist() == [[-1, 0, 3, -1], [1, 2, -1, -1]]


def test_all2all_refuses_slots_not_divisible_by_world():
    emap = torch.full((15,), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"physical experts \(15\) must be divisible by ep \(4\)"):
        make_comm("all2all", CFG, QuantConfig(), emap, CommContext(rank=0, world=4))


def test_resolve_backend_moves_tokens_only_under_ep_dp():
    cpu = torch.device("cpu")
    run = RunConfig(form="ep_dp", world=2, tokens=16)
    assert resolve_backend("auto", run, cpu)[0] == "all2all"
    assert resolve_backend("allgather", run, cpu)[0] == "allgather"
    for form in ("ep", "tp"):
        assert resolve_backend("auto", run.replace(form=form), cpu)[0] == "local"
        with pytest.raises(ValueError, match=f"form '{form}' at world 2 replicates them"):
            resolve_backend("allgather", run.replace(form=form), cpu)


# --------------------------------------------------------------------------------------------
# never hang: a mismatched collective errors out; the helper reports ranks and kills

def _mismatched_rank(rank: int, world: int, group):
    """Rank 0 dispatches; rank 1 never joins (it waits past the group timeout)."""
    if rank == 1:
        time.sleep(6.0)
        return None
    x, ids, w = case_inputs("uneven", 0, world)
    comm = make_comm("all2all", CFG, QuantConfig("fp8_block"),
                     LayerPlan("ep_dp", rank, world, "all2all").expert_map(CFG),
                     CommContext(group, rank, world))
    t0 = time.monotonic()
    try:
        comm.dispatch(x, ids, w)
    except RuntimeError as e:
        return time.monotonic() - t0, f"{type(e).__name__}: {e}"
    return time.monotonic() - t0, None


@pytest.mark.timeout(120)
def test_mismatched_collective_times_out_instead_of_hanging():
    waited, err = run_ranks(_mismatched_rank, 2, timeout=60.0, pg_timeout=2.0)[0]
    assert err is not None, "dispatch returned although rank 1 never joined"
    print(f"rank 0 gave up after {waited:.1f} s: {err[:200]}")
    assert waited < 6.0, f"the collective gave up after {waited:.1f} s, not the 2 s timeout"
    assert "timed out" in err.lower() or "timeout" in err.lower(), err


def _raises_on_rank_1(rank: int, world: int, group):
    if rank == 1:
        raise ValueError("boom from the rank function")
    return rank


def _sleeps(rank: int, world: int, group):
    time.sleep(120)


@pytest.mark.timeout(120)
def test_run_ranks_surfaces_errors_and_kills_hung_ranks():
    with pytest.raises(RankError, match=r"(?s)rank\(s\) \[1\].*rank 1.*ValueError: boom") as ei:
        run_ranks(_raises_on_rank_1, 2, timeout=60.0)
    assert list(ei.value.failures) == [1]
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match=r"rank\(s\) \[0\] did not finish within 4 s"):
        run_ranks(_sleeps, 1, timeout=4.0)
    assert time.monotonic() - t0 < 15
