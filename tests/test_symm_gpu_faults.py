"""The symm spins on CUDA when they time out: every thread of a CTA leaves a timed-out spin
together, and the calls after a timeout still run in bounds and name the first timeout.

Why: a spin decided its timeout on each thread's own %globaltimer reading, so at the bound
some warps of a CTA left the loop while others polled once more; the barriers of the scalar
atomics (one thread's result broadcast through shared memory) then paired up wrongly and
threads went on with other threads' values. On a lent H200 the dispatch receive after a
timed-out combine read garbage counts and wrote ~4 GB below its output (compute-sanitizer):
a device fault that kills the rank and is blamed on it, not on the peer that hung.
`sync.wait_geq` now decides the timeout for the whole CTA. On the tree before that, the
kernel test below faulted (an illegal memory access); the loopback test is the end-to-end
check (it reproduces the fault only now and then: the split needs a timer tick between two
warps' readings).
"""

from __future__ import annotations

import pytest
import torch

import triton
import triton.language as tl

from epmoe.bench.comm_ranks import identity_experts
from epmoe.comm.symm.arena import CTRL_ERR, SymmTimeoutError
from epmoe.comm.symm.ht import SymmHighThroughputComm
from epmoe.comm.symm.ll import SymmLowLatencyComm
from epmoe.comm.symm.loopback import loopback_comms
from epmoe.comm.symm.options import SymmOptions
from epmoe.comm.symm.sync import wait_geq
from epmoe.config import MoEConfig, QuantConfig
from test_symm_faults import assert_in_bounds

pytestmark = pytest.mark.gpu
V3 = MoEConfig("v3-moe", hidden=7168, moe_intermediate=2048, num_experts=256, top_k=8)
TOKENS = 128


@triton.jit
def _spin_then_broadcast(ctrl_ptr, flag_ptr, ctr_ptr, out_ptr, limit, NT: tl.constexpr):
    """Wait for a flag that never comes (a timeout), then one scalar atomic; every thread
    stores what it holds of both (NT = the CTA's threads: one element each)."""
    pid = tl.program_id(0)
    ok = wait_geq(flag_ptr, 1, ctrl_ptr, 1, 0, limit, True)
    r = tl.atomic_add(ctr_ptr + pid, 1, sem="relaxed", scope="gpu")
    lanes = tl.arange(0, NT)
    row = out_ptr + pid * 2 * NT
    tl.store(row + lanes, tl.zeros((NT,), dtype=tl.int32) + ok)
    tl.store(row + NT + lanes, tl.zeros((NT,), dtype=tl.int32) + r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_thread_of_a_cta_leaves_a_timed_out_spin_with_the_same_values():
    warps, ctas, launches = 16, 4 * torch.cuda.get_device_properties(0).multi_processor_count, 20
    nt = 32 * warps
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(launches):
        ctrl = torch.zeros(64, dtype=torch.int32, device="cuda")  # error record clear
        ctr = torch.zeros(ctas, dtype=torch.int32, device="cuda")
        out = torch.full((ctas, 2, nt), -7, dtype=torch.int32, device="cuda")
        _spin_then_broadcast[(ctas,)](ctrl, flag, ctr, out, 20_000, NT=nt, num_warps=warps)
        torch.cuda.synchronize()
        assert int(ctrl[CTRL_ERR]) == 1  # the timeout was recorded
        ok, r = out[:, 0], out[:, 1]
        split = int((ok != ok[:, :1]).any(1).sum()), int((r != r[:, :1]).any(1).sum())
        assert split == (0, 0), f"CTAs whose threads disagree (ok, atomic): {split}"
        assert bool((ok == 0).all()) and bool((r == 0).all()) and bool((ctr == 1).all())


def _routing(gen, world):
    ids = [torch.stack([torch.randperm(V3.num_experts, generator=gen)[:V3.top_k]
                        for _ in range(TOKENS)]).to(torch.int32) for _ in range(world)]
    ws = [torch.rand(TOKENS, V3.top_k, generator=gen) for _ in range(world)]
    return [i.cuda() for i in ids], [w.cuda() for w in ws]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cls,recipe", [(SymmHighThroughputComm, "bf16"),
                                        (SymmHighThroughputComm, "fp8_block"),
                                        (SymmLowLatencyComm, "fp8_block")])
def test_calls_after_a_timeout_stay_in_bounds_and_name_the_first(cls, recipe, seed):
    world = 2
    gen = torch.Generator().manual_seed(seed)
    opts = SymmOptions(timeout_s=0.3, first_timeout_s=60.0)
    _, comms = loopback_comms(cls, V3, QuantConfig(recipe), world, TOKENS, "cuda",
                              options=opts)
    xs = [torch.randn(TOKENS, V3.hidden, generator=gen).bfloat16().cuda() for _ in comms]
    for call in range(4):
        ids, ws = _routing(gen, world)
        pend = [c.dispatch_send(x, i, w) for c, x, i, w in zip(comms, xs, ids, ws)]
        outs = [c.dispatch_recv(p) for c, p in zip(comms, pend)]
        torch.cuda.synchronize()  # a device fault raises here
        if cls is SymmHighThroughputComm:
            for b, h in outs:
                assert_in_bounds(b, h, world, V3.num_experts, TOKENS)
        ys = [identity_experts(b) for b, _ in outs]
        if call == 1:  # rank 0 waits for rank 1's rows, queued behind it: a timeout
            for c, y, (_, h) in zip(comms, ys, outs):
                c.combine_recv(c.combine_send(y, h))
        else:
            sent = [c.combine_send(y, h) for c, y, (_, h) in zip(comms, ys, outs)]
            for c, s in zip(comms, sent):
                c.combine_recv(s)
        torch.cuda.synchronize()
        if call == 0:
            for c in comms:
                c.check_errors()
    op = "ht" if cls is SymmHighThroughputComm else "ll"
    with pytest.raises(SymmTimeoutError, match=f"rank 0 timed out on peer 1 in {op}-combine "
                                               f"receive"):
        comms[0].check_errors()
    # rank 0 stops publishing after its timeout, so rank 1 times out on it in turn
    with pytest.raises(SymmTimeoutError, match="rank 1 timed out on peer 0"):
        comms[1].check_errors()
