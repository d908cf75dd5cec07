"""The real-rank harness of `python -m epmoe.bench.comm` on CPU gloo ranks: the same inputs for
every backend, the round trip through identity experts checked, jobs that keep NVSHMEM owners
apart, same-run ratios to DeepEP, and failures reported as rows (never a hang)."""

import json

import pytest
import torch

from epmoe.bench.comm import main
from epmoe.bench.comm_ranks import (RankJob, identity_experts, plan_jobs, rank_device, run_job,
                                    sent_rows, wire_reference, with_ratios)
from epmoe.config import QuantConfig
from epmoe.kernels.quantize import quantize_tokens
from epmoe.quant import FP8_DTYPE, dequantize_act
from epmoe.comm.base import LayoutBatch, TokenBatch
from epmoe.quant import QTensor

KW = dict(world=2, device="cpu", iters=2, hidden=256, num_experts=16, top_k=4, num_sms=24)


@pytest.mark.timeout(240)
def test_cpu_ranks_measure_and_check_every_case(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--hidden", "256", "--num-experts", "16", "--ht-tokens",
                 "32", "--ll-tokens", "8", "--iters", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["recipe"], r["tokens"]) for r in rows} == {
        (rec, t) for rec in ("bf16", "fp8_block") for t in (32, 8)}
    for r in rows:
        assert r["backend"] == "all2all" and r["world"] == 2 and r["passed"] is True
        assert r["dispatch_us"] > 0 and r["combine_us"] > 0
        assert 0 < r["dispatch_gbs_link"] < r["dispatch_gbs_all"]  # own rows stay home
        assert r["vs_deepep_dispatch"] is None  # no DeepEP on CPU: no ratio invented
        assert 0 <= r["max_rel_err"] <= 2e-2  # the round trip's error is kept, not only a flag
    assert json.loads(out.read_text())["timing"] == "device"


def test_jobs_keep_nvshmem_owners_apart():
    jobs = plan_jobs(["all2all", "deepep-ll", "symm-ll"], "ll", ["bf16", "fp8_block"], (8,),
                     **KW)
    assert [(j.recipe, j.backends) for j in jobs] == [
        ("bf16", ("all2all", "deepep-ll")), ("bf16", ("symm-ll",)),
        ("fp8_block", ("all2all", "deepep-ll")), ("fp8_block", ("symm-ll",))]
    with pytest.raises(ValueError, match=r"each start NVSHMEM: they need separate jobs"):
        RankJob("ll", ("deepep-ll", "symm-ll"), "bf16", (8,), **KW)


def test_ranks_sharing_one_gpu_run_symm_only_on_cuda0():
    kw = dict(KW, device="cuda-shared")
    assert RankJob("ht", ("symm-ht",), "bf16", (64,), **kw).device == "cuda-shared"
    with pytest.raises(ValueError, match=r"\['all2all'\] need one GPU per rank"):
        RankJob("ht", ("all2all", "symm-ht"), "bf16", (64,), **kw)
    with pytest.raises(ValueError, match=r"must be cuda, cuda-shared or cpu"):
        RankJob("ht", ("symm-ht",), "bf16", (64,), **dict(KW, device="gpu"))
    assert [str(rank_device(d, 1)) for d in ("cuda", "cuda-shared", "cpu")] == [
        "cuda:1", "cuda:0", "cpu"]


def test_timing_is_device_or_launched():
    assert RankJob("ht", ("all2all",), "bf16", (8,), **KW).timing == "device"
    assert RankJob("ht", ("all2all",), "bf16", (8,), **KW, timing="launched").timing == "launched"
    with pytest.raises(ValueError, match=r"timing \('wall'\) must be one of"):
        RankJob("ht", ("all2all",), "bf16", (8,), **KW, timing="wall")


