"""symm-ht / symm-ll compiled on CUDA: the loopback world of 2, 4 and 8 ranks on one GPU (rank by
rank, and ranks on concurrent streams so the spins really wait), CUDA-graph capture with 1,000
replays on fresh routing, the NVSHMEM arena on one PE, two real ranks sharing one GPU (two
processes, two PEs, time-sliced by the driver: the real-rank path without a second GPU), and
two real ranks on two GPUs (`multigpu`).

The checks are the CPU loopback tests' (tests/test_symm_ht.py, test_symm_ll.py): rows byte for
byte against all2all's payloads, layouts against `make_contiguous_layout`, combines bit for bit
(the combine kernels compile without FMA contraction, so fp32 mul-then-add matches torch).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from epmoe.ranks import run_ranks
from epmoe.comm.context import CommContext
from epmoe.comm.symm.ht import SymmHighThroughputComm
from epmoe.comm.symm.ll import SymmLowLatencyComm
from epmoe.comm.symm.loopback import loopback_combine, loopback_comms, loopback_dispatch
from epmoe.comm.symm.options import SymmOptions
from epmoe.config import QuantConfig
from epmoe.quant import dequantize_act, quantize_act
from test_symm_ht import CFG, MAX_T, case_inputs, on
from test_symm_ht import run_round as ht_round
from test_symm_ll import MODE_IDS, MODES, ll_options
from test_symm_ll import run_round as ll_round

pytestmark = pytest.mark.gpu
OPTS = SymmOptions(num_sms=4, timeout_s=5.0)
CHUNKED = SymmOptions(num_sms=4, timeout_s=5.0, chunk_cols=128)  # D = 256: 2 chunks per row


@pytest.mark.parametrize("streams,pipelined,gather", [
    (False, None, False), (True, None, False), (True, True, False), (False, None, True),
    (True, True, True)])
@pytest.mark.parametrize("world,recipe,fmt,scenario", [
    (2, "bf16", "fp32", "uneven"), (4, "fp8_block", "ue8m0_packed", "full"),
    (2, "fp8_block", "fp32", "empty"), (8, "bf16", "fp32", "uneven"),
    (8, "fp8_block", "fp32", "all_to_one")])
def test_ht_loopback_compiled(world, recipe, fmt, scenario, streams, pipelined, gather, seed):
    """pipelined: each rank's dispatch is one kernel (send and receive roles) on its own
    stream, its receive waiting chunk by chunk on the other ranks' sends as they run.
    gather: ht_gather (the layout's rows read from the arena through rows_M)."""
    quant = QuantConfig(recipe, fmt)
    gen = torch.Generator().manual_seed(seed)
    opts = dataclasses.replace(OPTS if world > 2 else CHUNKED, pipelined=pipelined,
                               chunk_rows=4 if pipelined else 0, ht_gather=gather)
    _, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T, "cuda",
                              options=opts, alignment=8)
    for _ in range(3):
        ht_round(comms, world, quant, *case_inputs(scenario, world, gen), gen, "cuda", streams)
    for c in comms:
        c.check_errors()


