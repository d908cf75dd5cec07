"""epmoe::moe_forward: a custom op torch.compile(fullgraph=True) traces without a graph break."""

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.ops import moe_forward, register_layer
from epmoe.runtime import RunConfig, Runtime


@pytest.fixture(scope="module")
def layer():
    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("bf16"), experts="torch",
                    tokens=16, layers=1, steps=1)
    return Runtime(run, device="cpu").layers[0]


def test_fake_shape_is_a_function_of_the_input(layer):
    h = register_layer(layer)
    x = torch.empty(7, layer.cfg.hidden, dtype=torch.bfloat16, device="meta")
    out = moe_forward(x, h)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device.type == "meta"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_matches_eager(layer, backend):
    h = register_layer(layer)
    x = torch.randn(16, layer.cfg.hidden).to(torch.bfloat16)

    def f(x):
        return torch.ops.epmoe.moe_forward(x * 2.0, h) + 1.0

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend=backend)(x)
    assert torch.equal(out, f(x))
    assert torch.equal(layer.forward(x * 2.0) + 1.0, f(x))


def test_unknown_handle_names_the_fix():
    with pytest.raises(ValueError, match="register_layer"):
        moe_forward(torch.zeros(2, 4), 10**9)
