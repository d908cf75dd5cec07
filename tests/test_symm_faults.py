"""symm-ht when a peer fails (CPU loopback world): every spin times out naming rank, peer and
phase, and what a timed-out receive hands the experts and the combine is still a well-formed,
in-bounds layout, so the step runs to its sync point and raises there (a rank whose layout held
stale indices would fault on the device, die, and be blamed for its peer's hang).

The receive's outputs are poisoned before each launch (`poisoned`), so a field the kernel
leaves unwritten after a timeout is seen.
"""

from __future__ import annotations

import pytest
import torch

from epmoe.comm.symm import ht_dispatch
from epmoe.comm.symm.arena import (CTRL_SEQ, CTRL_SEQ_SEND, HT_COMBINE, HT_DISPATCH,
                                   SymmTimeoutError, ctrl_ack)
from epmoe.comm.symm.ht import SymmHighThroughputComm
from epmoe.comm.symm.loopback import loopback_comms
from epmoe.comm.symm.options import SymmOptions
from epmoe.config import QuantConfig
from test_symm_ht import CFG, MAX_T, case_inputs

pytestmark = pytest.mark.interpreter  # the loopback world on CPU tensors

POISON = 0x3EADBEEF
DATA = r"rank 0 timed out on peer 1 in ht-dispatch receive, waiting for the peer's data"


@pytest.fixture
def poisoned(monkeypatch):
    """ht_dispatch.allocate, its outputs filled with POISON (int) and NaN (float)."""
    real = ht_dispatch.allocate

    def allocate(*a, **kw):
        out = real(*a, **kw)
        for t in (out.xo, out.so, out.row_expert, *vars(out.recv).values()):
            t.fill_(float("nan") if t.is_floating_point() else POISON)
        return out

    monkeypatch.setattr(ht_dispatch, "allocate", allocate)


def assert_in_bounds(batch, h, world, num_experts=CFG.num_experts, max_t=MAX_T):
    """Every index the experts and the combine follow is in range and consistent."""
    lay, rec = batch.layout, h.recv
    m, e_l = lay.row_expert_M.numel(), num_experts // world
    n, used = int(rec.info_I[0]), int(rec.info_I[1])
    counts, offs = lay.counts_E, lay.offsets_E1
    assert 0 <= n <= world * max_t and 0 <= used <= m
    assert (counts >= 0).all() and (offs[1:] >= offs[:-1]).all() and int(offs[-1]) == used
    rex = lay.row_expert_M
    assert ((rex >= -1) & (rex < e_l)).all()
    for e in range(e_l):
        rows = (rex == e).nonzero().flatten()
        assert rows.numel() == int(counts[e])
        if rows.numel():
            assert int(rows.min()) >= int(offs[e]) and int(rows.max()) < int(offs[e + 1])
    inv = rec.inv_NK
    assert ((inv >= -1) & (inv < used)).all()
    assert (rex[inv[inv >= 0].long()] >= 0).all()
    assert (rec.w_NK[inv < 0] == 0).all() and not rec.w_NK.isnan().any()
    st = rec.src_tok_N
    assert ((st >= -1) & (st < world * max_t)).all() and (st[n:] == -1).all()
    assert (inv[st == -1] == -1).all()


def _combine_after_timeout(comm, batch, h, gen, lw):
    """The combine of a timed-out dispatch runs (its waits give up at once), writes none of
    its arena's partial rows but this call's own-token slots, and the first timeout is what
    check_errors reports."""
    world = lw.world
    comb = lw.rank(0).words("ht_comb", torch.int16).view(2, world, MAX_T, -1)
    before = comb.clone()
    y = torch.randn(batch.num_rows, CFG.hidden, generator=gen).to(torch.bfloat16)
    out = comm.combine_recv(comm.combine_send(y, h))
    mine = torch.zeros(2, world, dtype=torch.bool)
    mine[1, 0] = True  # epoch 1: buffer 1, rank 0's own tokens
    assert torch.equal(comb[~mine], before[~mine])
    assert out.shape == (h.msg_TW.shape[0], CFG.hidden)
    with pytest.raises(SymmTimeoutError, match=DATA):
        comm.check_errors()


