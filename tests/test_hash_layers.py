"""Hash-routed MoE layers (DeepSeek-V4's first layers, `MoEConfig.hash_layers`): experts
looked up by token id in a [vocab, K] table, weighted by the router's scores of those experts.

Anchor: DeepSeek-V4's Gate.forward (its inference model.py), re-written here in float64:
scores = sqrt(softplus(x W^T)); indices = tid2eid[input_ids]; weights = scores[indices] /
their sum x route_scale (no bias on hash layers)."""

from __future__ import annotations

import math

import pytest
import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.reference import reference_hash_route, reference_route
from epmoe.router import hash_route, route
from tests.launch_util import config_folder, launch_in_process
from tests.test_deepseek_v4 import V4

CFG = MoEConfig("hash", hidden=64, moe_intermediate=32, num_experts=16, top_k=4,
                router="sqrtsoftplus", routed_scaling_factor=1.5, num_moe_layers=3,
                hash_layers=(0, 2), vocab_size=1000)


def _v4_hash_gate(logits, tid2eid, token_ids, scale):
    """model.py Gate.forward for a hash layer, float64."""
    s = torch.nn.functional.softplus(logits.double()).sqrt()
    ids = tid2eid[token_ids].long()
    w = s.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True) * scale


def test_hash_routing_takes_the_tables_experts_and_their_scores(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(40, 16, generator=g) * 3
    table = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(1000)]).int()
    tok = torch.randint(0, 1000, (40,), generator=g)
    want_ids, want_w = _v4_hash_gate(logits, table, tok, 1.5)
    ref_ids, ref_w = reference_hash_route(logits, CFG, table, tok)
    assert torch.equal(ref_ids, want_ids)
    torch.testing.assert_close(ref_w, want_w, rtol=1e-12, atol=0)
    got = hash_route(logits, CFG, table, tok)
    assert torch.equal(got.topk_ids_TK.long(), want_ids) and got.topk_ids_TK.dtype == torch.int32
    torch.testing.assert_close(got.topk_weights_TK.double(), want_w, rtol=1e-5, atol=1e-6)
    top = route(logits, CFG)  # the same scores ranked instead: other experts, in general
    assert not torch.equal(top.topk_ids_TK.long().sort(1).values, want_ids.sort(1).values)
    with pytest.raises(ValueError, match=r"tid2eid must be \[vocab, top_k=4\]"):
        hash_route(logits, CFG, table[:, :3], tok)
    with pytest.raises(ValueError, match=r"token ids must be \[T=40\]"):
        hash_route(logits, CFG, table, tok[:5])


def test_the_reference_scores_large_logits_without_overflow():
    """softplus of a logit past exp's range is the logit (the oracle once gave inf there)."""
    cfg = CFG.replace(hash_layers=(), vocab_size=0)
    logits = torch.tensor([[900.0, 800.0, -900.0] + [0.0] * 13])
    ids, w = reference_route(logits, cfg)
    assert ids[0, :2].tolist() == [0, 1] and torch.isfinite(w).all()
    s = [900 ** 0.5, 800 ** 0.5, math.log(2) ** 0.5, math.log(2) ** 0.5]  # the top 4 scores
    torch.testing.assert_close(w[0], torch.tensor(s, dtype=torch.float64) / sum(s) * 1.5,
                               rtol=1e-12, atol=0)


def test_the_synthetic_table_holds_distinct_experts_the_same_on_every_build():
    from epmoe.weights import synthetic_hash_table, synthetic_layer

    t = synthetic_hash_table(CFG, 0, 7)
    assert t.shape == (1000, 4) and t.dtype == torch.int32
    assert int(t.min()) >= 0 and int(t.max()) < 16
    assert all(len(set(row.tolist())) == 4 for row in t)
    assert torch.equal(t, synthetic_hash_table(CFG, 0, 7))
    assert not torch.equal(t, synthetic_hash_table(CFG, 2, 7))
    load = torch.bincount(t.flatten().long(), minlength=16).double()
    assert load.max() / load.mean() < 1.25  # uniform token ids spread over every expert
    lw0, lw1 = (synthetic_layer(CFG, QuantConfig("bf16"), l, 7, [0]) for l in (0, 1))
    assert lw0.tid2eid_VK is not None and lw0.bias_E is None
    assert lw1.tid2eid_VK is None and lw1.bias_E is not None


