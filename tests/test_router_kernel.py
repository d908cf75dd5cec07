"""The Triton routing kernel (backend='triton'; the CPU interpreter here, compiled where
marked gpu) against the torch path and the float64 logits: every router kind, the split
(gate GEMM, then the kernel on logits) and fused ways, ties, tokens per program."""

import pytest
import torch

from epmoe.config import MoEConfig
from epmoe.reference import reference_route
from epmoe.router import Routing, group_best, route, route_tokens
from tests.route_util import ROUTERS

# --------------------------------------------------------------------- Triton router kernel
# The kernel (backend='triton'; the CPU interpreter here) against the torch path. Ids are
# compared on tokens whose decisions have a margin: every two biased scores, and every two
# group scores, at least MARGIN apart in float64 (the kernel's fast exp / sigmoid and the
# fp32 accumulation of the fused GEMM move scores by ~1e-6); at least 90% of tokens qualify.
MARGIN = 1e-4
KERNEL_CASES = {**ROUTERS,
                "dsv3_like": dict(router="sigmoid_grouped", n_group=8, topk_group=4,
                                  routed_scaling_factor=2.5, num_experts=64, top_k=6),
                "softmax_odd_e": dict(router="softmax", num_experts=24, top_k=3),
                # DeepSeek-V2's group_limited_greedy: groups ranked by their best logit; 40
                # experts in 8 groups of 5 (no power of two: the kernel's group-by-group path)
                "v2_groups_odd_e": dict(router="softmax", n_group=8, topk_group=3,
                                        num_experts=40, top_k=6, renormalize=False,
                                        routed_scaling_factor=16.0),
                "v2_groups": dict(router="softmax", n_group=4, topk_group=2, num_experts=32,
                                  top_k=4),
                "sigmoid_groups_odd_e": dict(router="sigmoid_grouped", n_group=4,
                                             topk_group=2, num_experts=48, top_k=6),
                # LFM2-MoE's / (sum + eps), at an eps the 1e-5 comparison tells apart
                "renorm_eps": dict(router="sigmoid_grouped", renorm_eps=0.25,
                                   routed_scaling_factor=1.5)}


def _kcfg(kind: str) -> MoEConfig:
    kw = dict(KERNEL_CASES[kind])
    e, k = kw.pop("num_experts", 16), kw.pop("top_k", 4)
    return MoEConfig(kind, hidden=128, moe_intermediate=128, num_experts=e, top_k=k, **kw)


