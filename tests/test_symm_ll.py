"""symm-ll in the CPU loopback world (Triton interpreter).

Rows land in the masked layout in atomic order, so the checks go through each row's meta word
(source rank, token, k): every routed (token, k) appears exactly once, on its expert, holding
exactly `quantize_act` of its token (fp8 codes and scales, or bf16); counts are exact; the
combine equals all2all's numerics (bit for bit): per rank the fp32 sum of w_k * y_k over the
token's slots there in k order, cast to bf16, then the fp32 sum of those partials in rank
order, cast once. Expert outputs are fresh random values each round; the masked region and the
messages keep the previous round's contents (poison for a stale read).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from epmoe.comm.symm.arena import SymmTimeoutError
from epmoe.comm.symm.ll import SymmLowLatencyComm
from epmoe.comm.symm.loopback import loopback_combine, loopback_comms, loopback_dispatch
from epmoe.comm.symm.options import SymmOptions
from epmoe.config import QuantConfig
from epmoe.quant import quantize_act
from test_symm_ht import CFG, MAX_T, case_inputs, on, to_cpu

pytestmark = pytest.mark.interpreter  # the loopback world on CPU tensors

OPTS = SymmOptions(num_sms=1, timeout_s=1.0)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def masked_shape(batch) -> tuple[int, int, int]:
    """[E, C, D] of a MaskedBatch, its rows copied in or gathered through rows_EC."""
    return (*batch.shape_EC, batch.x.data.shape[-1])


def masked_row(batch, e: int, row: int):
    """(data, scale or None) of masked row (e, row)."""
    at = (e, row) if batch.rows_EC is None else (int(batch.rows_EC[e, row]),)
    return batch.x.data[at], None if batch.x.scale is None else batch.x.scale[at]


def ll_options(opts: SymmOptions, mode) -> SymmOptions:
    """mode: False (a row per (token, expert)), True (staged: a token once per rank, copied
    into its experts' rows), "gather" (staged, the rows read through rows_EC)."""
    return dataclasses.replace(opts, ll_dedup=bool(mode), ll_gather=mode == "gather")


def check_masked(lw, outs, world, quant, xs, ids):
    """-> {(src, t, k): (rank, expert, row)} after checking rows, scales and counts."""
    e_l = CFG.num_experts // world
    where = {}
    for r in range(world):
        batch, h = outs[r]
        c = masked_shape(batch)[1]
        assert masked_shape(batch) == (e_l, world * MAX_T, CFG.hidden)
        meta = lw.rank(r).words("ll_meta").view(e_l, c).cpu()
        want = torch.zeros(e_l, dtype=torch.int32)
        for s in range(world):
            for e in ids[s].flatten().tolist():
                if e >= 0 and e // e_l == r:
                    want[e - r * e_l] += 1
        assert torch.equal(batch.counts_E, want), f"rank {r}: counts {batch.counts_E} != {want}"
        for e in range(e_l):
            for row in range(int(want[e])):
                s, rest = divmod(int(meta[e, row]), MAX_T * CFG.top_k)
                t, k = divmod(rest, CFG.top_k)
                assert int(ids[s][t, k]) == r * e_l + e and (s, t, k) not in where
                where[(s, t, k)] = (r, e, row)
                q = quantize_act(xs[s][t:t + 1], quant)
                data, scale = masked_row(batch, e, row)
                assert torch.equal(u8(data), u8(q.data[0])), (s, t, k)
                if q.scale is not None:
                    assert torch.equal(scale, q.scale[0]), (s, t, k)
    routed = sum(int((i >= 0).sum()) for i in ids)
    assert len(where) == routed
    return where


def run_round(lw, comms, world, quant, xs, ids, ws, gen, device="cpu", streams=False):
    outs = loopback_dispatch(comms, *on(device, xs, ids, ws), streams=streams)
    where = check_masked(lw, to_cpu(outs), world, quant, xs, ids)
    ys = [torch.randn(masked_shape(b), generator=gen).to(torch.bfloat16) for b, _ in outs]
    res = [r.cpu() for r in loopback_combine(comms, *on(device, ys), [h for _, h in outs],
                                             streams=streams)]
    for s in range(world):
        acc = torch.zeros(xs[s].shape[0], CFG.hidden)
        for t in range(xs[s].shape[0]):
            for r in range(world):  # the partials, in rank order
                part, sent = torch.zeros(CFG.hidden), False
                for k in range(CFG.top_k):
                    if ids[s][t, k] >= 0 and where[(s, t, k)][0] == r:
                        _, e, row = where[(s, t, k)]
                        part = part + ws[s][t, k] * ys[r][e, row].float()
                        sent = True
                if sent:
                    acc[t] = acc[t] + part.to(torch.bfloat16).float()
        assert torch.equal(res[s], acc.to(torch.bfloat16)), f"rank {s}: combine differs"


CASES = [  # (world, recipe, scale_fmt, scenario, rounds, chunk_cols: > 0 splits rows into
    (2, "fp8_block", "fp32", "uneven", 3, 64),  # column chunks, as on the GPU)
    (2, "bf16", "fp32", "empty", 1, 0),
    (4, "fp8_block", "ue8m0_fp32", "all_to_one", 1, 128),
]
MODES = [False, True, "gather"]  # ll_options
MODE_IDS = ["direct", "staged", "gathered"]


@pytest.mark.parametrize("dedup", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("world,recipe,fmt,scenario,rounds,chunk", CASES)
def test_ll_masked_rows_and_combine(world, recipe, fmt, scenario, rounds, chunk, dedup, seed):
    quant = QuantConfig(recipe, fmt)
    gen = torch.Generator().manual_seed(seed)
    opts = OPTS if world > 2 else SymmOptions(num_sms=2)
    opts = ll_options(dataclasses.replace(opts, chunk_cols=chunk), dedup)
    lw, comms = loopback_comms(SymmLowLatencyComm, CFG, quant, world, MAX_T, options=opts)
    for _ in range(rounds):
        run_round(lw, comms, world, quant, *case_inputs(scenario, world, gen), gen)


@pytest.mark.parametrize("dedup", MODES, ids=MODE_IDS)
def test_ll_fewer_tokens_after_more_ignore_the_stale_messages(dedup, seed):
    """A round with every slot full, then rounds with fewer tokens and other routing on the
    same arenas: the earlier rounds' messages (tokens past the new T, ranks a token no longer
    goes to) and staged rows stay in the arena and must not change a dispatch or a combine."""
    quant = QuantConfig("fp8_block")
    gen = torch.Generator().manual_seed(seed)
    lw, comms = loopback_comms(SymmLowLatencyComm, CFG, quant, 2, MAX_T,
                               options=ll_options(OPTS, dedup))
    for scenario in ("full", "uneven", "empty", "all_to_one"):
        run_round(lw, comms, 2, quant, *case_inputs(scenario, 2, gen), gen)


def test_ll_scales_are_column_major_per_expert():
    """DeepGEMM's TMA layout: [E, C, G] with the C stride 1."""
    _, comms = loopback_comms(SymmLowLatencyComm, CFG, QuantConfig("fp8_block"), 2, MAX_T,
                              options=OPTS)
    xs, ids, ws = case_inputs("uneven", 2, torch.Generator().manual_seed(0))
    batch, _ = loopback_dispatch(comms, xs, ids, ws)[0]
    assert batch.x.scale.shape == (8, 2 * MAX_T, CFG.hidden // 128)
    assert batch.x.scale.stride()[1] == 1 and batch.x.data.is_contiguous()


def test_ll_second_dispatch_without_combine_times_out():
    """The masked region is released by combine_send: a second dispatch before it waits, and
    gives up naming the phase."""
    quant = QuantConfig("fp8_block")
    _, comms = loopback_comms(SymmLowLatencyComm, CFG, quant, 2, MAX_T,
                              options=SymmOptions(num_sms=1, timeout_s=0.02))
    xs, ids, ws = case_inputs("uneven", 2, torch.Generator().manual_seed(0))
    loopback_dispatch(comms, xs, ids, ws)
    with pytest.raises(SymmTimeoutError, match=r"rank 0 timed out on peer 0 in ll-dispatch "
                                               r"send, waiting for the peer to release"):
        loopback_dispatch(comms, xs, ids, ws)


@pytest.mark.parametrize("dedup", MODES, ids=MODE_IDS)
def test_ll_receive_from_a_silent_peer_names_it_and_hands_out_no_rows(dedup):
    """Rank 1 never sends: rank 0's receive gives up naming peer 1 and the phase, and the
    masked batch it returns has no rows (counts 0), whatever rank 0's own send placed."""
    quant = QuantConfig("fp8_block")
    _, comms = loopback_comms(SymmLowLatencyComm, CFG, quant, 2, MAX_T,
                              options=ll_options(SymmOptions(num_sms=2, timeout_s=0.02), dedup))
    xs, ids, ws = case_inputs("full", 2, torch.Generator().manual_seed(0))
    batch, _ = comms[0].dispatch_recv(comms[0].dispatch_send(xs[0], ids[0], ws[0]))
    assert torch.equal(batch.counts_E, torch.zeros_like(batch.counts_E))
    with pytest.raises(SymmTimeoutError, match=r"rank 0 timed out on peer 1 in ll-dispatch "
                                               r"receive, waiting for the peer's data"):
        comms[0].check_errors()


def test_ll_refuses_recipes_it_cannot_quantize():
    with pytest.raises(ValueError, match="symm-ll carries bf16 or fp8 1x128 tokens"):
        loopback_comms(SymmLowLatencyComm, CFG, QuantConfig("mxfp8"), 2, MAX_T)


def test_ll_refuses_prefill_sized_arenas():
    with pytest.raises(ValueError, match=r"max_tokens_per_rank \(4096\) must lie in \[1, 1024\]"):
        loopback_comms(SymmLowLatencyComm, CFG, QuantConfig("bf16"), 2, 4096)


@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_bench_checks_agree_with_the_kernels_and_catch_a_wrong_sum(mode, seed):
    """bench.comm --check's references (comm_loopback.check_ht / check_ll) say 'ok' on what
    the kernels return, and name the rank whose combine was altered."""
    from epmoe.bench.comm_loopback import check_ht, check_ll
    from epmoe.comm.symm.ht import SymmHighThroughputComm

    cls, check = ((SymmHighThroughputComm, check_ht) if mode == "ht"
                  else (SymmLowLatencyComm, check_ll))
    gen = torch.Generator().manual_seed(seed)
    _, comms = loopback_comms(cls, CFG, QuantConfig("bf16"), 2, MAX_T, options=OPTS)
    xs, ids, ws = case_inputs("uneven", 2, gen)
    outs = loopback_dispatch(comms, xs, ids, ws)
    ys = [torch.randn(b.x.data.shape[:-1] + (CFG.hidden,), generator=gen).to(torch.bfloat16)
          for b, _ in outs]
    res = loopback_combine(comms, ys, [h for _, h in outs])
    assert check(comms, ids, ws, outs, ys, res) == "ok"
    res[1] = res[1].clone()
    res[1][0, 0] += 1.0
    assert check(comms, ids, ws, outs, ys, res).startswith("rank 1: 1 differ")



def test_comm_options_reach_a_symm_layer_and_only_symm_layers():
    """--comm-option KNOB=VALUE -> RunConfig.comm_options -> the symm backend's SymmOptions
    (make_comm); the other backends take none."""
    from epmoe.comm import make_comm
    from epmoe.comm.context import CommContext
    from epmoe.comm.symm.arena import ArenaResource, LoopbackWorld
    from epmoe.comm.symm.options import parse_knobs
    from epmoe.launch.cli import build_run, parser

    run = build_run(parser().parse_args(["--ep", "2", "--comm-option", "ll_dedup=on",
                                         "--comm-option", "num_sms=2"]))
    assert run.comm_options == (("ll_dedup", True), ("num_sms", 2))
    assert build_run(parser().parse_args(["--ep", "2"])).comm_options == ()
    assert parse_knobs(["pipelined=0", "timeout_s=2.5"]) == (("pipelined", False),
                                                            ("timeout_s", 2.5))
    quant = QuantConfig("fp8_block")
    layout = SymmLowLatencyComm.arena_layout(CFG, quant, 2, MAX_T)
    lw = LoopbackWorld(layout, "cpu")
    ctx = CommContext(None, 0, 2, "cpu", max_tokens_per_rank=MAX_T)
    ctx.resource(SymmLowLatencyComm.arena_key, lambda: ArenaResource(lw.rank(0)))
    emap = torch.full((CFG.num_experts,), -1, dtype=torch.int32)
    emap[:CFG.num_experts // 2] = torch.arange(CFG.num_experts // 2, dtype=torch.int32)
    comm = make_comm("symm-ll", CFG, quant, emap, ctx,
                     SymmOptions(**dict(run.comm_options)))
    assert comm.options.ll_dedup and comm.options.num_sms == 2 and comm._dispatch.staged
    plain = make_comm("local", CFG, quant, emap, None, SymmOptions(ll_dedup=True))
    assert not hasattr(plain, "options")
    gather = ["--ep", "2", "--comm-option", "ll_dedup=1", "--comm-option", "ll_gather=1"]
    run = build_run(parser().parse_args(gather + ["--experts", "triton"]))
    assert dict(run.comm_options) == {"ll_dedup": True, "ll_gather": True}
    for argv, why in ((gather + ["--experts", "torch"], "needs --experts triton"),
                      (["--ep", "2", "--comm-option", "ll_gather=1", "--experts", "triton"],
                       "turn ll_dedup on too")):
        with pytest.raises(ValueError, match=why):
            build_run(parser().parse_args(argv))


def test_the_direct_send_refuses_an_arena_its_destination_words_cannot_address():
    """One int64 word per slot holds the peer's base // 128 and row + 1 (24 bits): an arena
    past either bound is refused at construction, naming both limits."""
    from types import SimpleNamespace

    from epmoe.comm.symm.ll_dispatch import _check_dest_words

    def arena(*deltas):
        return SimpleNamespace(peer_delta_W=torch.tensor(deltas, dtype=torch.int64))

    _check_dest_words(arena(0, -(2 ** 45 - 128), 2 ** 44), 2 ** 24 - 2)
    with pytest.raises(ValueError, match=r"2\^45"):
        _check_dest_words(arena(0, 2 ** 45), 10)
    with pytest.raises(ValueError, match="at most 16777214"):
        _check_dest_words(arena(0, 128), 2 ** 24 - 1)


@pytest.mark.parametrize("recipe", ["fp8_block", "bf16"])
def test_ll_gathered_rows_through_the_triton_experts(recipe, seed):
    """ll_gather: the batch is the staged rows with an index (no row copied in); Triton's
    GEMM reads through it: its output equals the same experts on the staged way's copied
    batch bit for bit (same arenas' routing, same weights), and the float64 oracle per row.
    Experts that cannot gather refuse the batch, naming themselves."""
    from epmoe.experts.torch_experts import TorchExperts
    from test_symm_ht_gather import experts_case

    case = experts_case(recipe, seed)
    got = {}
    for mode in (True, "gather"):
        _, comms = loopback_comms(SymmLowLatencyComm, CFG, case.quant, 2, MAX_T,
                                  options=ll_options(SymmOptions(num_sms=2), mode))
        batch, _ = loopback_dispatch(comms, *case.inputs)[0]
        assert (batch.rows_EC is not None) == (mode == "gather")
        got[mode] = (batch, case.experts.run(batch))
    (copied, y_c), (gathered, y_g) = got[True], got["gather"]
    assert gathered.x.data.shape == (2 * MAX_T, CFG.hidden)  # a token once, not per expert
    assert torch.equal(copied.counts_E, gathered.counts_E)
    for e in range(CFG.num_experts // 2):  # rows land in atomic order: match them by content
        for row in range(int(gathered.counts_E[e])):
            data, scale = masked_row(gathered, e, row)
            hits = [j for j in range(int(copied.counts_E[e]))
                    if torch.equal(u8(masked_row(copied, e, j)[0]), u8(data))]
            assert hits and all(torch.equal(y_g[e, row], y_c[e, j]) for j in hits)
            xq = type(gathered.x)(data[None], None if scale is None else scale[None],
                                  gathered.x.recipe, gathered.x.group, gathered.x.scale_fmt)
            assert case.oracle_error(y_g[e, row], xq, e) <= 3e-2
    with pytest.raises(ValueError, match=r"torch experts \(\w+\) cannot read masked rows "
                                         r"\(rows_EC\) through"):
        TorchExperts(case.layer.experts, CFG, case.quant).run(gathered)