def test_ht_receive_from_a_silent_peer_gives_an_empty_layout_and_names_it(seed, poisoned):
    world, quant = 2, QuantConfig("bf16")
    gen = torch.Generator().manual_seed(seed)
    lw, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T,
                               options=SymmOptions(num_sms=1, timeout_s=0.02))
    xs, ids, ws = case_inputs("uneven", world, gen)
    pending = comms[0].dispatch_send(xs[0], ids[0], ws[0])  # rank 1 never sends
    batch, h = comms[0].dispatch_recv(pending)
    with pytest.raises(SymmTimeoutError, match=DATA):
        comms[0].check_errors()
    assert_in_bounds(batch, h, world)
    assert int(h.recv.info_I[0]) == 0 and (batch.layout.row_expert_M == -1).all()
    _combine_after_timeout(comms[0], batch, h, gen, lw)


def test_ht_send_into_an_unreleased_buffer_times_out(seed):
    """Rank 0 believes 4 calls completed but peer 1 released none of its buffers."""
    world, quant = 2, QuantConfig("bf16")
    gen = torch.Generator().manual_seed(seed)
    lw, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T,
                               options=SymmOptions(num_sms=1, timeout_s=0.02))
    ctrl = lw.rank(0).ctrl()
    ctrl[CTRL_SEQ + HT_DISPATCH] = 4  # both halves counted 4 calls: the next send is epoch 5,
    ctrl[CTRL_SEQ_SEND + HT_DISPATCH] = 4  # it needs ack >= 3 from each peer
    ctrl[ctrl_ack(world) + HT_DISPATCH * world + 0] = 4  # rank 0 released its own
    xs, ids, ws = case_inputs("uneven", world, gen)
    comms[0].dispatch_send(xs[0], ids[0], ws[0])
    with pytest.raises(SymmTimeoutError, match=r"rank 0 timed out on peer 1 in ht-dispatch "
                                               r"send, waiting for the peer to release"):
        comms[0].check_errors()


