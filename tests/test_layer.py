"""MoELayer (router -> local comm -> torch experts -> combine + shared) against the oracle.

Built through `Runtime` (one rank, form ep_dp, local comm), so the test covers what the CLI
runs; the oracle rebuilds the layer's weights from the seed (`dequantized_full_layer`)."""

import random

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.plan.run import RunConfig
from epmoe.reference import TOLERANCE, max_rel_err, reference_moe, rounding_slack
from epmoe.router import ReplicaMap, Routing
from epmoe.runtime import Runtime
from epmoe.weights import dequantized_full_layer

RECIPES = [("bf16", "fp32"), ("fp8_block", "fp32"), ("mxfp8", "fp32"), ("w4a8_mxfp4", "fp32"),
           ("fp8_block", "ue8m0_fp32")]


def _runtime(model, quant, seed, layers=1, tokens=32, overrides=()):
    run = RunConfig(model=model, quant=quant, experts="torch", tokens=tokens, layers=layers,
                    steps=1, seed=seed, model_overrides=tuple(overrides))
    rt = Runtime(run, device="cpu")
    rt.step(0)
    return rt


def _check(out, x, oracle, cfg, quant, msg, ids=None, w=None):
    """Against the oracle (routing x itself unless given ids / w), each |out - ref| less its
    rounding slack; returns the oracle's output."""
    assert out.dtype == torch.bfloat16 and not out.isnan().any(), msg
    ref = reference_moe(x, oracle, cfg, quant, ids, w)
    err = max_rel_err(out, ref, rounding_slack(x, oracle, cfg, quant, ids, w))
    assert err <= TOLERANCE[quant.recipe], \
        f"rel err {err:.2e} past the rounding slack ({max_rel_err(out, ref):.2e} raw); {msg}"
    return ref


@pytest.mark.parametrize("recipe,fmt", RECIPES)
@pytest.mark.parametrize("model", ["deepseek-v3-tiny", "qwen3-moe-tiny", "gpt-oss-tiny",
                                   "kimi-k2-tiny", "deepseek-v4-tiny"])
def test_layer_matches_oracle(model, recipe, fmt, seed):
    quant = QuantConfig(recipe, fmt)
    rt = _runtime(model, quant, seed, tokens=16)
    cfg = rt.cfg
    x, out = rt.last[0]["x"], rt.last[0]["out"]
    assert x.abs().sum() > 0 and out.shape == x.shape
    oracle = dequantized_full_layer(cfg, quant, 0, seed)
    _check(out, x, oracle, cfg, quant, f"{model=} {recipe=} {fmt=} {seed=}")


def test_second_layer_takes_the_normalized_residual(seed):
    """Pre-norm: layer 0 runs on rms_norm(tokens), layer 1 on rms_norm(tokens + out_0)."""
    quant = QuantConfig("fp8_block")
    rt = _runtime("deepseek-v3-tiny", quant, seed, layers=2, tokens=16)
    l0, l1 = rt.last
    x0 = rt.tokens_for(0).float()

    def rms_normed(x):
        return (x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).to(torch.bfloat16)

    torch.testing.assert_close(l0["x"].float(), rms_normed(x0).float(), rtol=0.01, atol=0.01)
    resid = (x0 + l0["out"].float()).to(torch.bfloat16).float()
    torch.testing.assert_close(l1["x"].float(), rms_normed(resid).float(), rtol=0.01, atol=0.01)
    oracle = dequantized_full_layer(rt.cfg, quant, 1, seed)
    _check(l1["out"], l1["x"], oracle, rt.cfg, quant, f"{seed=}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_residual_add_rounds_once_as_the_fp32_sum(device, seed):
    """The runtime adds a layer's bf16 output to the bf16 residual with one torch.add
    (runtime.residual_add): torch sums bf16 in fp32 and rounds once, the bits of the explicit
    fp32 sum (four kernels)."""
    from epmoe.runtime import residual_add

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-3, 4, (513, 1), generator=g)
    x = (torch.randn(513, 2048, generator=g) * scale).to(torch.bfloat16).to(device)
    out = torch.randn(513, 2048, generator=g).to(torch.bfloat16).to(device)
    got = residual_add(x, out)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (x.float() + out.float()).to(torch.bfloat16))


