"""TorchExperts against the float64 oracle, every recipe x router x layout x activation.

Contiguous: `Experts.apply` (make_layout, permute, run_contiguous, unpermute_reduce).
Masked: make_masked_layout, scatter_masked, run_masked, gather_masked_reduce, with the rows past
each expert's count poisoned (NaN) on the way in and on the way out.
Tolerance: reference.TOLERANCE[recipe] on max|out - ref| / max|ref|, each |out - ref| less
its rounding slack (reference.rounding_slack: what GEMM1's fp32 sum rounding h to the other bf16
neighbour can move it by).
"""

import functools
import os
import random

import pytest
import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import activation
from epmoe.experts.torch_experts import TorchExperts
from epmoe.layout import gather_masked_reduce, make_masked_layout, scatter_masked
from epmoe.quant import FP8_DTYPE, QTensor, quantize_act
from epmoe.reference import TOLERANCE, max_rel_err, reference_moe, rounding_slack
from epmoe.router import route
from epmoe.weights import layer_to_oracle, synthetic_layer

D, I, E, K, T = 128, 128, 16, 4, 24
# fresh per session, printed in every message; EPMOE_TEST_WEIGHT_SEED=N replays one
WEIGHT_SEED = int(os.environ.get("EPMOE_TEST_WEIGHT_SEED") or random.randrange(1 << 30))

RECIPES = {"bf16": ("bf16", "fp32"), "fp8_block": ("fp8_block", "fp32"),
           "mxfp8": ("mxfp8", "fp32"), "w4a8_mxfp4": ("w4a8_mxfp4", "fp32"),
           "fp8_block_ue8m0": ("fp8_block", "ue8m0_fp32")}
ROUTERS = {
    "softmax_renorm": dict(router="softmax", renormalize=True),
    "softmax_plain": dict(router="softmax", renormalize=False),
    "sigmoid_grouped": dict(router="sigmoid_grouped", n_group=4, topk_group=2,
                            routed_scaling_factor=2.5),
    "sigmoid_kimi": dict(router="sigmoid_grouped", n_group=1, routed_scaling_factor=2.827),
    "sqrtsoftplus": dict(router="sqrtsoftplus", routed_scaling_factor=1.5),
    "softmax_biased": dict(router="softmax_biased"),
}
# (config fields, input scale): clamped activations get inputs large enough to hit the clamp
# (h ~ N(0, scale^2)), but not so large that whole groups saturate: when a group's amax comes
# from a clamped element too, a/amax is an exact ratio of bf16 values that often lands on an
# fp8 rounding tie, and fp32 vs float64 then pick different codes (both correct).
ACTIVATIONS = {
    "swiglu": (dict(activation="swiglu"), 1.0),
    "swiglu_clamp": (dict(activation="swiglu", swiglu_limit=7.0), 2.5),
    "swigluoai": (dict(activation="swigluoai", activation_alpha=1.702, swiglu_limit=7.0), 2.5),
}


def _cfg(router="softmax_renorm", act="swiglu", **kw) -> MoEConfig:
    return MoEConfig("t", hidden=D, moe_intermediate=I, num_experts=E, top_k=K,
                     **{**ROUTERS[router], **ACTIVATIONS[act][0], **kw})


@functools.lru_cache(maxsize=None)
def _weights(recipe: str, with_bias: bool):
    """Quantized weights of all E experts (independent of router/activation), and the oracle."""
    quant = QuantConfig(*RECIPES[recipe])
    cfg = _cfg("sigmoid_kimi" if with_bias else "softmax_renorm")
    lw = synthetic_layer(cfg, quant, 0, WEIGHT_SEED, range(E), with_shared=False)
    return quant, lw, layer_to_oracle(lw)


def _inputs(cfg, lw, seed, scale=1.0, t=T):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, D, generator=g) * scale).to(torch.bfloat16)
    r = route(x.float() @ lw.gate_ED.T, cfg, lw.bias_E)
    return x, r.topk_ids_TK, r.topk_weights_TK


def _poison_past_counts(q: QTensor, counts_E: torch.Tensor) -> QTensor:
    """NaN in every row past an expert's count (data and scale): those rows must not be read."""
    past = torch.arange(q.data.shape[1])[None, :] >= counts_E.long()[:, None]
    data = q.data.clone()
    if data.dtype == FP8_DTYPE:
        data.view(torch.uint8)[past] = 0x7F  # e4m3fn NaN
    else:
        data[past] = float("nan")
    scale = None
    if q.scale is not None:
        scale = q.scale.clone()
        scale[past] = 255 if scale.dtype == torch.uint8 else float("nan")  # e8m0 255 = NaN
    return QTensor(data, scale, q.recipe, q.group, q.scale_fmt)


