"""symm-ht with `ht_gather` in the CPU loopback world (Triton interpreter): the receive writes
each layout row's arena slot (`LayoutBatch.rows_M`) instead of the row, and Triton's GEMM1
reads the rows through it. The protocol itself (rows, layout, combine against all2all) is
checked with the other symm-ht cases in tests/test_symm_ht.py; here: the experts on such a
batch against the copied batch and the float64 oracle, a timeout that leaves rows missing, the
exact-rows cut, and the launcher's refusal for experts that cannot gather.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from epmoe.comm.symm.arena import SymmTimeoutError
from epmoe.comm.symm.ht import SymmHighThroughputComm
from epmoe.comm.symm.loopback import loopback_comms, loopback_dispatch
from epmoe.comm.symm.options import SymmOptions
from epmoe.config import QuantConfig
from epmoe.quant import QTensor
from test_symm_ht import CFG, MAX_T, case_inputs, run_round

pytestmark = pytest.mark.interpreter
GATHER = SymmOptions(num_sms=2, ht_gather=True)


@dataclasses.dataclass(frozen=True)
class ExpertsCase:
    """Two loopback ranks' inputs and rank 0's Triton experts (synthetic weights), for the
    gathered batches of symm-ht and symm-ll (tests/test_symm_ll.py)."""

    quant: QuantConfig
    inputs: tuple  # (xs, ids, ws) per rank
    layer: object  # synthetic_layer of rank 0's experts
    experts: object  # TritonExperts over them

    def oracle_error(self, y_D: torch.Tensor, x: QTensor, e: int) -> float:
        """y_D (the experts' row for x [1, D] on local expert e) against the float64 oracle:
        max abs error over max abs value."""
        from epmoe.quant import dequantize_act, dequantize_weight
        from epmoe.reference import expert_mlp_ref

        w = self.layer.experts
        ref = expert_mlp_ref(dequantize_act(x).double(), dequantize_weight(w.w13)[e].double(),
                             dequantize_weight(w.w2)[e].double(), CFG, self.quant)[0]
        return float((y_D.double() - ref).abs().max() / ref.abs().max())


def experts_case(recipe: str, seed: int) -> ExpertsCase:
    from epmoe.experts.triton_experts import TritonExperts
    from epmoe.weights import synthetic_layer

    quant = QuantConfig(recipe)
    inputs = case_inputs("uneven", 2, torch.Generator().manual_seed(seed))
    lw = synthetic_layer(CFG, quant, 0, seed, list(range(CFG.num_experts // 2)))
    return ExpertsCase(quant, inputs, lw, TritonExperts(lw.experts, CFG, quant, block_m=16))


@pytest.mark.parametrize("recipe", ["fp8_block", "bf16", "mxfp8", "w4a8_mxfp4"])
def test_ht_gathered_rows_through_the_triton_experts(recipe, seed):
    """The same routing dispatched twice, rows copied into the layout and gathered: the batch
    holds a token once per rank (the arena's rows, no row per expert); Triton's experts give
    the same rows bit for bit on both, and each row matches the float64 oracle. Experts that
    cannot gather refuse the batch, naming themselves."""
    from epmoe.experts.torch_experts import TorchExperts

    case = experts_case(recipe, seed)
    got = {}
    for gather in (False, True):
        _, comms = loopback_comms(SymmHighThroughputComm, CFG, case.quant, 2, MAX_T,
                                  alignment=16,
                                  options=dataclasses.replace(GATHER, ht_gather=gather))
        batch, _ = loopback_dispatch(comms, *case.inputs)[0]
        assert (batch.rows_M is not None) == gather
        got[gather] = (batch, case.experts.run(batch))
    (copied, y_c), (gathered, y_g) = got[False], got[True]
    assert gathered.x.data.shape == (2 * 2 * MAX_T, CFG.hidden)  # [2 buffers][W][TMAX] rows
    lay = gathered.layout
    assert torch.equal(lay.row_expert_M, copied.layout.row_expert_M)
    used = lay.row_expert_M >= 0
    assert int(used.sum()) > 0 and torch.equal(y_g[used], y_c[used])
    x = gathered.copied()
    for m in used.nonzero().flatten().tolist():
        xq = QTensor(x.data[m:m + 1], None if x.scale is None else x.scale[m:m + 1], x.recipe,
                     x.group, x.scale_fmt)
        assert case.oracle_error(y_g[m], xq, int(lay.row_expert_M[m])) <= 3e-2, m
    with pytest.raises(ValueError, match=r"torch experts \(\w+\) cannot read layout rows "
                                         r"\(rows_M\) through an index"):
        TorchExperts(case.layer.experts, CFG, case.quant).run(gathered)


def test_ht_gather_exact_rows_cuts_the_index_not_the_rows(seed):
    world, quant = 2, QuantConfig("fp8_block")
    gen = torch.Generator().manual_seed(seed)
    _, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T, alignment=8,
                              options=dataclasses.replace(GATHER, exact_rows=True))
    xs, ids, ws = case_inputs("uneven", world, gen)
    for batch, h in run_round(comms, world, quant, xs, ids, ws, gen):
        m = int(h.recv.info_I[1])
        assert batch.num_rows == m == batch.rows_M.shape[0] == batch.layout.num_rows
        assert batch.x.data.shape[0] == 2 * world * MAX_T


def test_ht_gather_after_a_timeout_points_no_row_at_a_slot_that_never_landed(seed):
    """Rank 1 sends 12 tokens to rank 0 in 2-slot chunks; its last round never lands (forged
    progress: 5 of 6 rounds, no whole-send word). Rank 0's receive times out on that chunk:
    its layout rows keep -1 in rows_M (the memset before the launch), so the GEMM reads no
    slot that never landed; every other row points at its token's slot."""
    world, quant = 2, QuantConfig("bf16")
    gen = torch.Generator().manual_seed(seed)
    opts = dataclasses.replace(GATHER, num_sms=1, timeout_s=0.02, chunk_rows=2)
    lw, comms = loopback_comms(SymmHighThroughputComm, CFG, quant, world, MAX_T, options=opts)
    xs, ids, ws = case_inputs("full", world, gen)
    ids[1][:, 0] = 0  # all 12 tokens of rank 1 go to rank 0
    comms[1].dispatch_send(xs[1], ids[1], ws[1])
    prog = lw.rank(0).words("ht_prog", torch.int64).view(world, -1)
    prog[1, 0] = (1 << 32) | 5
    prog[1, -1] = 0
    batch, h = comms[0].dispatch_recv(comms[0].dispatch_send(xs[0], ids[0], ws[0]))
    with pytest.raises(SymmTimeoutError, match="rank 0 timed out on peer 1 in ht-dispatch "
                                               "receive"):
        comms[0].check_errors()
    e_l = CFG.num_experts // world
    n = int(h.recv.info_I[0])
    here = [((i >= 0) & (i // e_l == 0)) for i in ids]  # [T, K] per source
    # a source's slots: its tokens with an expert here, in token order (rank 1's last 2 lost)
    slots = [[t for t in range(MAX_T) if here[s][t].any()] for s in range(world)]
    assert len(slots[1]) == MAX_T
    pairs = 0
    for i in range(n):
        src, t = divmod(int(h.recv.src_tok_N[i]), MAX_T)
        if src < 0:
            continue
        for k, on in enumerate(here[src][t].tolist()):
            row = int(h.recv.inv_NK[i, k])
            assert (row >= 0) == on
            if on:  # epoch 1: buffer 1
                assert int(batch.rows_M[row]) == (world + src) * MAX_T + slots[src].index(t)
                pairs += 1
    assert slots[1][-2:] == [10, 11] and int(here[1][10:].sum()) > 0
    assert int((batch.rows_M >= 0).sum()) == pairs == int(here[0].sum() + here[1][:10].sum())
    assert sum(1 for i in range(n) if int(h.recv.src_tok_N[i]) < 0) == 2  # the lost chunk


def test_launch_refuses_ht_gather_without_gathering_experts():
    from epmoe.launch.cli import build_run, parser

    base = ["--ep", "2", "--comm-option", "ht_gather=1"]
    for quant in ("fp8_block", "mxfp8"):  # every recipe's Triton GEMM1 reads through it
        run = build_run(parser().parse_args(base + ["--experts", "triton", "--quant", quant]))
        assert dict(run.comm_options) == {"ht_gather": True}
    with pytest.raises(ValueError, match="ht_gather leaves symm-ht's rows for an expert "
                                         "GEMM .* needs --experts triton"):
        build_run(parser().parse_args(base + ["--experts", "torch"]))


def test_a_gather_knob_binds_only_its_own_backends_layers():
    """A plan file's layers are checked one by one (`check_plan_file`): the knob of symm-ht
    rules out other experts on symm-ht layers only, symm-ll's on symm-ll layers."""
    from epmoe.launch.planning import gather_conflict

    ht, ll = (("ht_gather", True),), (("ll_dedup", True), ("ll_gather", True))
    assert "ht_gather" in gather_conflict("symm-ht", "deepgemm", ht)
    assert "ll_gather" in gather_conflict("symm-ll", "torch", ll)
    assert gather_conflict("symm-ht", "triton", ht) is None
    assert gather_conflict("symm-ll", "deepgemm", ht) is None
    assert gather_conflict("symm-ht", "deepgemm", ll) is None
    assert gather_conflict("symm-ht", "deepgemm", ()) is None