def test_a_deep_stack_stays_finite_and_passes_the_oracle(seed):
    """A SwiGLU stack fed its raw residual overflowed bf16 by layer 8 (every later layer inf,
    the launch's check failed for any --layers above ~8, DeepSeek-V3's 58 included); each
    layer's input is now RMS 1 and its output finite."""
    quant = QuantConfig("bf16")
    rt = _runtime("deepseek-v3-tiny", quant, seed, layers=16, tokens=8)
    for l, rec in enumerate(rt.last):
        rms = rec["x"].float().pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.ones_like(rms), atol=0.02), l
        assert rec["out"].float().isfinite().all(), l
    last = rt.last[-1]
    oracle = dequantized_full_layer(rt.cfg, quant, 15, seed)
    _check(last["out"], last["x"], oracle, rt.cfg, quant, f"layer 15 {seed=}")


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_shared_experts_on_and_off(recipe, seed):
    quant = QuantConfig(recipe)
    on = _runtime("deepseek-v3-tiny", quant, seed, tokens=16)
    off = _runtime("deepseek-v3-tiny", quant, seed, tokens=16,
                   overrides=[("num_shared_experts", 0)])
    assert on.layers[0].weights.shared is not None and off.layers[0].weights.shared is None
    x = on.last[0]["x"]
    assert torch.equal(x, off.last[0]["x"])
    oracle_on = dequantized_full_layer(on.cfg, quant, 0, seed)
    oracle_off = dequantized_full_layer(off.cfg, quant, 0, seed)
    assert oracle_off[4] is None
    ref_on = _check(on.last[0]["out"], x, oracle_on, on.cfg, quant, f"shared on {seed=}")
    ref_off = _check(off.last[0]["out"], x, oracle_off, off.cfg, quant, f"shared off {seed=}")
    # the shared MLP contributes far more than the tolerance: dropping it would be caught
    assert max_rel_err(ref_off, ref_on) > 10 * TOLERANCE[recipe]


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block", "w4a8_mxfp4"])
def test_apply_router_weight_on_input_top1(recipe, seed):
    quant = QuantConfig(recipe)
    # not renormalized: a renormalized top-1 weight is always 1 and the flag would be a no-op
    ov = [("top_k", 1), ("apply_router_weight_on_input", True), ("renormalize", False)]
    rt = _runtime("qwen3-moe-tiny", quant, seed, tokens=32, overrides=ov)
    cfg = rt.cfg
    x, out = rt.last[0]["x"], rt.last[0]["out"]
    oracle = dequantized_full_layer(cfg, quant, 0, seed)
    ref = _check(out, x, oracle, cfg, quant, f"{recipe=} {seed=}")
    on_output = reference_moe(x, oracle, cfg.replace(apply_router_weight_on_input=False), quant)
    assert max_rel_err(on_output, ref) > 5 * TOLERANCE[recipe], "weight placement not tested"


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_given_routing_with_empty_slots(recipe, seed):
    """A replayed routing: -1 slots are skipped, an expert may receive nothing or everything."""
    quant = QuantConfig(recipe)
    rt = _runtime("qwen3-moe-tiny", quant, seed, tokens=8)
    layer, cfg = rt.layers[0], rt.cfg
    g = torch.Generator().manual_seed(seed)
    t = 24
    x = torch.randn(t, cfg.hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 4, (t, cfg.top_k), generator=g)  # experts 4.. receive nothing
    ids[:8] = 2  # eight tokens put every slot on expert 2
    ids[torch.rand(t, cfg.top_k, generator=g) < 0.3] = -1
    ids[5] = -1  # a token with no expert at all
    w = torch.rand(t, cfg.top_k, generator=g)
    oracle = dequantized_full_layer(cfg, quant, 0, seed)
    for dtype in (torch.int32, torch.int64):
        out = layer.forward(x, Routing(ids.to(dtype), w))
        _check(out, x, oracle, cfg, quant, f"{recipe=} {dtype=} {seed=}", ids, w)
        assert torch.equal(out[5], torch.zeros_like(out[5]))


def test_identity_replica_map_changes_nothing(seed):
    quant = QuantConfig("bf16")
    rt = _runtime("qwen3-moe-tiny", quant, seed, tokens=16)
    layer = rt.layers[0]
    x = rt.last[0]["x"]
    plain = layer.forward(x)
    layer.replica_map = ReplicaMap.identity(rt.cfg.num_experts)
    assert torch.equal(layer.forward(x, token_offset=random.randrange(100)), plain)


def test_wrong_hidden_raises():
    rt = _runtime("qwen3-moe-tiny", QuantConfig(), 0, tokens=4)
    with pytest.raises(ValueError, match=r"x must be \[T, hidden=256\], got \(4, 128\)"):
        rt.layers[0].forward(torch.randn(4, 128).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be \[T, hidden=256\], got \(256,\)"):
        rt.layers[0].forward(torch.randn(256).to(torch.bfloat16))