def run_masked_path(experts, xq: QTensor, ids, w, capacity):
    lay = make_masked_layout(ids, experts.weights.num_experts, capacity)
    scale = None if xq.scale is None else scatter_masked(xq.scale, lay)
    x_ecd = QTensor(scatter_masked(xq.data, lay), scale, xq.recipe, xq.group, xq.scale_fmt)
    x_ecd = _poison_past_counts(x_ecd, lay.counts_E)
    y = experts.run_masked(x_ecd, lay.counts_E)
    assert y.shape == (lay.num_experts, capacity, D) and y.dtype == torch.bfloat16
    past = torch.arange(capacity)[None, :] >= lay.counts_E.long()[:, None]
    assert not y[~past].isnan().any(), "valid rows hold NaN: rows past a count leaked in"
    y = y.clone()
    y[past] = float("nan")  # the combine must not read them either
    return gather_masked_reduce(y, lay, w, out_dtype=torch.float32)


def _run(experts, xq, ids, w, layout):
    if layout == "contiguous":
        return experts.apply(xq, ids, w)
    return run_masked_path(experts, xq, ids, w, capacity=ids.shape[0])


def _check(out, oracle_args, recipe, msg):
    """oracle_args: (x, oracle, cfg, quant, ids, weights) as `reference_moe` takes them."""
    assert not out.isnan().any(), f"NaN in output; {msg}"
    ref = reference_moe(*oracle_args)
    err = max_rel_err(out, ref, rounding_slack(*oracle_args))
    assert err <= TOLERANCE[RECIPES[recipe][0]], \
        f"rel err {err:.2e} past the rounding slack ({max_rel_err(out, ref):.2e} raw); {msg}"
    return ref


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_experts_match_oracle(recipe, router, act, layout, seed):
    cfg = _cfg(router, act)
    quant, lw, oracle = _weights(recipe, cfg.router != "softmax")
    experts = TorchExperts(lw.experts, cfg, quant)
    x, ids, w = _inputs(cfg, lw, seed, scale=ACTIVATIONS[act][1])
    out = _run(experts, quantize_act(x, quant), ids, w, layout)
    assert out.shape == (T, D)
    msg = f"{recipe=} {router=} {act=} {layout=} {seed=} {WEIGHT_SEED=}"
    _check(out, (x, oracle, cfg, quant, ids, w), recipe, msg)
    if cfg.swiglu_limit is not None:  # the case must actually exercise the clamp
        h = torch.einsum("td,efd->tef", x.double(), oracle[2])
        assert (h.abs() > cfg.swiglu_limit).any(), f"clamp never reached; {msg}"


@pytest.mark.parametrize("act", ["swiglu_clamp", "swigluoai"])
def test_clamp_and_alpha_matter(act, seed):
    """The activation variants differ measurably at this input scale (the matrix can fail)."""
    cfg = _cfg("softmax_renorm", act)
    quant, lw, oracle = _weights("bf16", False)
    x, ids, w = _inputs(cfg, lw, seed, scale=4.0)
    out = TorchExperts(lw.experts, cfg, quant).apply(quantize_act(x, quant), ids, w)
    wrong = reference_moe(x, oracle, cfg.replace(swiglu_limit=None), quant, ids, w)
    assert max_rel_err(out, wrong) > 5 * TOLERANCE["bf16"], f"{seed=}"


def test_activation_definitions():
    h = torch.randn(5, 16) * 6
    g, u = h[:, :8], h[:, 8:]
    plain = _cfg(act="swiglu")
    torch.testing.assert_close(activation(h, plain), torch.nn.functional.silu(g) * u)
    clamp = _cfg(act="swiglu_clamp")
    gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    torch.testing.assert_close(activation(h, clamp), torch.nn.functional.silu(gc) * uc)
    oai = _cfg(act="swigluoai")
    torch.testing.assert_close(activation(h, oai), gc * torch.sigmoid(1.702 * gc) * (uc + 1))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_alignment_does_not_change_results(recipe, seed):
    cfg = _cfg("softmax_renorm")
    quant, lw, _ = _weights(recipe, False)
    experts = TorchExperts(lw.experts, cfg, quant)
    x, ids, w = _inputs(cfg, lw, seed)
    xq = quantize_act(x, quant)
    outs = [experts.apply(xq, ids, w, alignment=a) for a in (1, 16, 128)]
    for a, o in zip((16, 128), outs[1:]):
        assert torch.equal(o, outs[0]), f"alignment {a} differs from 1; {recipe=} {seed=}"


ROUTING_CASES = ("empty_experts", "one_expert", "empty_slots", "all_empty")


