"""symm-ht in the CPU loopback world (Triton interpreter): W ranks' arenas in one process, the
same kernels as on GPUs, run rank by rank.

Every case is checked against what all2all delivers for the same inputs (computed here in plain
torch): the received rows byte for byte, in the contiguous layout that `make_contiguous_layout`
builds from all2all's received ids, and the combine bit for bit against all2all's numerics (the
experts' fp32 weighted sum per received token in k order, bf16 on the wire, an fp32 sum over
ranks in rank order, one cast). Outputs are fresh random values each run; receive buffers hold
the previous call's data (poison for a stale read).

Legend: T own tokens, N received tokens, K top-k, D hidden, E physical experts, M layout rows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from epmoe.comm.symm.arena import (CTRL_CDONE_SUM, CTRL_ROLE, CTRL_SEQ_SEND, HT_COMBINE,
                                   HT_DISPATCH, SymmTimeoutError)
from epmoe.comm.symm.ht import SymmHighThroughputComm
from epmoe.comm.symm.loopback import loopback_combine, loopback_comms, loopback_dispatch
from epmoe.comm.symm.options import SymmOptions
from epmoe.config import QuantConfig, get_preset
from epmoe.layout import make_contiguous_layout, permute_rows
from epmoe.quant import quantize_act
from epmoe.comm.wire import wire_quant

pytestmark = pytest.mark.interpreter  # the loopback world on CPU tensors

CFG = get_preset("deepseek-v3-tiny")  # E=16, K=4, D=256
OPTS = SymmOptions(num_sms=1, timeout_s=1.0)
MAX_T = 12


def case_inputs(scenario: str, world: int, gen: torch.Generator, max_t: int = MAX_T):
    """Per rank (x_TD bf16, topk_ids_TK int32, topk_weights_TK fp32).

    uneven      3 + 3r tokens (capped at max_t), K distinct random experts each
    empty       rank 1 holds no token, ~40% empty slots, token 0 of rank 0 has no expert
    all_to_one  every expert of every token lives on the last rank
    full        max_t tokens everywhere (the arena's worst case)
    """
    e, k = CFG.num_experts, CFG.top_k
    per = e // world
    xs, ids, ws = [], [], []
    for r in range(world):
        t = {"uneven": min(max_t, 3 + 3 * r), "empty": 0 if r == 1 else 7}.get(scenario, max_t)
        first, span = ((world - 1) * per, per) if scenario == "all_to_one" else (0, e)
        kk = min(k, span)
        i = torch.full((t, k), -1, dtype=torch.int32)
        for n in range(t):
            i[n, :kk] = first + torch.randperm(span, generator=gen)[:kk]
        if scenario == "empty":
            i[torch.rand(t, k, generator=gen) < 0.4] = -1
            if t:
                i[0] = -1
        xs.append((torch.randn(t, CFG.hidden, generator=gen) * 2).to(torch.bfloat16))
        ids.append(i)
        ws.append(torch.rand(t, k, generator=gen) + 0.1)
    return xs, ids, ws


def a2a_received(r, world, quant, xs, ids, ws):
    """What all2all delivers to rank r: tokens with an expert here, in (source, token) order.
    -> (x rows QTensor-like (data u8, scale), local ids [N, K], weights [N, K], [(src, t)])."""
    e_l = CFG.num_experts // world
    wq = wire_quant(quant)
    data, scale, lid, lw, src = [], [], [], [], []
    for s in range(world):
        if not xs[s].shape[0]:
            continue
        q = quantize_act(xs[s], wq)
        for t in range(xs[s].shape[0]):
            here = (ids[s][t] >= 0) & (ids[s][t] // e_l == r)
            if here.any():
                data.append(q.data[t].view(torch.uint8))
                scale.append(None if q.scale is None else q.scale[t])
                lid.append(torch.where(here, ids[s][t] - r * e_l, -1))
                lw.append(torch.where(here, ws[s][t], 0.0))
                src.append((s, t))
    k = CFG.top_k
    if not src:
        return None, torch.zeros(0, k, dtype=torch.int32), torch.zeros(0, k), src
    sc = None if scale[0] is None else torch.stack(scale)
    return (torch.stack(data), sc), torch.stack(lid).int(), torch.stack(lw), src


def check_received(comms, outs, world, quant, xs, ids, ws):
    for r in range(world):
        batch, h = outs[r]
        lay = batch.layout
        rows, lid, lw, src = a2a_received(r, world, quant, xs, ids, ws)
        n = len(src)
        ref = make_contiguous_layout(lid, CFG.num_experts // world, comms[r].alignment,
                                     num_rows=lay.num_rows)
        assert int(h.recv.info_I[0]) == n, f"rank {r}: {int(h.recv.info_I[0])} tokens, want {n}"
        assert torch.equal(lay.counts_E, ref.counts_E)
        assert torch.equal(lay.offsets_E1, ref.offsets_E1)
        assert torch.equal(lay.row_expert_M, ref.row_expert_M)
        assert torch.equal(lay.inv_perm_NK[:n], ref.inv_perm_NK)
        assert (lay.inv_perm_NK[n:] == -1).all()
        assert torch.equal(h.recv.w_NK[:n], lw)
        got = [(int(v) // MAX_T, int(v) % MAX_T) for v in h.recv.src_tok_N[:n]]
        assert got == src
        if n:
            used = ref.row_expert_M >= 0
            x = batch.copied()  # ht_gather: through rows_M
            want = permute_rows(rows[0], ref)
            assert torch.equal(x.data.view(torch.uint8)[used], want[used])
            if rows[1] is not None:
                assert torch.equal(x.scale[used], permute_rows(rows[1], ref)[used])
        if batch.rows_M is not None:  # gathered: rows in use point at a row, padding nowhere
            assert torch.equal(batch.rows_M >= 0, lay.row_expert_M >= 0)


def a2a_combine(world, outs, ys, num_tokens):
    """all2all's numerics on the same expert rows: per received token the fp32 sum over its
    local slots in k order, cast to bf16 (the wire), then per own token the fp32 sum over the
    ranks it went to, in rank order, one cast."""
    d = CFG.hidden
    back = [torch.zeros(t, world, d) for t in num_tokens]
    sent = [torch.zeros(t, world, dtype=torch.bool) for t in num_tokens]
    for r in range(world):
        h = outs[r][1]
        for n in range(int(h.recv.info_I[0])):
            s, t = divmod(int(h.recv.src_tok_N[n]), MAX_T)
            acc = torch.zeros(d)
            for k in range(CFG.top_k):
                row = int(h.recv.inv_NK[n, k])
                if row >= 0:
                    acc = acc + h.recv.w_NK[n, k] * ys[r][row].float()
            back[s][t, r] = acc.to(torch.bfloat16).float()
            sent[s][t, r] = True
    res = []
    for s, t in enumerate(num_tokens):
        acc = torch.zeros(t, d)
        for r in range(world):
            acc = torch.where(sent[s][:, r, None], acc + back[s][:, r], acc)
        res.append(acc.to(torch.bfloat16))
    return res


def to_cpu(obj):
    """Tensors of (nested) dataclasses, tuples and lists, on the CPU (GPU runs are checked by
    the same code)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(o) for o in obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: to_cpu(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj)})
    return obj


