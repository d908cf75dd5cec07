"""epmoe.router: `route` against the float64 `reference_route`, per router kind; ReplicaMap.

Ids are compared as sets per token (top-k order is not part of the contract), weights matched
by id within 1e-5 (fp32 vs float64 of O(1) values)."""

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.reference import reference_route
from epmoe.router import ReplicaMap, route
from tests.route_util import ROUTERS


def _cfg(kind: str, **kw) -> MoEConfig:
    return MoEConfig(kind, hidden=128, moe_intermediate=128, num_experts=16, top_k=4,
                     **{**ROUTERS[kind], **kw})


def _by_id(ids, w):
    return [dict(zip(i.tolist(), x.tolist())) for i, x in zip(ids, w)]


def _assert_matches_reference(r, logits, cfg, bias, seed):
    ref_ids, ref_w = reference_route(logits, cfg, bias)
    got, want = _by_id(r.topk_ids_TK, r.topk_weights_TK), _by_id(ref_ids, ref_w)
    for n, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), f"token {n}: ids {sorted(g)} != {sorted(w)} ({seed=})"
        for e in g:
            assert abs(g[e] - w[e]) <= 1e-5, f"token {n} expert {e}: {g[e]} vs {w[e]} ({seed=})"


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("kind", sorted(ROUTERS))
def test_route_matches_reference(kind, id_dtype, seed):
    cfg = _cfg(kind)
    t = 48
    logits = torch.randn(t, cfg.num_experts) * 2
    bias = None if cfg.router == "softmax" else torch.randn(cfg.num_experts) * 0.1
    r = route(logits, cfg, bias, id_dtype=id_dtype)
    assert r.topk_ids_TK.dtype == id_dtype and r.topk_ids_TK.shape == (t, cfg.top_k)
    assert r.topk_weights_TK.dtype == torch.float32
    _assert_matches_reference(r, logits, cfg, bias, seed)
    assert all(len(set(row.tolist())) == cfg.top_k for row in r.topk_ids_TK), f"{seed=}"


@pytest.mark.parametrize("kind", sorted(ROUTERS))
def test_bf16_logits_computed_in_fp32(kind, seed):
    cfg = _cfg(kind)
    logits = (torch.randn(16, cfg.num_experts) * 2).to(torch.bfloat16)
    bias = None if cfg.router == "softmax" else torch.randn(cfg.num_experts) * 0.1
    r = route(logits, cfg, bias)
    # bf16 logits tie often (8-bit mantissa), so compare with the fp32 upcast, not the oracle
    want = route(logits.float(), cfg, bias)
    assert r.topk_weights_TK.dtype == torch.float32
    assert torch.equal(r.topk_ids_TK, want.topk_ids_TK), f"{seed=}"
    assert torch.equal(r.topk_weights_TK, want.topk_weights_TK), f"{seed=}"


def test_renormalize_and_scaling_factor(seed):
    logits = torch.randn(32, 16)
    for kind in ("softmax_renorm", "sigmoid_grouped", "sigmoid_kimi", "sqrtsoftplus",
                 "softmax_biased"):
        cfg = _cfg(kind)
        s = route(logits, cfg).topk_weights_TK.sum(-1)
        torch.testing.assert_close(s, torch.full_like(s, cfg.routed_scaling_factor),
                                   msg=f"{kind} {seed=}")
    cfg = _cfg("softmax_plain")
    r = route(logits, cfg)
    probs = torch.softmax(logits, -1).gather(1, r.topk_ids_TK.long())
    torch.testing.assert_close(r.topk_weights_TK, probs)
    assert bool((r.topk_weights_TK.sum(-1) < 1).all()), f"{seed=}"
    # not renormalized, scaled: raw sigmoid scores times the factor
    cfg = _cfg("sigmoid_kimi", renormalize=False)
    r = route(logits, cfg)
    torch.testing.assert_close(r.topk_weights_TK,
                               torch.sigmoid(logits).gather(1, r.topk_ids_TK.long()) * 2.827)
    _assert_matches_reference(r, logits, cfg, None, seed)


