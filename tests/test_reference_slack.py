"""reference.rounding_slack: the room an fp32 GEMM1 has to round h to the other bf16 neighbour.

The oracle rounds h = w13 @ x to bf16 from float64; an fp32 sum of the same products may round
an element the other way, and after the intermediate's quantization that one step can move a
code (or the group's amax) by far more than bf16 precision. The slack must cover every such
result (any summation order) and nothing else.
"""

import pytest
import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.quant import dequantize_act, quantize_act
from epmoe.reference import (TOLERANCE, _quantized_act, max_rel_err, reference_moe,
                             rounding_slack)
from epmoe.weights import layer_to_oracle, synthetic_layer

D, I, T = 128, 128, 256
RECIPES = ["bf16", "fp8_block", "mxfp8", "w4a8_mxfp4"]


def _one_expert(recipe, seed, limit=7.0):
    """A layer of one expert (top-1, weight 1): the layer's output is that expert's MLP."""
    cfg = MoEConfig("t", hidden=D, moe_intermediate=I, num_experts=1, top_k=1,
                    activation="swiglu", swiglu_limit=limit)
    quant = QuantConfig(recipe)
    lw = synthetic_layer(cfg, quant, 0, seed, range(1), with_shared=False)
    return cfg, quant, layer_to_oracle(lw)


def _fp32_expert(x_TD, oracle, cfg, quant, order):
    """The expert as an fp32 kernel would run it: GEMM1's exact products summed in fp32 in
    `order`, rounded to bf16; then the oracle's own activation, quantization and float64 GEMM2
    (so h's rounding is the only difference from the oracle). Also: how many elements of h
    rounded to another bf16 value than the oracle's."""
    w13, w2 = oracle.w13[0], oracle.w2[0]
    prods = (w13[None] * x_TD.double()[:, None]).float()  # [T, F, K]
    h = torch.zeros(prods.shape[:2])
    for k in order:
        h = h + prods[:, :, k]
    h = h.to(torch.bfloat16).double()
    flips = int((h != (x_TD.double() @ w13.T).to(torch.bfloat16).double()).sum())
    return _quantized_act(h, cfg, quant) @ w2.T, flips


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_fp32_order_stays_within_the_slack(recipe, seed):
    cfg, quant, oracle = _one_expert(recipe, seed)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=g) * 2.5).to(torch.bfloat16)
    xq = dequantize_act(quantize_act(x.float(), quant)) if recipe != "bf16" else x.float()
    ids, w = torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1)
    ref = reference_moe(x, oracle, cfg, quant, ids, w)
    slack = rounding_slack(x, oracle, cfg, quant, ids, w)
    assert (slack >= 0).all() and slack.isfinite().all()
    flipped = 0
    for order in (range(D), reversed(range(D)), torch.randperm(D, generator=g).tolist()):
        got, flips = _fp32_expert(xq, oracle, cfg, quant, list(order))
        flipped += flips
        diff = (got - ref).abs()
        m = ref.abs().max()
        assert (diff <= slack + 1e-12 * m).all(), \
            f"{recipe=} {seed=}: {(diff - slack).max() / m:.2e} of max|ref| past the slack"
    # mxfp8's products (fp8 x fp8, power-of-two scales) span few enough bits that fp32 sums
    # them exactly at this size: nothing to flip there; every other recipe flips some
    assert flipped or recipe == "mxfp8", \
        f"{recipe=} {seed=}: no fp32 order rounded any h the other way: the test is too weak"


def test_no_slack_where_no_bf16_boundary_is_near(seed):
    """h exactly representable in bf16 (one input element, bf16 weights): nothing to round."""
    cfg, quant, oracle = _one_expert("w4a8_mxfp4", seed)
    x = torch.zeros(4, D, dtype=torch.bfloat16)
    x[torch.arange(4), torch.arange(4) * 7] = 1.0  # h = one column of w13: fp4 x scale, exact
    ids, w = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
    assert torch.equal(rounding_slack(x, oracle, cfg, quant, ids, w), torch.zeros(4, D))


def test_a_flip_the_tolerance_alone_did_not_cover():
    """CI, 2026-12-07: the torch experts, w4a8_mxfp4, softmax router, swiglu_clamp, weight seed
    903696624, seed 919725040: 3.02e-2 of max|out| against a tolerance of 3e-2, all of it token
    20, whose batched fp32 GEMM1 rounded one h element of its 0.96-weight expert the other way
    (alone it is 2.0e-3 off). The slack gives that token 2.9e-2 and explains all but 3.1e-3 of
    it (whether this machine's BLAS makes the same flip or not)."""
    from test_experts_torch import E, T, _cfg, _inputs

    from epmoe.experts.torch_experts import TorchExperts

    cfg, quant = _cfg("softmax_renorm", "swiglu_clamp"), QuantConfig("w4a8_mxfp4")
    lw = synthetic_layer(_cfg(), quant, 0, 903696624, range(E), with_shared=False)
    oracle = layer_to_oracle(lw)
    torch.manual_seed(919725040)
    x, ids, w = _inputs(cfg, lw, 919725040, scale=2.5)
    out = TorchExperts(lw.experts, cfg, quant).apply(quantize_act(x, quant), ids, w)
    ref = reference_moe(x, oracle, cfg, quant, ids, w)
    slack = rounding_slack(x, oracle, cfg, quant, ids, w)
    m = ref.abs().max()
    assert slack[20].max() / m > 0.025 and slack.shape == (T, D)
    assert max_rel_err(out, ref, slack) <= 5e-3 < TOLERANCE["w4a8_mxfp4"]

