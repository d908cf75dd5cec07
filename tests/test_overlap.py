"""Overlap in the layer (epmoe.overlap): two micro-batches and the shared experts on a side
stream give the float64 oracle's result, as the plain order does. CPU: one rank (local comm)
and two gloo ranks (all2all); GPU (marked): the side streams themselves, at one rank."""

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.overlap import LayerStreams, overlap_fraction, tensors_of
from epmoe.plan.run import RunConfig
from epmoe.quant import QTensor
from epmoe.reference import TOLERANCE, max_rel_err, reference_moe, tolerance
from epmoe.runtime import Runtime
from epmoe.weights import dequantized_full_layer

LAYERS = 2


def _outputs(rt, micro_batches: int, overlap_shared: bool = True):
    """Step 0 of every layer with the layers set to this mode: [(x, out, ids, w)] per layer
    (the routing the layer's router chose: the oracle replays it; on CUDA the fused bf16
    router may pick another expert than the float64 one on near-ties)."""
    for layer in rt.layers:
        layer.micro_batches, layer.overlap_shared = micro_batches, overlap_shared
    rt.step(0)
    return [(d["x"], d["out"], d["ids"], d["w"]) for d in rt.last]


def _check_against_oracle(run, per_layer, msg, fp8_mma=False):
    """fp8_mma: the experts' fp8 GEMMs ran on tensor cores (the recipe's wider tolerance)."""
    tol = tolerance(run.quant, fp8_mma)
    for l, (x, out, ids, w) in enumerate(per_layer):
        assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all(), msg
        ref = reference_moe(x, dequantized_full_layer(run.cfg, run.quant, l, run.seed), run.cfg,
                            run.quant, ids.cpu(), w.cpu())
        err = max_rel_err(out, ref)
        assert err <= tol, f"layer {l}: rel err {err:.2e} > {tol:.0e}; {msg}"


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_micro_batches_match_one_batch_and_the_oracle(recipe, seed):
    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig(recipe), experts="torch",
                    tokens=17, layers=LAYERS, steps=1, seed=seed)  # odd: halves of 8 and 9
    rt = Runtime(run, device="cpu")
    one = _outputs(rt, 1)
    two = _outputs(rt, 2)
    # Layer 0 sees the same input; the halves' sums round differently in bf16, so from layer
    # 1 on the inputs agree only within the tolerance (and the router may then break a
    # near-tie differently; with fp8 a 0.2% input difference can flip codes worth 2.4% of
    # the output, seed 225849808): the outputs are compared where the inputs are the same,
    # and each layer of both modes is held to the oracle on its own input.
    (x1, o1, i1, _), (x2, o2, i2, _) = one[0], two[0]
    assert torch.equal(x1, x2) and torch.equal(i1, i2)
    for l, ((x1, o1, i1, _), (x2, o2, i2, _)) in enumerate(zip(one, two)):
        assert max_rel_err(x2, x1.double()) <= TOLERANCE[recipe], f"layer {l} input"
        if torch.equal(x1, x2) and torch.equal(i1, i2):
            assert max_rel_err(o2, o1.double()) <= TOLERANCE[recipe], f"{recipe=} {seed=} {l=}"
    _check_against_oracle(run, one, f"micro_batches=1 {recipe=} {seed=}")
    _check_against_oracle(run, two, f"micro_batches=2 {recipe=} {seed=}")


def _two_rank_case(rank, world, group, run):
    rt = Runtime(run, rank=rank, group=group)
    return _outputs(rt, 2)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_micro_batches_over_all2all_two_ranks(seed):
    """Both halves' collectives are issued in the same order on every rank."""
    from epmoe.ranks import run_ranks

    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("fp8_block"), world=2,
                    backend="all2all", experts="torch", tokens=12, layers=LAYERS, steps=1,
                    seed=seed)
    per_rank = run_ranks(_two_rank_case, 2, run, timeout=100.0)
    joined = [tuple(torch.cat([r[l][i] for r in per_rank]) for i in range(4))
              for l in range(LAYERS)]
    _check_against_oracle(run, joined, f"all2all micro_batches=2 {seed=}")


def test_bad_micro_batches_raises():
    run = RunConfig(model="deepseek-v3-tiny", experts="torch", tokens=4, layers=1, steps=1)
    rt = Runtime(run, device="cpu")
    from epmoe.layer import MoELayer

    layer = rt.layers[0]
    with pytest.raises(ValueError, match=r"micro_batches \(3\) must be 1 or 2"):
        MoELayer(layer.cfg, layer.quant, layer.weights, layer.plan, layer.comm, layer.experts,
                 micro_batches=3)


def test_tensors_of_walks_batches_and_overlap_fraction():
    a, b, c = torch.zeros(1), torch.ones(2), torch.zeros(3)
    q = QTensor(a, b, "fp8_block", 128)
    got = list(tensors_of(((q, [c]), {"k": a}, 3, None)))
    assert [t.shape for t in got] == [a.shape, b.shape, c.shape, a.shape]
    assert overlap_fraction({"dispatch": 2.0, "experts": 6.0, "shared": 2.0}, 8.0) == 0.2
    assert overlap_fraction({}, 1.0) == 0.0
    st = LayerStreams("cpu")
    assert st.mark() is None and st.shared is None
    with st.on(st.comm, reads=q):  # inline on CPU
        pass


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["triton", "auto"])
def test_side_streams_on_gpu_match_the_plain_order(experts, seed):
    """Shared experts on their stream and two micro-batches on the comm stream: the same
    result as the plain order (the same kernels on the same rows: equal up to bf16 rounding of
    a reordered sum), and the oracle."""
    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("fp8_block"), experts=experts,
                    tokens=256, layers=LAYERS, steps=1, seed=seed)
    rt = Runtime(run, device="cuda")
    plain = _outputs(rt, 1, overlap_shared=False)
    for mb in (1, 2):
        got = _outputs(rt, mb, overlap_shared=True)
        for l, ((x0, o0, i0, _), (x1, o1, i1, _)) in enumerate(zip(plain, got)):
            if not torch.equal(x0, x1):  # a later layer on inputs rounded differently: the
                continue  # oracle below holds it (see the CPU test above)
            assert torch.equal(i0, i1), "the same router on the same rows"
            err = max_rel_err(o1.cpu(), o0.cpu().double())
            print(f"{experts=} {mb=} layer {l}: vs plain order {err:.2e}")
            assert err <= TOLERANCE["fp8_block"], (mb, l, err)
        _check_against_oracle(run, [tuple(t.cpu() for t in rec) for rec in got],
                              f"{mb=} {experts=} {seed=}", rt.layers[0].experts.fp8_mma)