def _special_ids(case, t, g):
    if case == "empty_experts":  # experts 0..9 receive nothing
        ids = torch.stack([torch.randperm(6, generator=g)[:K] + 10 for _ in range(t)])
    elif case == "one_expert":  # every token on expert 5 (plus -1 elsewhere)
        ids = torch.full((t, K), -1)
        ids[:, 0] = 5
    elif case == "empty_slots":
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
        ids[torch.rand(t, K, generator=g) < 0.4] = -1
    else:
        ids = torch.full((t, K), -1)
    return ids.to(torch.int32)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("case", ROUTING_CASES)
@pytest.mark.parametrize("recipe", ["bf16", "fp8_block", "w4a8_mxfp4"])
def test_special_routings_match_oracle(recipe, case, layout, seed):
    cfg = _cfg("softmax_renorm")
    quant, lw, oracle = _weights(recipe, False)
    experts = TorchExperts(lw.experts, cfg, quant)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    ids = _special_ids(case, T, g)
    w = torch.rand(T, K, generator=g) + 0.1  # nonzero weights on -1 slots too: must be skipped
    out = _run(experts, quantize_act(x, quant), ids, w, layout)
    msg = f"{recipe=} {case=} {layout=} {seed=} {WEIGHT_SEED=}"
    if case == "all_empty":
        assert torch.equal(out, torch.zeros(T, D)), msg
        return
    _check(out, (x, oracle, cfg, quant, ids, w), recipe, msg)
    # rows whose slots are all -1 are exact zeros
    none = (ids < 0).all(-1)
    assert bool((out[none] == 0).all()), msg


def test_masked_capacity_larger_than_needed(seed):
    cfg = _cfg("softmax_renorm")
    quant, lw, oracle = _weights("fp8_block", False)
    experts = TorchExperts(lw.experts, cfg, quant)
    x, ids, w = _inputs(cfg, lw, seed)
    out = run_masked_path(experts, quantize_act(x, quant), ids, w, capacity=64)
    _check(out, (x, oracle, cfg, quant, ids, w), "fp8_block", f"{seed=}")


def test_subset_of_experts_with_local_ids(seed):
    """A rank holding global experts 8..15 sees local ids 0..7; -1 for the others."""
    cfg = _cfg("softmax_renorm")
    quant = QuantConfig("mxfp8")
    lw = synthetic_layer(cfg, quant, 0, WEIGHT_SEED, range(8, 16), with_shared=False)
    _, _, oracle = _weights("mxfp8", False)
    x, ids, w = _inputs(cfg, lw, seed)
    local = torch.where(ids >= 8, ids - 8, torch.full_like(ids, -1))
    out = TorchExperts(lw.experts, cfg, quant).apply(quantize_act(x, quant), local, w)
    only_here = torch.where(ids >= 8, ids, torch.full_like(ids, -1))
    _check(out, (x, oracle, cfg, quant, only_here, w), "mxfp8", f"{seed=} {WEIGHT_SEED=}")


def test_finer_alignment_than_gemm_refused():
    class Blocked(TorchExperts):
        @property
        def alignment(self):
            return 64

    cfg = _cfg()
    quant, lw, _ = _weights("bf16", False)
    with pytest.raises(ValueError, match=r"alignment \(16\) must be a multiple of torch's GEMM "
                                         r"alignment \(64\)"):
        Blocked(lw.experts, cfg, quant).make_layout(torch.zeros(2, K, dtype=torch.int32), 16)


def test_tolerance_widens_for_power_of_two_fp8_scales():
    from epmoe.reference import tolerance

    assert tolerance(QuantConfig("fp8_block")) == 2e-2
    assert tolerance(QuantConfig("fp8_block", "ue8m0_fp32")) == pytest.approx(3e-2)
    assert tolerance(QuantConfig("fp8_block", "ue8m0_packed")) == pytest.approx(3e-2)
    assert tolerance(QuantConfig("mxfp8")) == 2e-2 and tolerance(QuantConfig("w4a8_mxfp4")) == 3e-2
    assert tolerance(QuantConfig("bf16")) == 1e-2


def test_tolerance_widens_for_fp8_tensor_cores():
    """fp8 GEMMs on tensor cores: x1.5 on fp8_block only, times the power-of-two scales' x1.5
    (more flips, each up to twice as large)."""
    from epmoe.reference import tolerance

    assert tolerance(QuantConfig("fp8_block"), fp8_mma=True) == pytest.approx(3e-2)
    assert tolerance(QuantConfig("fp8_block", "ue8m0_fp32"), fp8_mma=True) == pytest.approx(4.5e-2)
    for recipe in ("bf16", "mxfp8", "w4a8_mxfp4"):
        assert tolerance(QuantConfig(recipe), fp8_mma=True) == tolerance(QuantConfig(recipe))