def test_group_limit_respected(seed):
    cfg = _cfg("sigmoid_grouped")  # 4 groups of 4, keep 2
    logits = torch.randn(64, 16) * 3
    bias = torch.randn(16) * 0.1
    ids = route(logits, cfg, bias).topk_ids_TK.long()
    biased = torch.sigmoid(logits) + bias
    group_score = biased.view(64, 4, 4).topk(2, -1).values.sum(-1)
    kept = group_score.topk(2, -1).indices
    for n in range(64):
        groups = set((ids[n] // 4).tolist())
        assert groups <= set(kept[n].tolist()), f"token {n}: groups {groups} ({seed=})"
        assert len(groups) <= cfg.topk_group
    # a case where the global top-4 spans 4 groups: the limit must change the choice
    logits = torch.full((1, 16), -4.0)
    logits[0, [0, 4, 8, 12]] = 4.0      # one strong expert per group
    logits[0, [1, 5]] = 3.0             # groups 0 and 1 have the best top-2 sums
    ids = set(route(logits, cfg).topk_ids_TK[0].tolist())
    assert ids == {0, 1, 4, 5}


def test_bias_selects_but_does_not_weight():
    cfg = _cfg("sigmoid_kimi")
    logits = torch.zeros(1, 16)
    logits[0, :4] = 2.0  # experts 0..3 win without bias
    r0 = route(logits, cfg)
    assert set(r0.topk_ids_TK[0].tolist()) == {0, 1, 2, 3}
    bias = torch.zeros(16)
    bias[10] = 1.0  # expert 10 (sigmoid 0.5) now beats expert 3 (sigmoid 0.88) on biased score
    r = route(logits, cfg, bias)
    ids = r.topk_ids_TK[0].tolist()
    assert 10 in ids and set(ids) != {0, 1, 2, 3}
    w = dict(zip(ids, r.topk_weights_TK[0].tolist()))
    s = torch.sigmoid(logits[0])
    chosen = torch.tensor(ids)
    want = s[chosen] / s[chosen].sum() * cfg.routed_scaling_factor  # unbiased scores
    for e, x in zip(ids, want.tolist()):
        assert abs(w[e] - x) < 1e-6, (e, w[e], x)
    _assert_matches_reference(r, logits, cfg, bias, None)


def test_sqrtsoftplus_scores():
    cfg = _cfg("sqrtsoftplus", renormalize=False)
    logits = torch.randn(8, 16)
    r = route(logits, cfg)
    want = torch.sqrt(torch.nn.functional.softplus(logits)).gather(1, r.topk_ids_TK.long()) * 1.5
    torch.testing.assert_close(r.topk_weights_TK, want)


def test_int_logits_raise():
    with pytest.raises(ValueError, match=r"router logits must be floating point, got torch.int64"):
        route(torch.ones(4, 16, dtype=torch.long), _cfg("softmax_renorm"))


def test_bad_shapes_and_id_dtype_raise():
    cfg = _cfg("softmax_renorm")
    with pytest.raises(ValueError,
                       match=r"router logits must be \[T, num_experts=16\], got \(4, 8\)"):
        route(torch.randn(4, 8), cfg)
    with pytest.raises(ValueError, match=r"id_dtype must be torch.int32 or torch.int64"):
        route(torch.randn(4, 16), cfg, id_dtype=torch.int16)


# ------------------------------------------------------------------------------ ReplicaMap

@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_identity_replica_map_is_noop(dtype, seed):
    ids = torch.randint(-1, 16, (40, 4), dtype=dtype)
    out = ReplicaMap.identity(16).to_physical(ids, token_offset=seed % 1000)
    assert out.dtype == dtype
    assert torch.equal(out, ids), f"{seed=}"


def test_two_replica_map_spreads_evenly_and_deterministically():
    # 4 logical experts; expert 1 and 3 have a second replica at physical slots 4 and 5
    log2phy = torch.tensor([[0, -1], [1, 4], [2, -1], [3, 5]])
    cnt = torch.tensor([1, 2, 1, 2])
    rm = ReplicaMap(log2phy, cnt)
    ids = torch.tensor([[1, 3], [1, 3], [1, -1], [1, 0], [-1, 2], [1, 3]], dtype=torch.int32)
    phys = rm.to_physical(ids)
    assert phys.dtype == torch.int32
    assert torch.equal(phys, rm.to_physical(ids.clone())), "not deterministic"
    assert torch.equal(phys == -1, ids == -1), "-1 must stay -1 and nothing else become -1"
    for e, slots in ((0, {0}), (2, {2}), (1, {1, 4}), (3, {3, 5})):
        assert set(phys[ids == e].tolist()) <= slots
    # a large uniform batch: each replica of a 2-replica expert gets exactly half
    ids = torch.full((64, 1), 1, dtype=torch.long)
    phys = rm.to_physical(ids, token_offset=7)
    assert (phys == 1).sum() == 32 and (phys == 4).sum() == 32
    # the choice is a function of the global token index: offsets shift it
    assert torch.equal(rm.to_physical(ids[1:], token_offset=8), phys[1:])
    assert not torch.equal(rm.to_physical(ids, token_offset=0), rm.to_physical(ids, 1))
