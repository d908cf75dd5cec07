"""A tiny MoE layer through the symm backends in the CPU loopback world: dispatch -> torch
experts (each rank its block of experts) -> combine, against the float64 oracle
(`reference_moe`) at the recipe's tolerance, on fresh random tokens and routing."""

from __future__ import annotations

import pytest
import torch

from epmoe.comm.symm.ht import SymmHighThroughputComm
from epmoe.comm.symm.ht_shape import RowFormat
from epmoe.comm.symm.ll import SymmLowLatencyComm
from epmoe.comm.symm.loopback import loopback_combine, loopback_comms, loopback_dispatch
from epmoe.comm.symm.options import SymmOptions
from epmoe.config import QuantConfig, get_preset
from epmoe.experts.torch_experts import TorchExperts
from epmoe.reference import TOLERANCE, max_rel_err, reference_moe
from epmoe.weights import dequantized_full_layer, synthetic_layer
from test_symm_ht import CFG, MAX_T, case_inputs

pytestmark = pytest.mark.interpreter  # the loopback world on CPU tensors


# gpt-oss-tiny has deepseek-v3-tiny's E, K and D (the inputs' shapes) and expert biases: the
# combine must carry the biased rows (y = a @ w2.T + b2, weighted after).
OSS = get_preset("gpt-oss-tiny")


@pytest.mark.parametrize("cls,recipe,fmt,cfg", [
    (SymmHighThroughputComm, "fp8_block", "fp32", CFG),
    (SymmHighThroughputComm, "bf16", "fp32", CFG),
    (SymmLowLatencyComm, "fp8_block", "ue8m0_fp32", CFG),
    (SymmHighThroughputComm, "fp8_block", "fp32", OSS),
    (SymmLowLatencyComm, "bf16", "fp32", OSS),
], ids=["ht-fp8", "ht-bf16", "ll-fp8-ue8m0", "ht-fp8-gpt-oss", "ll-bf16-gpt-oss"])
def test_symm_layer_matches_float64_oracle(cls, recipe, fmt, cfg, seed):
    world, quant = 2, QuantConfig(recipe, fmt)
    e_l = cfg.num_experts // world
    experts = [TorchExperts(synthetic_layer(cfg, quant, 0, seed, range(r * e_l, (r + 1) * e_l),
                                            with_shared=False).experts, cfg, quant)
               for r in range(world)]
    assert (experts[0].weights.b2 is not None) == cfg.expert_bias
    oracle = dequantized_full_layer(cfg, quant, 0, seed)._replace(shared=None)
    _, comms = loopback_comms(cls, cfg, quant, world, MAX_T, options=SymmOptions(num_sms=1))
    xs, ids, ws = case_inputs("empty", world, torch.Generator().manual_seed(seed))
    outs = loopback_dispatch(comms, xs, ids, ws)
    ys = [experts[r].run(outs[r][0]) for r in range(world)]
    res = loopback_combine(comms, ys, [h for _, h in outs])
    for r in range(world):
        ref = reference_moe(xs[r], oracle, cfg, quant, ids[r].long(), ws[r].double())
        assert res[r].dtype == torch.bfloat16 and not res[r].isnan().any()
        err = max_rel_err(res[r], ref) if xs[r].shape[0] else 0.0
        assert err <= TOLERANCE[recipe], f"rank {r}: rel err {err:.2e} ({cls.name} {recipe})"


def test_symm_ht_mxfp8_scale_rows_padded_to_words(seed):
    """mxfp8 at a hidden size of 32-column groups that is no multiple of 128 (gpt-oss-120b's
    2880; here 160: 5 one-byte scales a row, 8 on the wire): the scales travel padded and come
    out as [M, 5] (a strided view); the layer matches the oracle. gpt-oss's biases included."""
    cfg, quant, world = OSS.replace(hidden=160, moe_intermediate=96), QuantConfig("mxfp8"), 2
    e_l = cfg.num_experts // world
    assert RowFormat.of(quant, cfg.hidden).check() is None and RowFormat.of(
        quant, cfg.hidden).scale_bytes == 8
    experts = [TorchExperts(synthetic_layer(cfg, quant, 0, seed, range(r * e_l, (r + 1) * e_l),
                                            with_shared=False).experts, cfg, quant)
               for r in range(world)]
    oracle = dequantized_full_layer(cfg, quant, 0, seed)._replace(shared=None)
    _, comms = loopback_comms(SymmHighThroughputComm, cfg, quant, world, MAX_T,
                              options=SymmOptions(num_sms=1))
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, cfg.hidden, generator=g).to(torch.bfloat16) for t in (7, 4)]
    ids = [torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.top_k]
                        for _ in range(x.shape[0])]).to(torch.int32) for x in xs]
    ws = [torch.rand(x.shape[0], cfg.top_k, generator=g) + 0.1 for x in xs]
    outs = loopback_dispatch(comms, xs, ids, ws)
    assert outs[0][0].x.scale.shape[1] == 5  # the wire's padding never reaches the experts
    ys = [experts[r].run(outs[r][0]) for r in range(world)]
    res = loopback_combine(comms, ys, [h for _, h in outs])
    for r in range(world):
        ref = reference_moe(xs[r], oracle, cfg, quant, ids[r].long(), ws[r].double())
        assert max_rel_err(res[r], ref) <= TOLERANCE["mxfp8"], r