def test_wire_reference_follows_deepep_lls_own_fp8_arithmetic():
    """deepep-ll: codes of x * (448 / amax) with IEEE fp32 division, scale amax * fp32(1 / 448)
    (DeepEP's calculate_fp8_scales); every other backend: epmoe.quant's codes, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 512, generator=gen) * torch.rand(64, 1, generator=gen) * 8).bfloat16()
    fp8 = QuantConfig("fp8_block")
    ours = dequantize_act(quantize_tokens(x, fp8)).float()
    assert torch.equal(wire_reference(x, "symm-ll", fp8), ours)
    assert torch.equal(wire_reference(x, "deepep-ll", QuantConfig("bf16")), x.float())
    got = wire_reference(x, "deepep-ll", fp8)
    xg = x.float().unflatten(-1, (-1, 128))
    amax = xg.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    step = amax * torch.tensor(1 / 448, dtype=torch.float32)
    exact = (448.0 / amax.double()).float()  # the IEEE fp32 quotient (one rounding)
    want = (xg * exact).to(FP8_DTYPE).float() * step
    assert torch.equal(got, want.flatten(-2))
    # torch's `448.0 / amax` (reciprocal, then times 448) is an ulp off in some groups, and
    # codes follow: the reference must not use it
    recip = (xg * (448.0 / amax)).to(FP8_DTYPE).float() * step
    assert (448.0 / amax != exact).any() and not torch.equal(got, recip.flatten(-2))
    # the two conventions agree to within one fp8 code of the block's scale
    assert ((got - ours).abs().unflatten(-1, (-1, 128)) <= 32 * step * 1.0001).all()


def test_shared_device_needs_cuda_and_symm_backends(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--device", "shared"]) == 2
    assert "--device shared but no CUDA device is visible" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["--device", "shared", "--backends", "all2all,deepep-ht"]) == 2
    assert "runs symm-* only" in capsys.readouterr().err


def test_ratios_are_to_deepep_of_the_same_mode_recipe_and_tokens():
    def row(backend, mode, d, c, tokens=64, recipe="bf16"):
        return dict(backend=backend, mode=mode, recipe=recipe, tokens=tokens, status="ok",
                    dispatch_us=d, combine_us=c)

    rows = with_ratios([row("deepep-ht", "ht", 100.0, 200.0), row("symm-ht", "ht", 50.0, 300.0),
                        row("symm-ht", "ht", 10.0, 10.0, tokens=128),
                        row("symm-ll", "ll", 5.0, 5.0)])
    assert rows[0]["vs_deepep_dispatch"] == 1.0
    assert (rows[1]["vs_deepep_dispatch"], rows[1]["vs_deepep_combine"]) == (0.5, 1.5)
    assert "vs_deepep_dispatch" not in rows[2] and "vs_deepep_dispatch" not in rows[3]
    assert "vs_deepep_layout" not in rows[1]  # DeepEP's permute not timed: no such ratio
    rows = with_ratios([dict(row("deepep-ht", "ht", 100.0, 200.0), permute_us=60.0),
                        row("symm-ht", "ht", 80.0, 300.0)])
    assert rows[1]["vs_deepep_layout"] == 0.5 and "vs_deepep_layout" not in rows[0]


def test_the_layout_pass_is_for_rows_per_token_only():
    from epmoe.bench.comm_ranks import _layout_pass

    x = QTensor(torch.zeros(3, 8, dtype=torch.bfloat16), None, "bf16", 0)
    assert _layout_pass(LayoutBatch(x, None), 4) is None
    assert callable(_layout_pass(TokenBatch(x, torch.zeros(3, 2, dtype=torch.int32),
                                            torch.ones(3, 2)), 4))


def test_identity_experts_follow_each_batch_types_contract():
    x = torch.randn(3, 8)
    ids = torch.tensor([[0, -1], [-1, -1], [1, 0]], dtype=torch.int32)
    w = torch.tensor([[0.5, 9.0], [9.0, 9.0], [0.25, 0.75]])
    got = identity_experts(TokenBatch(QTensor(x.to(torch.bfloat16), None, "bf16", 0), ids, w))
    want = x.to(torch.bfloat16).float() * torch.tensor([[0.5], [0.0], [1.0]])
    assert got.dtype == torch.float32 and torch.equal(got, want)
    lay = identity_experts(LayoutBatch(QTensor(x.to(torch.bfloat16), None, "bf16", 0), None))
    assert lay.dtype == torch.bfloat16 and torch.equal(lay, x.to(torch.bfloat16))


def test_sent_rows_counts_a_token_once_per_rank_for_ht_and_per_k_for_ll():
    ids = torch.tensor([[0, 1], [0, 9], [8, 9]])  # 16 experts over 2 ranks: 0-7, 8-15
    assert sent_rows(ids, 2, 16, 0, ll=False) == (4, 2)  # rank 0: {0}, {0, 1}, {1}
    assert sent_rows(ids, 2, 16, 0, ll=True) == (6, 3)
    # symm-ll with ll_dedup: DeepEP's convention for all rows, a token once per rank over the
    # link (its default sends a row per (token, expert), as DeepEP)
    assert sent_rows(ids, 2, 16, 0, ll=True, dedup_link=True) == (6, 2)
    from types import SimpleNamespace

    from epmoe.bench.comm_ranks import sends_once_per_rank
    from epmoe.comm.symm.options import SymmOptions

    assert sends_once_per_rank(SimpleNamespace(options=SymmOptions(ll_dedup=True)))
    assert not sends_once_per_rank(SimpleNamespace(options=SymmOptions()))
    assert not sends_once_per_rank(object())  # DeepEP, all2all: no SymmOptions


@pytest.mark.timeout(120)
def test_a_failing_job_becomes_failed_rows():
    job = RankJob("ht", ("all2all",), "fp8_block", (8,), **{**KW, "hidden": 100})
    (row,) = run_job(job, timeout_s=90)
    assert row["status"] == "failed" and row["backend"] == "all2all"
    assert "128" in row["error"]  # fp8 1x128 groups need hidden % 128 == 0


def test_auto_table_takes_real_link_rows_only():
    from epmoe.bench.comm import auto_table, make_row

    def row(backend, where, us):
        return make_row(dict(backend=backend, recipe="bf16", tokens=4096, world=2, where=where,
                             dispatch_us=us, combine_us=us, rows=100, link_rows=50, sms=None))

    table = auto_table([row("deepep-ht", "2 ranks, one GPU each", 300.0),
                        row("symm-ht", "loopback: 2 ranks on one GPU", 100.0),
                        row("symm-ht", "shared: 2 ranks on one GPU (time-sliced)", 900.0)])
    assert table["entries"] == {"deepep-ht": {"bf16": [[4096, 600.0]]}}
    assert "measured" not in table  # no provenance given: none invented
    bad = make_row(dict(backend="deepep-ll", recipe="bf16", tokens=128, world=2, sms=None,
                        where="2 ranks, one GPU each", dispatch_us=9.0, combine_us=9.0,
                        rows=100, link_rows=50, passed=False))
    assert auto_table([bad])["entries"] == {}  # a failed round trip recommends nothing
    assert auto_table([], "bench.comm 2026-12-04")["measured"] == "bench.comm 2026-12-04"


def test_a_sweeps_knobs_reach_symm_jobs_and_only_theirs():
    """--sweep on real ranks: each knob set is a symm job of its own (the others run once),
    its knobs become the backend's SymmOptions (pipelined 2: off), rows say which set."""
    from epmoe.bench.comm_loopback import sweep_spec as _sweep
    from epmoe.bench.comm_ranks import _kwargs

    sets = _sweep("32:0:0:0:0:2:64,0")
    assert sets[0] == dict(num_sms=32, recv_sms=0, tile_tokens=0, chunk_cols=0, num_warps=0,
                           pipelined=2, chunk_rows=64, ll_dedup=0, ll_gather=0,
                           ht_gather=0)
    job = RankJob("ht", ("symm-ht",), "bf16", (64,), **KW, knobs=tuple(sets[0].items()))
    opts = _kwargs("symm-ht", job)["options"]
    assert (opts.num_sms, opts.pipelined, opts.chunk_rows, opts.recv_sms) == (32, False, 64, 0)
    assert job.label == "num_sms=32 pipelined=2 chunk_rows=64"
    on = RankJob("ht", ("symm-ht",), "bf16", (64,), **KW, knobs=(("pipelined", 1),))
    assert _kwargs("symm-ht", on)["options"].pipelined is True
    staged = RankJob("ll", ("symm-ll",), "fp8_block", (8,), **KW, knobs=(("ll_dedup", 1),))
    assert _kwargs("symm-ll", staged)["options"].ll_dedup is True
    gathered = RankJob("ll", ("symm-ll",), "fp8_block", (8,), **KW,
                       knobs=(("ll_dedup", 1), ("ll_gather", 1)))
    assert _kwargs("symm-ll", gathered)["options"].ll_gather is True
    direct = RankJob("ll", ("symm-ll",), "fp8_block", (8,), **KW, knobs=(("ll_dedup", 2),))
    assert _kwargs("symm-ll", direct)["options"].ll_dedup is False
    default = RankJob("ht", ("symm-ht",), "bf16", (64,), **KW, knobs=tuple(sets[1].items()))
    assert default.label == "" and _kwargs("symm-ht", default)["options"].num_sms == 0
    plain = RankJob("ht", ("symm-ht",), "bf16", (64,), **KW)  # no sweep: --num-sms
    assert _kwargs("symm-ht", plain)["options"].num_sms == 24


def test_a_sweep_on_cpu_ranks_runs_the_portable_backend_once(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--hidden", "256", "--num-experts", "16", "--only", "ht",
                 "--ht-tokens", "16", "--recipes", "bf16", "--iters", "1", "--sweep",
                 "24,32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["knobs"]) for r in rows] == [("all2all", "")]