def test_ht_receive_waits_for_each_chunk_and_drops_the_ones_that_never_land(seed, poisoned):
    """Rank 1's counts and first round of chunks have landed at rank 0, its later rounds not
    (its progress word says 1 round, its whole-send word nothing): rank 0's receive times out
    naming peer 1 instead of placing rows that are not there, places the first chunk, and
    marks the later slots' tokens as not here. 12 tokens, 4-slot chunks, 1 send CTA: 3
    rounds."""
    world, quant = 2, QuantConfig("bf16")
    gen = torch.Generator().manual_seed(seed)
    opts = SymmOptions(num_sms=1, timeout_s=0.02, chunk_rows=4)
    lw, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T, options=opts)
    xs, ids, ws = case_inputs("full", world, gen)
    ids[1][:, 0] = 0  # every token of rank 1 has an expert on rank 0: 12 slots, 3 chunks
    p1 = comms[1].dispatch_send(xs[1], ids[1], ws[1])
    prog = lw.rank(0).words("ht_prog", torch.int64).view(world, -1)
    assert int(prog[1, 0]) == (1 << 32) | 0x7FFFFFFF  # split send: epoch 1, every round
    assert int(prog[1, -1]) == (1 << 32) | 0x7FFFFFFF  # and the whole send landed
    prog[1, 0] = (1 << 32) | 1  # as if only its first round had landed, and not the rest
    prog[1, -1] = 0
    p0 = comms[0].dispatch_send(xs[0], ids[0], ws[0])
    batch, h = comms[0].dispatch_recv(p0)
    with pytest.raises(SymmTimeoutError, match=DATA):
        comms[0].check_errors()
    assert_in_bounds(batch, h, world)
    n = int(h.recv.info_I[0])
    src = h.recv.src_tok_N[:n]
    from_1 = sorted(int(v) - MAX_T for v in src if v >= MAX_T)
    assert from_1 == [0, 1, 2, 3], from_1  # rank 1's first chunk: its tokens 0..3
    assert int((src == -1).sum()) == 8  # its other 8 slots: counted, not here
    own = (src >= 0) & (src < MAX_T)
    assert int(own.sum()) == int((ids[0] // (CFG.num_experts // world) == 0).any(1).sum())
    _combine_after_timeout(comms[0], batch, h, gen, lw)
    del p1


VARYING = ("me", "T", "TS", "limit", "chunks")  # differ between ranks or between calls


def _unspecialized(fn) -> set[str]:
    """Names of fn's arguments Triton does not specialize on (JIT or interpreted kernel)."""
    names = getattr(fn, "kwargs", {}).get("do_not_specialize")
    if names is None:
        names = getattr(fn, "do_not_specialize", ())
    return {fn.arg_names[a] if isinstance(a, int) else a for a in names}


def test_ht_pipelined_combine_names_a_peer_that_never_pushes(seed):
    """Rank 0's one combine kernel (reduce, push, sum) while rank 1 never combines: its sum
    waits for the rows rank 1 owes each of its token blocks, times out naming rank 1 in the
    combine's receive, and still ends the call (the own rows were pushed: the landing
    counters it waited on are zeroed for the next call on that buffer)."""
    world, quant = 2, QuantConfig("bf16")
    gen = torch.Generator().manual_seed(seed)
    lw, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T,
                               options=SymmOptions(num_sms=1, timeout_s=0.02))
    comms[0].options = SymmOptions(num_sms=1, timeout_s=0.02, pipelined=True)
    xs, ids, ws = case_inputs("full", world, gen)  # every token goes to both ranks
    p1 = comms[1].dispatch_send(xs[1], ids[1], ws[1])
    p0 = comms[0].dispatch_send(xs[0], ids[0], ws[0])
    outs = [comms[0].dispatch_recv(p0), comms[1].dispatch_recv(p1)]
    for c in comms:
        c.check_errors()
    y = torch.randn(outs[0][0].num_rows, CFG.hidden, generator=gen).to(torch.bfloat16)
    out = comms[0].combine_recv(comms[0].combine_send(y, outs[0][1]))
    assert out.shape == (MAX_T, CFG.hidden)
    with pytest.raises(SymmTimeoutError, match=r"rank 0 timed out on peer 1 in ht-combine "
                                               r"receive, waiting for the peer's data"):
        comms[0].check_errors()
    assert not lw.rank(0).words("ht_csum").any()
    assert int(lw.rank(0).ctrl()[CTRL_SEQ + HT_COMBINE]) == 1  # the call ended


def test_no_symm_kernel_specializes_on_a_value_that_differs_between_ranks_or_calls():
    """Triton compiles a new variant for an int equal to 1 or a multiple of 16: a rank whose
    `me` or token count picks another variant would compile mid-run while its peers spin (the
    loopback world's rank 1 did, and rank 0's receive timed out on a cold cache)."""
    import importlib
    import pkgutil

    import epmoe.comm.symm as symm

    kernels = []
    for info in pkgutil.iter_modules(symm.__path__):
        mod = importlib.import_module(f"epmoe.comm.symm.{info.name}")
        kernels += [getattr(mod, n) for n in dir(mod) if n.endswith("_kernel")
                    and hasattr(getattr(mod, n), "arg_names")]
    assert len(kernels) >= 9, kernels
    for k in kernels:
        varying = {a for a in k.arg_names if a in VARYING}
        assert varying <= _unspecialized(k), (k.arg_names[:3], varying - _unspecialized(k))


def test_each_ops_first_call_on_gpu_waits_for_peers_still_compiling(monkeypatch, seed):
    """first_timeout_s bounds the spins of each op's first call on an arena (GPU only: the
    interpreter compiles nothing); later calls wait timeout_s."""
    from epmoe.comm.symm import options as options_mod
    from epmoe.comm.symm.arena import ArenaResource

    o = SymmOptions(timeout_s=2.0, first_timeout_s=30.0)
    monkeypatch.setattr(options_mod, "INTERPRET", False)
    assert o.for_call(True).timeout_s == 30.0 and o.for_call(False) is o
    assert SymmOptions(timeout_s=60.0, first_timeout_s=30.0).for_call(True).timeout_s == 60.0
    monkeypatch.setattr(options_mod, "INTERPRET", True)
    assert o.for_call(True) is o
    with pytest.raises(ValueError, match=r"first_timeout_s \(0\) must be > 0"):
        SymmOptions(first_timeout_s=0)
    res = ArenaResource(view=None)
    assert [res.begin(0), res.end(0), res.begin(0), res.end(0), res.begin(1)] == [
        True, True, False, False, True]

    flags = []
    real = SymmOptions.for_call

    def spy(self, first):
        flags.append(first)
        return real(self, first)

    monkeypatch.setattr(SymmOptions, "for_call", spy)
    world, quant = 2, QuantConfig("bf16")
    gen = torch.Generator().manual_seed(seed)
    _, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T)
    from epmoe.comm.symm.loopback import loopback_combine, loopback_dispatch

    for _ in range(2):
        xs, ids, ws = case_inputs("uneven", world, gen)
        outs = loopback_dispatch(comms, xs, ids, ws)
        ys = [torch.zeros(b.num_rows, CFG.hidden, dtype=torch.bfloat16) for b, _ in outs]
        loopback_combine(comms, ys, [h for _, h in outs])
    assert flags == [True] * 8 + [False] * 8  # 2 ranks x (send, receive) x (dispatch, combine)