def _separated(logits64, cfg, bias):
    """Tokens whose two decisions have a margin: the topk_group-th vs the next group score,
    and the top_k-th vs the next biased score among the kept groups (float64)."""
    lg = logits64.double()
    if cfg.router == "softmax":
        b = lg
    else:
        s = torch.sigmoid(lg) if cfg.router == "sigmoid_grouped" else \
            torch.softmax(lg, -1) if cfg.router == "softmax_biased" else \
            torch.sqrt(torch.nn.functional.softplus(lg))
        b = s + (0 if bias is None else bias.double())
    ok = torch.ones(b.shape[0], dtype=torch.bool)
    if cfg.n_group > 1:
        g = b.view(b.shape[0], cfg.n_group, -1).topk(group_best(cfg), -1).values.sum(-1)
        gs, gi = g.sort(-1, descending=True)
        ok &= gs[:, cfg.topk_group - 1] - gs[:, cfg.topk_group] > MARGIN
        keep = torch.zeros_like(g, dtype=torch.bool).scatter_(1, gi[:, :cfg.topk_group], True)
        b = b.masked_fill(~keep.repeat_interleave(b.shape[1] // cfg.n_group, 1), -1e9)
    sb = b.sort(-1, descending=True).values
    return ok & (sb[:, cfg.top_k - 1] - sb[:, cfg.top_k] > MARGIN)


def _compare_routings(got, want, ok, tol):
    """The same experts for every well-separated token, each weight within tol: absolute up to
    a weight of 1, relative above (a routed_scaling_factor scales a weight and its error
    alike: DeepSeek-V2's 16 puts a top weight near 5)."""
    assert float(ok.float().mean()) >= 0.9, "too few well-separated tokens to compare"
    gi, gw = got.topk_ids_TK.long().cpu(), got.topk_weights_TK.cpu()
    wi, ww = want.topk_ids_TK.long().cpu(), want.topk_weights_TK.cpu()
    for n in ok.nonzero().flatten().tolist():
        g, w = dict(zip(gi[n].tolist(), gw[n].tolist())), dict(zip(wi[n].tolist(),
                                                                   ww[n].tolist()))
        assert set(g) == set(w), f"token {n}: {sorted(g)} != {sorted(w)}"
        assert all(abs(g[e] - w[e]) <= tol * max(1.0, abs(w[e])) for e in g), \
            f"token {n}: {g} vs {w}"


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", sorted(KERNEL_CASES))
def test_triton_route_logits_matches_torch(kind, seed):
    cfg = _kcfg(kind)
    t = 40
    logits = torch.randn(t, cfg.num_experts) * 2
    bias = None if cfg.router == "softmax" else torch.randn(cfg.num_experts) * 0.1
    got = route(logits, cfg, bias, backend="triton")
    assert got.topk_ids_TK.dtype == torch.int32 and got.topk_weights_TK.dtype == torch.float32
    want = route(logits, cfg, bias, backend="torch")
    _compare_routings(got, want, _separated(logits, cfg, bias), 1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("way", ["split", "fused"])
@pytest.mark.parametrize("kind", ["sigmoid_grouped", "dsv3_like", "softmax_renorm",
                                  "sqrtsoftplus", "softmax_biased", "v2_groups_odd_e",
                                  "renorm_eps"])
def test_gate_route_matches_float64_logits(kind, way, seed):
    """The bf16 gate GEMM (fp32 accumulation) split from the routing kernel (the default at
    40 tokens) or fused into it, against the float64 product of the same bf16 values, routed
    by the torch path; weights within 1e-5 of the float64 oracle."""
    from epmoe.kernels.gate_topk import gate_way, triton_gate_route

    cfg = _kcfg(kind)
    t, d = 40, 200  # D not a multiple of the fused K step: the masked tail
    x = torch.randn(t, d).to(torch.bfloat16)
    gate = (torch.randn(cfg.num_experts, d) / d ** 0.5 * 3).to(torch.bfloat16)
    bias = None if cfg.router == "softmax" else torch.randn(cfg.num_experts) * 0.1
    logits64 = x.double() @ gate.double().T
    if way == "split":
        assert gate_way(cfg.num_experts, t) == "split"
        got = route_tokens(x, gate, cfg, bias, id_dtype=torch.int64, backend="triton")
    else:
        ids, w = triton_gate_route(x, gate, cfg, bias, way="fused")
        got = Routing(ids.long(), w)
    assert got.topk_ids_TK.dtype == torch.int64
    ok = _separated(logits64, cfg, bias)
    _compare_routings(got, route(logits64.float(), cfg, bias, backend="torch"), ok, 1e-4)
    ref_ids, ref_w = reference_route(logits64, cfg, bias)
    _compare_routings(got, type(got)(ref_ids, ref_w.float()), ok, 1e-5)


def _first_on_ties(sel64, cfg):
    """The kernel's selection rule written out: groups ranked by the sum of their
    group_best(cfg) best entries, experts by their value, both the first index on ties
    (stable sorts); ids in the order chosen."""
    sel = sel64.clone()
    if cfg.n_group > 1:
        g = sel.view(sel.shape[0], cfg.n_group, -1)
        gs = g.sort(dim=-1, descending=True, stable=True).values[..., :group_best(cfg)].sum(-1)
        keep = gs.sort(dim=-1, descending=True, stable=True).indices[:, :cfg.topk_group]
        mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
        sel = sel.masked_fill(~mask.repeat_interleave(g.shape[-1], 1), float("-inf"))
    return sel.sort(dim=-1, descending=True, stable=True).indices[:, :cfg.top_k]


@pytest.mark.interpreter
@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("kind", ["softmax_plain", "v2_groups", "v2_groups_odd_e",
                                  "sigmoid_grouped", "sigmoid_groups_odd_e"])
def test_triton_router_ties_pick_the_first_index(kind, block_m, seed):
    """Exact ties everywhere (integer logits): the kernel's packed (value, index) keys pick
    the lowest index among equal experts and equal groups, in the order chosen, with
    negative values, -0.0 / +0.0 and -inf ordered as floats are (the softmax router selects
    on the logits themselves); one token a program or 16."""
    from epmoe.kernels.gate_topk import RouterConfig, triton_route_logits

    cfg = _kcfg(kind)
    g = torch.Generator().manual_seed(seed)
    t = 40
    if cfg.router == "softmax":
        logits = torch.randint(-3, 4, (t, cfg.num_experts), generator=g).float()
        logits[0, :] = 0.0  # a row of ties, -0.0 among +0.0: the first top_k indices
        logits[0, ::3] = -0.0
        logits[1, ::2] = float("-inf")
        sel = logits.double()
    else:  # sigmoid of 0..3: every pair's sum differs, so group ties are exact ties
        logits = torch.randint(0, 4, (t, cfg.num_experts), generator=g).float()
        sel = torch.sigmoid(logits.double())
    ids, _ = triton_route_logits(logits, cfg, config=RouterConfig(block_m, 64, 2, 1))
    want = _first_on_ties(sel, cfg)
    assert torch.equal(ids.long(), want), f"{ids} vs {want}"
    if cfg.router == "softmax" and cfg.n_group == 1:  # row 0: all zeros, -0.0 at 0, 3, ...
        assert ids[0].tolist() == list(range(cfg.top_k))


@pytest.mark.interpreter
@pytest.mark.parametrize("block_m,warps", [(1, 1), (4, 2), (32, 8)])
@pytest.mark.parametrize("kind", ["dsv3_like", "v2_groups_odd_e", "softmax_renorm",
                                  "renorm_eps"])
def test_route_logits_at_any_tokens_per_program(kind, block_m, warps, seed):
    """The routing kernel on logits at the tuner's candidate shapes (`router_tune`'s
    logits_candidates): 1, 4 or 32 tokens a program, 40 tokens (a ragged last program),
    against the torch path; weights within 1e-5."""
    from epmoe.kernels.gate_topk import RouterConfig, triton_route_logits

    cfg = _kcfg(kind)
    logits = torch.randn(40, cfg.num_experts) * 2
    bias = None if cfg.router == "softmax" else torch.randn(cfg.num_experts) * 0.1
    ids, w = triton_route_logits(logits, cfg, bias, config=RouterConfig(block_m, 64, warps, 1))
    want = route(logits, cfg, bias, backend="torch")
    _compare_routings(Routing(ids, w), want, _separated(logits, cfg, bias), 1e-5)


def test_triton_router_refusals_and_fallback():
    cfg = MoEConfig("g", hidden=64, moe_intermediate=64, num_experts=1024, top_k=2,
                    router="sigmoid_grouped", n_group=4, topk_group=2)
    with pytest.raises(ValueError, match=r"num_experts \(1024\) > 512"):
        route(torch.randn(4, 1024), cfg, backend="triton")
    cfg = cfg.replace(num_experts=24)
    logits = torch.randn(4, 24)
    with pytest.raises(ValueError, match=r"backend \('cuda'\) must be"):
        route(logits, cfg, backend="cuda")
    from epmoe.kernels.gate_topk import RouterConfig, triton_route_logits
    with pytest.raises(ValueError, match=r"block_m \(3\) must be a power of two"):
        triton_route_logits(logits, cfg, config=RouterConfig(3, 64, 1, 1))
    r = route_tokens(torch.randn(4, 64), torch.randn(24, 64), cfg)  # CPU: the torch path
    assert r.topk_ids_TK.shape == (4, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("way", ["split", "fused"])
def test_gate_route_at_deepseek_shape(way, seed):
    """4096 tokens x 256 experts x hidden 7168 (DeepSeek-V3 routing) on CUDA, split (cuBLAS's
    fp32 logits, the default) and fused: against the torch router on the float64 product of
    the same bf16 values."""
    from epmoe.kernels.gate_topk import triton_gate_route

    cfg = MoEConfig("dsv3", hidden=7168, moe_intermediate=2048, num_experts=256, top_k=8,
                    router="sigmoid_grouped", n_group=8, topk_group=4,
                    routed_scaling_factor=2.5)
    x = torch.randn(4096, 7168, device="cuda").to(torch.bfloat16)
    gate = (torch.randn(256, 7168, device="cuda") / 7168 ** 0.5).to(torch.bfloat16)
    bias = torch.randn(256, device="cuda") * 0.01
    got = route_tokens(x, gate, cfg, bias) if way == "split" else \
        Routing(*triton_gate_route(x, gate, cfg, bias, way="fused"))
    logits64 = x.double() @ gate.double().T
    want = route(logits64.float(), cfg, bias, backend="torch")
    _compare_routings(got, want, _separated(logits64.cpu(), cfg, bias.cpu()), 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v2", "lfm2"])
def test_fused_gate_route_groups_and_eps_on_cuda(kind, seed):
    """DeepSeek-V2's shape (160 experts in 8 groups, hidden 5120, groups ranked by their best
    logit) and LFM2-MoE's (32 experts, hidden 2048, / (sum + 1e-6)) through the fused kernel
    on CUDA, against the torch router on the float64 product of the same bf16 values."""
    if kind == "v2":
        cfg = MoEConfig("v2", hidden=5120, moe_intermediate=1536, num_experts=160, top_k=6,
                        router="softmax", n_group=8, topk_group=3, renormalize=False,
                        routed_scaling_factor=16.0)
    else:
        cfg = MoEConfig("lfm2", hidden=2048, moe_intermediate=1792, num_experts=32, top_k=4,
                        router="sigmoid_grouped", renorm_eps=1e-6)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(2048, cfg.hidden, device="cuda", generator=g).to(torch.bfloat16)
    gate = (torch.randn(cfg.num_experts, cfg.hidden, device="cuda", generator=g)
            / cfg.hidden ** 0.5).to(torch.bfloat16)
    bias = None if cfg.router == "softmax" else \
        torch.randn(cfg.num_experts, device="cuda", generator=g) * 0.01
    got = route_tokens(x, gate, cfg, bias)
    logits64 = x.double() @ gate.double().T
    want = route(logits64.float(), cfg, bias, backend="torch")
    _compare_routings(got, want, _separated(logits64.cpu(), cfg, None if bias is None
                                            else bias.cpu()), 1e-4)
