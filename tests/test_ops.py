"""epmoe::moe_forward: a custom op torch.compile(fullgraph=True) traces without a graph break."""

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.ops import LayerRegistry, moe_forward
from epmoe.runtime import RunConfig, Runtime


@pytest.fixture(scope="module")
def layer():
    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("bf16"), experts="torch",
                    tokens=16, layers=1, steps=1)
    return Runtime(run, device="cpu").layers[0]


@pytest.fixture
def registry():
    reg = LayerRegistry()
    yield reg
    reg.close()


def test_fake_shape_is_a_function_of_the_input(layer, registry):
    h = registry.register(layer)
    x = torch.empty(7, layer.cfg.hidden, dtype=torch.bfloat16, device="meta")
    out = moe_forward(x, h)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device.type == "meta"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_matches_eager(layer, backend, registry):
    h = registry.register(layer)
    x = torch.randn(16, layer.cfg.hidden).to(torch.bfloat16)

    def f(x):
        return torch.ops.epmoe.moe_forward(x * 2.0, h) + 1.0

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend=backend)(x)
    assert torch.equal(out, f(x))
    assert torch.equal(layer.forward(x * 2.0) + 1.0, f(x))


def test_unknown_handle_names_the_fix():
    with pytest.raises(ValueError, match="LayerRegistry.register"):
        moe_forward(torch.zeros(2, 4), 10**9)


def test_registry_owns_its_layers_until_closed(layer):
    reg, other = LayerRegistry(), LayerRegistry()
    h = reg.register(layer)
    x = torch.randn(4, layer.cfg.hidden).to(torch.bfloat16)
    assert torch.equal(moe_forward(x, h), layer.forward(x)) and len(reg) == 1
    with pytest.raises(ValueError, match=f"handle {h} in layer registry {other.id}"):
        other.get(h)  # a handle belongs to the registry that issued it
    reg.unregister(h)
    with pytest.raises(ValueError, match="no MoE layer is registered"):
        moe_forward(x, h)
    h2 = reg.register(layer)
    reg.close()
    with pytest.raises(ValueError, match="no open layer registry"):
        moe_forward(x, h2)
    with pytest.raises(ValueError, match="is closed"):
        reg.register(layer)
    other.close()