def on(device, *per_rank):
    return [[t.to(device) for t in ts] for ts in per_rank]


def run_round(comms, world, quant, xs, ids, ws, gen, device="cpu", streams=False):
    outs = loopback_dispatch(comms, *on(device, xs, ids, ws), streams=streams)
    host = to_cpu(outs)
    check_received(comms, host, world, quant, xs, ids, ws)
    ys = [torch.randn(o[0].num_rows, CFG.hidden, generator=gen).to(torch.bfloat16)
          for o in host]
    res = loopback_combine(comms, *on(device, ys), [o[1] for o in outs], streams=streams)
    want = a2a_combine(world, host, ys, [x.shape[0] for x in xs])
    for r in range(world):
        assert res[r].dtype == torch.bfloat16 and res[r].shape == xs[r].shape
        assert torch.equal(res[r].cpu(), want[r]), f"rank {r}: combine differs from all2all's"
    return outs


CASES = [  # (world, recipe, scale_fmt, scenario, alignment, rounds, chunk_cols, ht_gather);
    (2, "bf16", "fp32", "uneven", 8, 3, 64, False),  # the interpreter costs ~1 s per rank and
    (2, "fp8_block", "fp32", "empty", 128, 1, 0, False),  # round (few rounds at 4 ranks)
    (4, "fp8_block", "ue8m0_packed", "all_to_one", 4, 1, 0, False),
    (4, "bf16", "fp32", "full", 8, 1, 128, False),
    (2, "fp8_block", "fp32", "uneven", 8, 3, 0, True),
    (4, "fp8_block", "ue8m0_packed", "empty", 8, 2, 0, True),
    (4, "bf16", "fp32", "all_to_one", 4, 1, 0, True),
]