@pytest.mark.parametrize("dedup", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("streams", [False, True])
@pytest.mark.parametrize("world,recipe,fmt,scenario", [
    (2, "fp8_block", "fp32", "uneven"), (4, "fp8_block", "ue8m0_fp32", "all_to_one"),
    (2, "bf16", "fp32", "full"), (8, "fp8_block", "fp32", "uneven"), (8, "bf16", "fp32", "full")])
def test_ll_loopback_compiled(world, recipe, fmt, scenario, streams, dedup, seed):
    quant = QuantConfig(recipe, fmt)
    gen = torch.Generator().manual_seed(seed)
    opts = ll_options(OPTS if world > 2 else CHUNKED, dedup)
    lw, comms = loopback_comms(SymmLowLatencyComm, CFG, quant, world, MAX_T, "cuda",
                               options=opts)
    for _ in range(3):
        ll_round(lw, comms, world, quant, *case_inputs(scenario, world, gen), gen, "cuda",
                 streams)


def _scaled_identity(batch, rank, e_l):
    """A capturable stand-in for experts: row of local expert e -> dequant(x) * (global e + 1),
    bf16 (masked [E, C, D] or contiguous [M, D])."""
    x = dequantize_act(batch.copied())
    if x.dim() == 3:
        f = torch.arange(e_l, device=x.device, dtype=torch.float32) + rank * e_l + 1
        return (x * f[:, None, None]).to(torch.bfloat16)
    e = batch.layout.row_expert_M.long()
    return (x * (e + rank * e_l + 1).clamp(min=0)[:, None].float()).to(torch.bfloat16)


def _expected(x, ids, w, quant, world):
    """What combine returns with _scaled_identity experts (ids global, -1 empty), for both
    backends: each rank's fp32 partial over its slots (k order) travels as bf16, then the
    partials are summed in rank order and cast once."""
    e_l = CFG.num_experts // world
    xd = dequantize_act(quantize_act(x, quant)) if x.shape[0] else x.float()
    out = torch.zeros(x.shape[0], x.shape[1], device=x.device)
    for r in range(world):
        part = torch.zeros_like(out)
        for k in range(ids.shape[1]):
            here = (ids[:, k] >= 0) & (ids[:, k] // e_l == r)
            y = (xd * (ids[:, k] + 1).float()[:, None]).to(torch.bfloat16).float()
            part = torch.where(here[:, None], part + w[:, k, None] * y, part)
        sent = ((ids >= 0) & (ids // e_l == r)).any(1)
        out = torch.where(sent[:, None], out + part.to(torch.bfloat16).float(), out)
    return out.to(torch.bfloat16)


def _graph_round(comms, static, e_l, streams=False):
    """-> (eager step, graph, the graph's outputs): dispatch -> _scaled_identity -> combine of
    every loopback rank, captured once after a warm-up (check_errors syncs the host, so the
    captured round uses the halves directly; with `streams`, each rank on its own stream,
    forked from and joined to the capture stream)."""
    def step():
        outs = loopback_dispatch(comms, *static, streams=streams)
        ys = [_scaled_identity(b, r, e_l) for r, (b, _) in enumerate(outs)]
        return loopback_combine(comms, ys, [h for _, h in outs], streams=streams)

    step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        step()  # warm-up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            if streams:
                outs = loopback_dispatch(comms, *static, streams=True)
                ys = [_scaled_identity(b, r, e_l) for r, (b, _) in enumerate(outs)]
                graph_out = loopback_combine(comms, ys, [h for _, h in outs], streams=True)
            else:
                outs = [c.dispatch_send(x, i, w) for c, x, i, w in zip(comms, *static)]
                outs = [c.dispatch_recv(p) for c, p in zip(comms, outs)]
                ys = [_scaled_identity(b, r, e_l) for r, (b, _) in enumerate(outs)]
                sent = [c.combine_send(y, h) for c, y, (_, h) in zip(comms, ys, outs)]
                graph_out = [c.combine_recv(s_) for c, s_ in zip(comms, sent)]
    torch.cuda.current_stream().wait_stream(s)
    return step, g, graph_out


def _refill(static, world, gen):
    """Fresh routing (and tokens) copied into the captured inputs."""
    for dst, src in zip(static, on("cuda", *case_inputs("full", world, gen))):
        for d, s_ in zip(dst, src):
            d.copy_(s_)


@pytest.mark.parametrize("dedup", MODES, ids=MODE_IDS)
def test_ll_cuda_graph_1000_replays_match_eager(dedup, seed):
    """symm-ll of 2 loopback ranks captured once, replayed 1,000 times with fresh routing; each
    replay is bit-compared with an eager round on the same inputs (the device epochs advance
    in both) and every 250th also with the reference sum."""
    world, quant = 2, QuantConfig("fp8_block")
    gen = torch.Generator().manual_seed(seed)
    _, comms = loopback_comms(SymmLowLatencyComm, CFG, quant, world, MAX_T, "cuda",
                              options=ll_options(OPTS, dedup))
    static = on("cuda", *case_inputs("full", world, gen))
    step, g, graph_out = _graph_round(comms, static, CFG.num_experts // world)
    for i in range(1000):
        _refill(static, world, gen)
        g.replay()
        got = [o.clone() for o in graph_out]
        eager = step()
        for r in range(world):
            assert torch.equal(got[r], eager[r]), f"replay {i}, rank {r}"
            if i % 250 == 0:
                want = _expected(static[0][r], static[1][r], static[2][r], quant, world)
                assert torch.equal(got[r], want), f"replay {i}, rank {r}: vs reference"
    for c in comms:
        c.check_errors()


@pytest.mark.parametrize("pipelined,gather", [(None, False), (True, False), (True, True)])
def test_ht_cuda_graph_replays_match_reference(pipelined, gather, seed):
    """200 replays on fresh routing; pipelined: each rank's one dispatch kernel on its own
    stream inside the graph (the progress words' epochs advance on the device); gather: the
    rows read from the arena through rows_M (its -1 fill captured too)."""
    world, quant = 2, QuantConfig("bf16")
    gen = torch.Generator().manual_seed(seed)
    _, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T, "cuda",
                              options=dataclasses.replace(OPTS, pipelined=pipelined,
                                                          chunk_rows=4, ht_gather=gather))
    static = on("cuda", *case_inputs("full", world, gen))
    _, g, graph_out = _graph_round(comms, static, CFG.num_experts // world,
                                   streams=bool(pipelined))
    for i in range(200):
        _refill(static, world, gen)
        g.replay()
        for r in range(world):
            want = _expected(static[0][r], static[1][r], static[2][r], quant, world)
            assert torch.equal(graph_out[r], want), f"replay {i}, rank {r}"
    for c in comms:
        c.check_errors()


@pytest.mark.parametrize("recipe", ["fp8_block", "bf16"])
def test_ht_gathered_batch_through_the_compiled_triton_experts(recipe, seed):
    """The same routing dispatched with rows copied and with ht_gather: Triton's experts (TMA
    kernel; gathered: A by pointer through rows_M) give the same rows bit for bit."""
    from epmoe.experts.triton_experts import TritonExperts
    from epmoe.weights import synthetic_layer

    quant, world = QuantConfig(recipe), 2
    xs, ids, ws = on("cuda", *case_inputs("full", world, torch.Generator().manual_seed(seed)))
    lw = synthetic_layer(CFG, quant, 0, seed, list(range(CFG.num_experts // world)))
    experts = TritonExperts(lw.experts.to("cuda"), CFG, quant)
    got = []
    for gather in (False, True):
        _, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T, "cuda",
                                  options=dataclasses.replace(OPTS, ht_gather=gather),
                                  alignment=experts.alignment)
        batch, _ = loopback_dispatch(comms, xs, ids, ws)[0]
        got.append((batch.layout.row_expert_M, experts.run(batch)))
        comms[0].check_errors()
    (lay_c, y_c), (lay_g, y_g) = got
    used = lay_c >= 0
    assert torch.equal(lay_c, lay_g) and int(used.sum()) > 0
    assert torch.equal(y_c[used], y_g[used])


def _real_ranks(rank, world, group, cls_name, recipe, seed, shared=False, dedup=False):
    """One real rank: NVSHMEM arena through the CommContext, 3 rounds, checked locally (on
    cuda:rank, or cuda:0 when the ranks share one GPU). symm-ht dispatches pipelined (real
    ranks' default) in 4-slot chunks: several rounds of progress words per call."""
    dev = torch.device("cuda", 0 if shared else rank)
    torch.cuda.set_device(dev)
    quant = QuantConfig(recipe)
    cls = {"symm-ht": SymmHighThroughputComm, "symm-ll": SymmLowLatencyComm}[cls_name]
    e_l = CFG.num_experts // world
    ctx = CommContext(group, rank, world, dev, max_tokens_per_rank=MAX_T)
    expert_map = torch.full((CFG.num_experts,), -1, dtype=torch.int32)
    expert_map[rank * e_l:(rank + 1) * e_l] = torch.arange(e_l, dtype=torch.int32)
    opts = ll_options(dataclasses.replace(OPTS, chunk_rows=4), dedup)
    if cls_name == "symm-ht":  # the mode's "gather": ht_gather
        opts = dataclasses.replace(opts, ll_dedup=False, ll_gather=False,
                                   ht_gather=dedup == "gather")
    comm = cls(CFG, quant, expert_map.cuda(), ctx, options=opts)
    gen = torch.Generator().manual_seed(seed)
    try:
        for _ in range(3):
            xs, ids, ws = on(dev, *case_inputs("uneven", world, gen))
            batch, h = comm.dispatch(xs[rank], ids[rank], ws[rank])
            out = comm.combine(_scaled_identity(batch, rank, e_l), h)
            comm.check_errors()
            want = _expected(xs[rank], ids[rank], ws[rank], quant, world)
            assert torch.equal(out, want), f"rank {rank}: combine differs"
        torch.cuda.synchronize()
    finally:
        ctx.close()
    return True


@pytest.mark.parametrize("world", [1])
def test_nvshmem_arena_on_one_pe(world, seed):
    """The real arena (nvshmem4py UID init, symmetric tensor, peer view of itself, free,
    finalize) under symm-ll and symm-ht with one rank."""
    for name, recipe in (("symm-ll", "fp8_block"), ("symm-ht", "bf16")):
        assert run_ranks(_real_ranks, world, name, recipe, seed, timeout=120) == [True]


REAL_CASES = [("symm-ht", "fp8_block", False), ("symm-ll", "fp8_block", False),
              ("symm-ll", "fp8_block", True), ("symm-ll", "fp8_block", "gather"),
              ("symm-ht", "bf16", False), ("symm-ht", "fp8_block", "gather")]  # (.., mode)


@pytest.mark.parametrize("name,recipe,dedup", REAL_CASES)
def test_two_real_ranks_sharing_one_gpu(name, recipe, dedup, seed):
    """Two processes on cuda:0, two NVSHMEM PEs (gloo process group): the UID bootstrap, peer
    views of the other process's heap and the pipelined dispatch's spins on another process,
    with the driver time-slicing the two (a spin runs until its slice ends, then the peer)."""
    assert run_ranks(_real_ranks, 2, name, recipe, seed, True, dedup,
                     timeout=180) == [True, True]


@pytest.mark.multigpu
@pytest.mark.parametrize("name,recipe,dedup", REAL_CASES)
def test_two_real_ranks(name, recipe, dedup, seed):
    assert run_ranks(_real_ranks, 2, name, recipe, seed, False, dedup,
                     timeout=180) == [True, True]
