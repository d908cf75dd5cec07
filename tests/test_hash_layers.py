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
    from epmoe.launch.oracle import check_router
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
    from epmoe.launch.oracle import check_correctness
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


# ----------------------------------------------------------- the Triton kernel's hash mode
HASH_KINDS = {"sqrtsoftplus": {}, "softmax": dict(router="softmax"),
              "sigmoid_no_renorm": dict(router="sigmoid_grouped", renormalize=False),
              "softmax_biased_eps": dict(router="softmax_biased", renorm_eps=0.25)}


def _hash_case(kind: str, seed: int, t: int = 40):
    cfg = CFG.replace(**HASH_KINDS[kind])
    g = torch.Generator().manual_seed(seed)
    table = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(1000)]).int()
    tok = torch.randint(0, 1000, (t,), generator=g)
    return cfg, g, table, tok


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", sorted(HASH_KINDS))
def test_the_kernels_hash_mode_takes_the_tables_experts_and_their_scores(kind, seed):
    """Given logits (the kernel's unfused read) and the bf16 gate GEMM split and fused (D =
    200: the fused K loop's masked tail), against the float64 oracle: the table's ids exactly,
    weights within 1e-5 (against the float64 product of the same bf16 values)."""
    from epmoe.kernels.gate_topk import triton_hash_route
    from epmoe.router import hash_gate_route

    cfg, g, table, tok = _hash_case(kind, seed)
    logits = torch.randn(40, 16, generator=g) * 3
    want_ids, want_w = reference_hash_route(logits.double(), cfg, table, tok)
    got = hash_route(logits, cfg, table, tok, id_dtype=torch.int64, backend="triton")
    assert got.topk_ids_TK.dtype == torch.int64 and torch.equal(got.topk_ids_TK, want_ids)
    torch.testing.assert_close(got.topk_weights_TK.double(), want_w, rtol=1e-5, atol=1e-6)
    x = torch.randn(40, 200, generator=g).to(torch.bfloat16)
    gate = (torch.randn(16, 200, generator=g) / 200 ** 0.5 * 3).to(torch.bfloat16)
    want_ids, want_w = reference_hash_route(x.double() @ gate.double().T, cfg, table, tok)
    got = hash_gate_route(x, gate, cfg, table, tok, backend="triton")  # 40 tokens: split
    assert got.topk_ids_TK.dtype == torch.int32
    assert torch.equal(got.topk_ids_TK.long(), want_ids)
    torch.testing.assert_close(got.topk_weights_TK.double(), want_w, rtol=1e-5, atol=1e-6)
    ids, w = triton_hash_route(x, gate, table, tok, cfg, way="fused")
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w.double(), want_w, rtol=1e-5, atol=1e-6)
    torch_path = hash_gate_route(x, gate, cfg, table, tok, backend="torch")
    assert torch.equal(torch_path.topk_ids_TK.long(), want_ids)


@pytest.mark.interpreter
def test_the_kernels_hash_mode_marks_a_token_id_outside_the_table():
    """An id past the vocabulary (or negative) reads nothing outside the table: expert 0 at
    weight NaN, which no later check can miss; the other rows are unaffected."""
    cfg, g, table, tok = _hash_case("sqrtsoftplus", 0, t=8)
    tok[2], tok[5] = 1000, -3
    logits = torch.randn(8, 16, generator=g)
    got = hash_route(logits, cfg, table, tok, backend="triton")
    bad = torch.zeros(8, dtype=torch.bool)
    bad[[2, 5]] = True
    assert torch.isnan(got.topk_weights_TK[bad]).all() and (got.topk_ids_TK[bad] == 0).all()
    ok_ids, ok_w = reference_hash_route(logits[~bad].double(), cfg, table, tok[~bad])
    assert torch.equal(got.topk_ids_TK[~bad].long(), ok_ids)
    torch.testing.assert_close(got.topk_weights_TK[~bad].double(), ok_w, rtol=1e-5, atol=1e-6)


def test_hash_routing_refuses_bad_inputs_before_any_kernel():
    from epmoe.router import hash_gate_route

    cfg, g, table, tok = _hash_case("sqrtsoftplus", 0, t=8)
    x, gate = torch.randn(8, 64), torch.randn(16, 64)
    with pytest.raises(ValueError, match="must be integers"):
        hash_gate_route(x, gate, cfg, table, tok.float())
    with pytest.raises(ValueError, match=r"token ids must be \[T=8\]"):
        hash_gate_route(x, gate, cfg, table, tok[:3])
    with pytest.raises(ValueError, match=r"gate has 15 rows but num_experts is 16"):
        hash_gate_route(x, gate[:15], cfg, table, tok)
    with pytest.raises(ValueError, match="id_dtype must be"):
        hash_gate_route(x, gate, cfg, table, tok, id_dtype=torch.int16)


@pytest.mark.gpu
def test_the_fused_hash_route_at_deepseek_v4_flash_shape(seed):
    """4096 tokens, hidden 4096, 256 experts, top-6 (V4-Flash's hash layers) on CUDA: the
    fused launch against the float64 oracle on the product of the same bf16 values."""
    from epmoe.router import hash_gate_route

    cfg = MoEConfig("v4f", hidden=4096, moe_intermediate=2048, num_experts=256, top_k=6,
                    router="sqrtsoftplus", routed_scaling_factor=1.5, num_moe_layers=1,
                    hash_layers=(0,), vocab_size=129280)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(4096, 4096, device="cuda", generator=g).to(torch.bfloat16)
    gate = (torch.randn(256, 4096, device="cuda", generator=g) / 64).to(torch.bfloat16)
    table = torch.stack([torch.randperm(256, device="cuda", generator=g)[:6]
                         for _ in range(512)]).int()
    tok = torch.randint(0, 512, (4096,), device="cuda", generator=g)
    got = hash_gate_route(x, gate, cfg, table, tok)
    ids, w = reference_hash_route((x.double() @ gate.double().T).cpu(), cfg, table.cpu(),
                                  tok.cpu())
    assert torch.equal(got.topk_ids_TK.long().cpu(), ids)
    torch.testing.assert_close(got.topk_weights_TK.double().cpu(), w, rtol=1e-5, atol=1e-6)