def test_a_config_checks_its_hash_layers():
    with pytest.raises(ValueError, match="hash_layers .* below num_moe_layers"):
        CFG.replace(hash_layers=(3,))
    with pytest.raises(ValueError, match=r"vocab_size \(0\) must be >= 1"):
        CFG.replace(vocab_size=0)
    with pytest.raises(ValueError, match="distinct MoE layer indices"):
        CFG.replace(hash_layers=(0, 0))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [[], ["--ep", "2"], ["--ep", "2", "--no-dp"]],
                         ids=["one-rank", "ep2-own-rows", "ep2-replicated"])
def test_hash_layers_launch_against_the_oracle(tmp_path, extra):
    """A V4 config whose layers 0 and 2 route by token id: every layer passes the oracle
    and every router (the hash layers' by the float64 table lookup on the token ids each
    layer saw), whether a rank holds its own rows or the batch every rank holds."""
    folder = config_folder(tmp_path, "Tiny-V4-hash", dict(
        V4, hidden_size=256, moe_intermediate_size=128, n_routed_experts=16,
        num_experts_per_tok=4, num_hidden_layers=3, vocab_size=5000,
        mlp_layer_types=["hash_moe", "moe", "hash_moe"]))
    rc, s = launch_in_process(tmp_path, ["--model", str(folder)], *extra)
    assert rc == 0 and s["correctness"]["passed"] is True, (extra, s["correctness"])
    assert len(s["correctness"]["per_layer"]) == 3
    assert s["correctness"]["router"]["agreement"] == 1.0


def test_the_router_check_sees_a_hash_layer_routed_by_other_token_ids():
    """The oracle's router check fails when the ids a hash layer used are not its table's
    rows for the token ids it was given."""
    from epmoe.launch.report import check_router
    from epmoe.weights import layer_to_oracle, synthetic_layer

    lw = synthetic_layer(CFG, QuantConfig("bf16"), 0, 3, range(16))
    o = layer_to_oracle(lw)
    x = torch.randn(32, 64)
    tok = torch.randint(0, 1000, (32,))
    r = hash_route(x.float() @ lw.gate_ED.T, CFG, lw.tid2eid_VK, tok)
    good = check_router(x, r.topk_ids_TK, r.topk_weights_TK, o, CFG, tok)
    assert good["agreement"] == 1.0 and good["weight_rel_err"] < 1e-5
    bad = check_router(x, r.topk_ids_TK, r.topk_weights_TK, o, CFG, (tok + 1) % 1000)
    assert bad["agreement"] < 0.5


def _hash_rank(rank, world, group, run):
    from epmoe.runtime import Runtime

    rt = Runtime(run, rank=rank, group=group, device="cpu")
    rt.step(0)
    rt.step(1)
    return rt.report()


@pytest.mark.timeout(200)
def test_a_mixed_stack_gives_each_hash_layer_the_token_ids_of_its_rows():
    """ep_dp -> tp -> ep_dp on 2 ranks, hash layers 1 (the gathered batch) and 2 (own rows
    again): the token ids follow the rows through both relayouts (the oracle's router check
    on each layer's rows and ids), and every layer passes the oracle."""
    from epmoe.launch.report import check_correctness
    from epmoe.plan.forms import LayerSpec
    from epmoe.plan.run import RunConfig
    from epmoe.ranks import run_ranks

    cfg = CFG.replace(hash_layers=(1, 2))
    stack = (LayerSpec("ep_dp", "all2all", "torch"), LayerSpec("tp", "local", "torch"),
             LayerSpec("ep_dp", "allgather", "torch"))
    run = RunConfig(model="hash", model_config=cfg, world=2, tokens=12, layers=3, steps=2,
                    seed=4, stack=stack)
    reports = run_ranks(_hash_rank, 2, run, timeout=150.0)
    assert [r["last"][1]["tok"].shape[0] for r in reports] == [24, 24]
    assert torch.equal(reports[0]["last"][1]["tok"], reports[1]["last"][1]["tok"])
    assert torch.equal(torch.cat([r["last"][2]["tok"] for r in reports]),
                       reports[0]["last"][1]["tok"])
    assert reports[0]["last"][0]["tok"] is None
    res = check_correctness(run, reports)
    assert res["passed"] is True and res["router"]["agreement"] == 1.0, res