@pytest.mark.parametrize("world,recipe,fmt,scenario,align,rounds,chunk,gather", CASES)
def test_ht_matches_all2all(world, recipe, fmt, scenario, align, rounds, chunk, gather, seed):
    """Rounds on one arena with fresh routing each (3 rounds: epochs 1..3 use both buffers and
    reuse one, whose stale rows must not leak into the result). chunk_cols > 0 splits the
    combines' rows into several column chunks (work items), as on the GPU. ht_gather: the
    layout rows read through rows_M from the arena."""
    quant = QuantConfig(recipe, fmt)
    gen = torch.Generator().manual_seed(seed)
    opts = OPTS if world > 2 else SymmOptions(num_sms=2)  # 2 CTAs: the last-arrival path
    opts = dataclasses.replace(opts, chunk_cols=chunk, ht_gather=gather)
    _, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T, options=opts,
                              alignment=align)
    for _ in range(rounds):
        run_round(comms, world, quant, *case_inputs(scenario, world, gen), gen)


def test_ht_sends_each_token_once_per_destination_rank(seed):
    """Dedup: rank s's region at rank d holds exactly the tokens of s with an expert on d, one
    row each, in token order; the count block says how many. A rank's own rows are never
    staged (its receive reads them from its input and routing): its own region holds poison
    still."""
    world, quant = 2, QuantConfig("bf16")
    gen = torch.Generator().manual_seed(seed)
    lw, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T, options=OPTS)
    for d in range(world):
        lw.rank(d).words("ht_rows").fill_(-7)
    xs, ids, ws = case_inputs("full", world, gen)
    loopback_dispatch(comms, xs, ids, ws)
    e_l = CFG.num_experts // world
    shape = comms[0].shape
    for d in range(world):
        arena = lw.rank(d)
        rows = arena.words("ht_rows").view(2, world, MAX_T, shape.row_words)
        cnt = arena.words("ht_counts").view(2, world, shape.count_words)
        for s in range(world):
            mine = [t for t in range(MAX_T) if ((ids[s][t] // e_l) == d).any()]
            want = xs[s][mine].view(torch.int32)
            if s == d:  # the own rows and counts come from the rank's input and routing
                assert (rows[1, s] == -7).all()
            else:
                assert int(cnt[1, s, 0]) == len(mine)  # epoch 1 uses buffer 1
                assert int(cnt[1, s, 1 + e_l]) == OPTS.num_sms  # the sender's CTAs
                assert torch.equal(rows[1, s, :len(mine), :want.shape[1]], want)


def test_ht_two_layers_interleaved_share_the_arena(seed):
    """Two comms (layers) on one arena: dispatch L0, dispatch L1, combine L0, combine L1."""
    world, quant = 2, QuantConfig("fp8_block")
    gen = torch.Generator().manual_seed(seed)
    lw, l0 = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T, options=OPTS)
    l1 = [SymmHighThroughputComm(CFG, quant, c.expert_map_E, c.ctx, options=OPTS) for c in l0]
    inp = [case_inputs("uneven", world, gen) for _ in range(2)]
    outs = [loopback_dispatch(layer, *i) for layer, i in zip((l0, l1), inp)]
    for i, o in zip(inp, outs):
        check_received(l0, o, world, quant, *i)
    for layer, i, o in zip((l0, l1), inp, outs):
        ys = [torch.randn(b.num_rows, CFG.hidden, generator=gen).to(torch.bfloat16)
              for b, _ in o]
        res = loopback_combine(layer, ys, [h for _, h in o])
        want = a2a_combine(world, o, ys, [x.shape[0] for x in i[0]])
        assert all(torch.equal(a, b) for a, b in zip(res, want))


def test_ht_refuses_a_second_send_before_the_receive():
    _, comms = loopback_comms(SymmHighThroughputComm, CFG, QuantConfig("bf16"), 2, MAX_T,
                              options=OPTS)
    x, ids, w = case_inputs("uneven", 2, torch.Generator().manual_seed(0))
    comms[0].dispatch_send(x[0], ids[0], w[0])
    with pytest.raises(RuntimeError, match="send called twice without the receive"):
        comms[0].dispatch_send(x[0], ids[0], w[0])


def test_ht_refuses_more_tokens_than_the_arena_holds():
    _, comms = loopback_comms(SymmHighThroughputComm, CFG, QuantConfig("bf16"), 2, 4,
                              options=OPTS)
    x, ids, w = case_inputs("uneven", 2, torch.Generator().manual_seed(0), max_t=12)
    with pytest.raises(ValueError, match=r"tokens per rank \(6\) exceed the arena's "
                                         r"max_tokens_per_rank \(4\)"):
        comms[1].dispatch_send(x[1], ids[1], w[1])


def test_ht_exact_rows_returns_only_the_used_rows(seed):
    """SymmOptions(exact_rows=True): one host sync, the layout cut to the rows in use."""
    world, quant = 2, QuantConfig("fp8_block")
    gen = torch.Generator().manual_seed(seed)
    _, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T,
                              options=SymmOptions(num_sms=1, exact_rows=True), alignment=8)
    xs, ids, ws = case_inputs("uneven", world, gen)
    for r, (batch, h) in enumerate(run_round(comms, world, quant, xs, ids, ws, gen)):
        m = int(batch.layout.offsets_E1[-1])
        assert batch.num_rows == m == batch.layout.num_rows == int(h.recv.info_I[1])


@pytest.mark.parametrize("gather", [False, True])
def test_ht_pipelined_kernel_matches_all2all_beside_split_ranks(gather, seed):
    """Rank 0 runs the pipelined dispatch and combine (one launch each: its first CTAs to
    start send, the rest receive; reduce, push, then sum), rank 1 the split launches; the
    roles' protocol is the same, so they mix. Order: rank 1 sends, rank 0's one kernel (its
    receivers find rank 1's rows), rank 1 receives. Three rounds: both buffers, the per-half
    epochs and the role counters' reset."""
    world, quant = 2, QuantConfig("fp8_block")
    gen = torch.Generator().manual_seed(seed)
    opts = SymmOptions(num_sms=2, recv_sms=3, ht_gather=gather)
    lw, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T,
                               options=opts, alignment=8)
    comms[0].options = dataclasses.replace(opts, pipelined=True)
    assert comms[0].pipelined and not comms[1].pipelined
    for _ in range(3):
        xs, ids, ws = case_inputs("full", world, gen)
        p1 = comms[1].dispatch_send(xs[1], ids[1], ws[1])
        p0 = comms[0].dispatch_send(xs[0], ids[0], ws[0])
        outs = [comms[0].dispatch_recv(p0), comms[1].dispatch_recv(p1)]
        for c in comms:
            c.check_errors()
        assert int(lw.rank(0).ctrl()[CTRL_ROLE + HT_DISPATCH]) == 0  # reset for the next
        # rank 0's send CTAs released their progress at rank 1 round by round (2 CTAs,
        # 4-slot chunks under the interpreter): epoch << 32 | rounds of that CTA
        n = sum(bool(((ids[0][t] // (CFG.num_experts // world)) == 1).any())
                for t in range(MAX_T))
        prog = lw.rank(1).words("ht_prog", torch.int64).view(world, -1)
        epoch = int(lw.rank(0).ctrl()[CTRL_SEQ_SEND + HT_DISPATCH])
        for c in range(2):
            rounds = len(range(c, -(-n // 4), 2))
            if rounds:
                assert int(prog[0, c]) == (epoch << 32) | rounds, (c, rounds)
        check_received(comms, outs, world, quant, xs, ids, ws)
        ys = [torch.randn(b.num_rows, CFG.hidden, generator=gen).to(torch.bfloat16)
              for b, _ in outs]
        # the combine likewise: rank 1 reduces and pushes, rank 0's one kernel (its sum
        # role finds rank 1's rows counted in), rank 1 sums
        sent1 = comms[1].combine_send(ys[1], outs[1][1])
        res = [comms[0].combine_recv(comms[0].combine_send(ys[0], outs[0][1])),
               comms[1].combine_recv(sent1)]
        for c in comms:
            c.check_errors()
        assert int(lw.rank(0).ctrl()[CTRL_ROLE + HT_COMBINE]) == 0
        want = a2a_combine(world, outs, ys, [x.shape[0] for x in xs])
        assert all(torch.equal(a, b) for a, b in zip(res, want))
        for r in range(world):  # every landing counter zeroed by its sum, for the next call
            assert not lw.rank(r).words("ht_csum").any()


def test_ht_receive_follows_the_senders_chunks_not_its_own(seed):
    """Rank 1 sends in 2-slot chunks (12 slots: 6 rounds of its one CTA), rank 0 would cut 8:
    the receive maps slots to rounds with the sender's chunk size from the count block. With
    the last round missing (and no whole-send word) it must time out; mapped by its own
    8-slot chunks it would think 2 rounds enough and read a chunk that has not landed."""
    world, quant = 2, QuantConfig("bf16")
    gen = torch.Generator().manual_seed(seed)
    lw, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T,
                               options=SymmOptions(num_sms=1, timeout_s=0.02, chunk_rows=8))
    comms[1].options = SymmOptions(num_sms=1, timeout_s=0.02, chunk_rows=2)
    xs, ids, ws = case_inputs("full", world, gen)
    ids[1][:, 0] = 0  # all 12 tokens of rank 1 go to rank 0
    comms[1].dispatch_send(xs[1], ids[1], ws[1])
    cnt = lw.rank(0).words("ht_counts").view(2, world, -1)
    e_l = CFG.num_experts // world
    assert cnt[1, 1, 1 + e_l].item() == 1 and cnt[1, 1, 2 + e_l].item() == 2  # G, CK
    prog = lw.rank(0).words("ht_prog", torch.int64).view(world, -1)
    prog[1, 0] = (1 << 32) | 5
    prog[1, -1] = 0
    comms[0].dispatch_recv(comms[0].dispatch_send(xs[0], ids[0], ws[0]))
    with pytest.raises(SymmTimeoutError, match="rank 0 timed out on peer 1 in ht-dispatch "
                                               "receive"):
        comms[0].check_errors()


def test_ht_combine_done_words_count_every_block_each_call(seed):
    """The combine's reduce counts NC (column chunks) per call into every done word (a token
    block's, or one no block uses this call), so after each call all words hold the same sum,
    which the control block keeps (the push waits for that sum + NC). 40 tokens per rank of
    room: 80 words, of which the 3 + 6 tokens received use one 64-row block. Then a second
    comm on the same arena with other column chunks (NC 2 instead of 4) takes turns with the
    first: with a per-call count tied to NC the push would wait for a sum never reached."""
    world, quant, max_t = 2, QuantConfig("bf16"), 40
    gen = torch.Generator().manual_seed(seed)
    opts = SymmOptions(num_sms=1, recv_sms=3, chunk_cols=64, timeout_s=1.0)  # D = 256: NC 4
    lw, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, max_t, options=opts)
    wide = [SymmHighThroughputComm(CFG, quant, c.expert_map_E, c.ctx,
                                   options=dataclasses.replace(opts, chunk_cols=128))
            for c in comms]
    total = 0
    for layer, nc in ((comms, 4), (comms, 4), (wide, 2), (comms, 4), (wide, 2)):
        xs, ids, ws = case_inputs("uneven", world, gen, max_t=max_t)
        outs = loopback_dispatch(layer, xs, ids, ws)
        ys = [torch.randn(b.num_rows, CFG.hidden, generator=gen).to(torch.bfloat16)
              for b, _ in outs]
        res = loopback_combine(layer, ys, [h for _, h in outs])
        total += nc
        for r in range(world):
            done = lw.rank(r).words("ht_cdone")
            assert (done == total).all(), (r, total, done.tolist())
            assert int(lw.rank(r).ctrl()[CTRL_CDONE_SUM]) == total
        want = [torch.zeros_like(x) for x in xs]  # all2all's numerics (W = 2: one rounding)
        for r, ((b, h), y) in enumerate(zip(outs, ys)):
            for n in range(int(h.recv.info_I[0])):
                src, t = divmod(int(h.recv.src_tok_N[n]), max_t)
                acc = torch.zeros(CFG.hidden)
                for k in range(CFG.top_k):
                    row = int(h.recv.inv_NK[n, k])
                    if row >= 0:
                        acc = acc + h.recv.w_NK[n, k] * y[row].float()
                want[src][t] = (want[src][t].float() + acc.to(torch.bfloat16).float()).to(
                    torch.bfloat16)
        assert all(torch.equal(a, b) for a, b in zip(res, want))
