"""A tiny MoE layer through the symm backends in the CPU loopback world: dispatch -> torch
experts (each rank its block of experts) -> combine, against the float64 oracle
(`reference_moe`) at the recipe's tolerance, on fresh random tokens and routing."""

from __future__ import annotations

import pytest
import torch

from epmoe.comm.symm.ht import SymmHighThroughputComm
from epmoe.comm.symm.ll import SymmLowLatencyComm
from epmoe.comm.symm.loopback import loopback_combine, loopback_comms, loopback_dispatch
from epmoe.comm.symm.options import SymmOptions
from epmoe.config import QuantConfig
from epmoe.experts.torch_experts import TorchExperts
from epmoe.reference import TOLERANCE, max_rel_err, reference_moe
from epmoe.weights import dequantized_full_layer, synthetic_layer
from test_symm_ht import CFG, MAX_T, case_inputs

pytestmark = pytest.mark.interpreter  # the loopback world on CPU tensors


@pytest.mark.parametrize("cls,recipe,fmt", [
    (SymmHighThroughputComm, "fp8_block", "fp32"),
    (SymmHighThroughputComm, "bf16", "fp32"),
    (SymmLowLatencyComm, "fp8_block", "ue8m0_fp32"),
])
def test_symm_layer_matches_float64_oracle(cls, recipe, fmt, seed):
    world, quant = 2, QuantConfig(recipe, fmt)
    e_l = CFG.num_experts // world
    experts = [TorchExperts(synthetic_layer(CFG, quant, 0, seed, range(r * e_l, (r + 1) * e_l),
                                            with_shared=False).experts, CFG, quant)
               for r in range(world)]
    gate, bias, w13, w2, _ = dequantized_full_layer(CFG, quant, 0, seed)
    oracle = (gate, bias, w13, w2, None)
    _, comms = loopback_comms(cls, CFG, quant, world, MAX_T, options=SymmOptions(num_sms=1))
    xs, ids, ws = case_inputs("empty", world, torch.Generator().manual_seed(seed))
    outs = loopback_dispatch(comms, xs, ids, ws)
    ys = [experts[r].run(outs[r][0]) for r in range(world)]
    res = loopback_combine(comms, ys, [h for _, h in outs])
    for r in range(world):
        ref = reference_moe(xs[r], oracle, CFG, quant, ids[r].long(), ws[r].double())
        assert res[r].dtype == torch.bfloat16 and not res[r].isnan().any()
        err = max_rel_err(res[r], ref) if xs[r].shape[0] else 0.0
        assert err <= TOLERANCE[recipe], f"rank {r}: rel err {err:.2e} ({cls.name} {recipe})"
