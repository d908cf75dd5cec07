"""epmoe.kernels.launcher.Launcher: the same results as `fn[grid]`, arguments checked on the
CPU interpreter; on a GPU the shortcut taken, one compiled variant per specialization (a
pointer's alignment, an int equal to 1 / a multiple of 16), and hooks sending it back to
Triton's path."""

from __future__ import annotations

import epmoe.env  # noqa: F401  (the interpreter flag before triton)
import pytest
import torch
import triton
import triton.language as tl

from epmoe.kernels.launcher import Launcher

HAS_CUDA = torch.cuda.is_available()


@triton.jit
def _axpb(x_ptr, y_ptr, n, a, B: tl.constexpr, OFF: tl.constexpr, NEG: tl.constexpr = False):
    """y[i] = a * x[i] + OFF (or minus), i < n; a float, n an int Triton specializes."""
    i = tl.program_id(0) * B + tl.arange(0, B)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    v = a * x + OFF
    if NEG:
        v = -v
    tl.store(y_ptr + i, v, mask=m)


def _reference(x, n, a, off, neg=False):
    y = a * x[:n].double() + off
    return (-y if neg else y).float()


def _device():
    return "cuda" if HAS_CUDA else "cpu"


def test_arguments_checked():
    with pytest.raises(ValueError, match="missing \\['OFF'\\]"):
        Launcher(_axpb, dict(B=64))
    with pytest.raises(ValueError, match="not constexpr \\['n'\\]"):
        Launcher(_axpb, dict(B=64, OFF=1, n=3))
    k = Launcher(_axpb, dict(B=64, OFF=1))
    with pytest.raises(TypeError, match="takes 4 runtime arguments"):
        k(1, torch.zeros(4), torch.zeros(4), 4)


@pytest.mark.parametrize("neg", [False, True])
def test_matches_reference(neg):
    """Fresh inputs, outputs poisoned, against float64; a constexpr default overridden."""
    g = torch.Generator().manual_seed(11 + neg)
    k = Launcher(_axpb, dict(B=64, OFF=3, NEG=neg), num_warps=2)
    for n in (1, 16, 77, 128):
        x = torch.randn(160, generator=g).to(_device())
        y = torch.full((160,), float("nan"), device=_device())
        a = float(torch.rand(1, generator=g)) + 0.5
        k(triton.cdiv(n, 64), x, y, n, a)
        torch.testing.assert_close(y[:n].cpu(), _reference(x.cpu(), n, a, 3, neg),
                                   rtol=1e-6, atol=1e-6)
        assert torch.isnan(y[n:]).all()  # nothing written past n


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_shortcut_one_variant_per_specialization():
    k = Launcher(_axpb, dict(B=64, OFF=0), num_warps=2)
    assert k.fast, "the shortcut should apply on this Triton (3.6 / 3.7)"
    base = torch.randn(1024, device="cuda")
    out = torch.full((1024,), float("nan"), device="cuda")
    # aligned and misaligned pointers (an fp32 view one element in: 4-byte aligned only),
    # n == 1, a multiple of 16 and neither: each is its own compiled variant
    cases = [(base, out, 16), (base[1:], out[1:], 16), (base, out, 1), (base, out, 77),
             (base[1:], out[3:], 77)]
    for rep in range(3):  # rep 0 goes through Triton, the rest through the shortcut
        for x, y, n in cases:
            y.fill_(float("nan"))
            a = 1.0 + rep + n / 100
            k(triton.cdiv(n, 64), x, y, n, a)
            torch.cuda.synchronize()
            torch.testing.assert_close(y[:n].cpu(), _reference(x.cpu(), n, a, 0),
                                       rtol=1e-6, atol=1e-6)
    assert len(k._kernels) == len({(x.data_ptr() % 16 == 0, y.data_ptr() % 16 == 0,
                                    n == 1, n % 16 == 0) for x, y, n in cases})
    # a different stream: the launch goes to the current one
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out.fill_(float("nan"))
        k(2, base, out, 100, 2.0)
    s.synchronize()
    torch.testing.assert_close(out[:100].cpu(), _reference(base.cpu(), 100, 2.0, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_hook_takes_tritons_path():
    from triton import knobs

    k = Launcher(_axpb, dict(B=64, OFF=0), num_warps=2)
    x = torch.randn(64, device="cuda")
    y = torch.empty(64, device="cuda")
    k(1, x, y, 64, 1.0)
    seen = []
    chain = knobs.runtime.launch_enter_hook

    def hook(meta):
        seen.append(meta)

    if hasattr(chain, "add"):  # Triton >= 3.5: a chain of hooks
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        k(1, x, y, 64, 1.0)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 1  # Triton's own launch ran the hook
    y.zero_()
    k(1, x, y, 64, 1.0)  # the hook gone: the shortcut again, the hook not called
    torch.cuda.synchronize()
    assert len(seen) == 1 and torch.equal(y, x)
