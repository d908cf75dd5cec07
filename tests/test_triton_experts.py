"""TritonExperts against TorchExperts on the same weights, and the backend selector.

Tolerance: both backends quantize the same GEMM1 output, but their fp32 sums differ in order,
so a bf16 h can differ by one ulp and move an activation code; outputs are compared at
max |err| <= 3e-2 * max |ref| (fp8 / fp4 recipes) and 1e-2 (bf16)."""

import pytest
import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import ExpertWeights
from epmoe.experts.select import make_experts
from epmoe.experts.torch_experts import TorchExperts
from epmoe.experts.triton_experts import TritonExperts
from epmoe.layout import make_masked_layout, scatter_masked
from epmoe.quant import quantize_act, quantize_weight

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CFG = MoEConfig("t", hidden=256, moe_intermediate=128, num_experts=6, top_k=3)
OAI = CFG.replace(activation="swigluoai", swiglu_limit=7.0)


def _weights(cfg, quant):
    e, d, i = cfg.num_experts, cfg.hidden, cfg.moe_intermediate
    w13 = torch.randn(e, 2 * i, d, device=DEV) / d ** 0.5
    w2 = torch.randn(e, d, i, device=DEV) / i ** 0.5
    return ExpertWeights(quantize_weight(w13, quant), quantize_weight(w2, quant),
                         torch.arange(e, device=DEV))


def _routing(n, cfg):
    scores = torch.rand(n, cfg.num_experts, device=DEV)
    w, ids = scores.topk(cfg.top_k, dim=1)
    ids = ids.to(torch.int32)
    ids[torch.rand(n, cfg.top_k, device=DEV) < 0.15] = -1  # slots of other ranks
    return ids, w


def _rel(y, ref):
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("cfg,recipe,fmt", [
    (CFG, "bf16", "fp32"), (CFG, "fp8_block", "fp32"), (OAI, "fp8_block", "fp32"),
    (CFG, "fp8_block", "ue8m0_packed"), (CFG, "mxfp8", "fp32"), (OAI, "w4a8_mxfp4", "fp32")],
    ids=["bf16", "fp8", "fp8-oai", "fp8-packed", "mxfp8", "w4a8-oai"])
def test_triton_experts_apply_matches_torch(cfg, recipe, fmt, seed):
    quant = QuantConfig(recipe, fmt)
    weights = _weights(cfg, quant)
    n = 48
    x_f = torch.randn(n, cfg.hidden, device=DEV)
    x = quantize_act(x_f, quant)
    ids, w = _routing(n, cfg)
    tri = TritonExperts(weights, cfg, quant, block_m=32)
    y = tri.apply(x, ids, w)
    # the torch backend takes packed UE8M0 in its fp32 form (the same power-of-two values)
    qref = QuantConfig(recipe, "ue8m0_fp32") if fmt == "ue8m0_packed" else quant
    xref = quantize_act(x_f, qref) if fmt == "ue8m0_packed" else x
    ref = TorchExperts(weights, cfg, qref).apply(xref, ids, w, alignment=32)
    err = _rel(y, ref)
    print(f"{recipe=} {fmt=} act={cfg.activation} {n=} rel err {err:.2e}")
    assert y.dtype == torch.bfloat16 and y.shape == (n, cfg.hidden)
    assert err <= (1e-2 if recipe == "bf16" else 3e-2)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block", "w4a8_mxfp4"])
def test_triton_experts_masked_matches_torch(recipe, seed):
    quant = QuantConfig(recipe)
    weights = _weights(CFG, quant)
    n, cap = 32, 40
    ids, w = _routing(n, CFG)
    lay = make_masked_layout(ids, CFG.num_experts, cap)
    x = quantize_act(scatter_masked(torch.randn(n, CFG.hidden, device=DEV), lay), quant)
    y = TritonExperts(weights, CFG, quant, block_m=32).apply_masked(x, lay.counts_E, lay, w)
    ref = TorchExperts(weights, CFG, quant).apply_masked(x, lay.counts_E, lay, w)
    assert _rel(y, ref) <= (1e-2 if recipe == "bf16" else 3e-2)


def test_triton_experts_permute_then_run_uses_given_layout(seed):
    quant = QuantConfig("fp8_block")
    weights = _weights(CFG, quant)
    tri = TritonExperts(weights, CFG, quant, block_m=32)
    x = quantize_act(torch.randn(24, CFG.hidden, device=DEV), quant)
    ids, w = _routing(24, CFG)
    layout = tri.make_layout(ids, alignment=64)
    y = tri.unpermute(tri.run_contiguous(tri.permute(x, layout), layout), layout, w)
    ref = TorchExperts(weights, CFG, quant).apply(x, ids, w, alignment=64)
    assert _rel(y, ref) <= 3e-2
    with pytest.raises(ValueError, match=r"alignment \(16\) must be a multiple of triton's"):
        tri.make_layout(ids, alignment=16)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block", "mxfp8", "w4a8_mxfp4"])
def test_apply_reads_tokens_in_place(recipe, seed):
    """bf16, mxfp8: apply copies no row into the layout (its workspace holds none; GEMM1 reads
    each token through the layout's row -> token index) and equals the copying path bit for
    bit, twice on one workspace (the second call at fewer tokens over the first call's index);
    fp8_block and w4a8_mxfp4 keep the copy (their gathered reads are the slower way), and
    their gathered way, forced, equals it too."""
    quant = QuantConfig(recipe)
    cfg = OAI if recipe == "w4a8_mxfp4" else CFG
    weights = _weights(cfg, quant)
    tri = TritonExperts(weights, cfg, quant, block_m=32)
    other = TritonExperts(weights, cfg, quant, block_m=32)
    other.gather_tokens = not tri.gather_tokens
    in_place = recipe in ("bf16", "mxfp8")
    assert tri.gather_tokens == in_place
    for n in (48, 20):  # the second call reuses the first call's workspace (its stale index)
        x = quantize_act(torch.randn(n, cfg.hidden, device=DEV), quant)
        ids, w = _routing(n, cfg)
        assert torch.equal(tri.apply(x, ids, w), other.apply(x, ids, w))
    [(key, pws)] = tri.ws._objs.items()  # one permute workspace, made once
    assert key[1] == ("permute", not in_place) and pws.copies_rows == (not in_place)
    assert tri.ws.allocations == len(tri.ws._bufs) + 1


def test_plan_models_the_permute_that_runs():
    """The cost model's permute bytes follow the experts' own choice of recipes whose rows stay
    in place (epmoe.plan.traffic mirrors TritonExperts.TOKEN_GATHER_RECIPES)."""
    from epmoe.config import RECIPES
    from epmoe.plan.traffic import permute_copies_rows

    for r in RECIPES:
        assert permute_copies_rows("triton", r) == (r not in TritonExperts.TOKEN_GATHER_RECIPES)
        assert permute_copies_rows("torch", r) and permute_copies_rows("deepgemm", r)


def test_make_experts_reasons():
    quant = QuantConfig("bf16")
    weights = _weights(CFG, quant)
    ex, why = make_experts("torch", weights, CFG, quant, DEV)
    assert ex.name == "torch" and why == "torch: chosen"
    ex, why = make_experts("auto", weights, CFG, quant, DEV)
    assert why.endswith(f"{ex.name}: chosen") and "\n" not in why
    if DEV == "cpu":
        assert ex.name == "torch" and "not CUDA" in why
    ex, why = make_experts("triton", weights, CFG, quant, DEV)
    assert ex.name == "triton" and why == "triton: chosen"
    with pytest.raises(ValueError, match=r"experts backend \('nope'\) must be one of"):
        make_experts("nope", weights, CFG, quant, DEV)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block", "mxfp8"])
def test_fp8_mma_names_tensor_core_fp8_gemms_only(recipe):
    """The oracle's wider fp8 tolerance applies where the GEMMs ran on fp8 tensor cores: the
    Triton kernels on a GPU with fp8_block (mxfp8 dequantizes to bf16 in the kernel); never the
    torch experts, nor the interpreter (its dot sums in fp32)."""
    quant = QuantConfig(recipe)
    w = _weights(CFG, quant)
    assert TritonExperts(w, CFG, quant).fp8_mma == (DEV == "cuda" and recipe == "fp8_block")
    assert not TorchExperts(w, CFG, quant).fp8_mma


def test_triton_supports_reports_bad_shapes():
    bad = MoEConfig("b", hidden=200, moe_intermediate=128, num_experts=4, top_k=2)
    why = TritonExperts.supports(bad, QuantConfig("fp8_block"), torch.device(DEV))
    assert why is not None and "hidden (200)" in why


# ------------------------------------------------------------------ hot path: no allocation
# of its own in steady state, dense shared-expert path

@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_run_dense_matches_the_oracle(recipe, seed):
    """run_dense (every row through the one expert, no permute) against the float64 oracle."""
    from epmoe.quant import dequantize_weight
    from epmoe.reference import max_rel_err, reference_moe, tolerance

    cfg, quant = CFG.replace(num_experts=1, top_k=1), QuantConfig(recipe)
    weights = _weights(cfg, quant)
    n = 40
    x_f = torch.randn(n, cfg.hidden, device=DEV)
    oracle = (None, None, dequantize_weight(weights.w13).double().cpu(),
              dequantize_weight(weights.w2).double().cpu(), None)
    ones = torch.ones(n, 1)
    ref = reference_moe(x_f.cpu(), oracle, cfg, quant, torch.zeros(n, 1, dtype=torch.long), ones)
    for ex in (TritonExperts(weights, cfg, quant, block_m=32), TorchExperts(weights, cfg, quant)):
        y = ex.run_dense(quantize_act(x_f, quant))
        err = max_rel_err(y.float().cpu(), ref)
        assert y.shape == (n, cfg.hidden) and y.dtype == torch.bfloat16
        assert err <= tolerance(quant, ex.fp8_mma), f"{ex.name} {recipe=} {err=:.2e} {seed=}"
    with pytest.raises(ValueError, match="run_dense takes one expert"):
        TritonExperts(_weights(CFG, quant), CFG, quant).run_dense(quantize_act(x_f, quant))


def test_dense_buffers_are_reused_and_poison_does_not_leak(seed):
    """A second call (same or fewer rows) allocates no workspace buffer; buffers poisoned with
    NaN between calls do not reach the output (padding is never read)."""
    quant = QuantConfig("fp8_block")
    cfg = CFG.replace(num_experts=1, top_k=1)
    tri = TritonExperts(_weights(cfg, quant), cfg, quant, block_m=32)
    x = quantize_act(torch.randn(40, cfg.hidden, device=DEV), quant)
    y0 = tri.run_dense(x).clone()
    allocs = tri.ws.allocations
    assert allocs >= 1
    for buf in tri.ws._bufs.values():
        if buf.is_floating_point():
            buf.fill_(float("nan"))
    y1 = tri.run_dense(x)
    assert tri.ws.allocations == allocs and torch.equal(y1, y0)
    tri.run_dense(quantize_act(torch.randn(24, cfg.hidden, device=DEV), quant))
    assert tri.ws.allocations == allocs


def test_use_slot_restores_and_separates_buffers():
    quant = QuantConfig("bf16")
    cfg = CFG.replace(num_experts=1, top_k=1)
    tri = TritonExperts(_weights(cfg, quant), cfg, quant)
    a = tri.ws.take("h", (4, 8), torch.bfloat16, tri.slot)
    with tri.use_slot(1):
        assert tri.slot == 1
        b = tri.ws.take("h", (4, 8), torch.bfloat16, tri.slot)
    assert tri.slot == 0 and a.data_ptr() != b.data_ptr()
    assert tri.ws.take("h", (2, 8), torch.bfloat16, 0).data_ptr() == a.data_ptr()


def test_w4a8_block_m_follows_the_expected_rows_per_expert(monkeypatch):
    """W4A8's BLOCK_M (the swapped MMA's N side): from the pairs per expert on the contiguous
    path, the rows on the shared MLP's dense path, the capacity's uniform share on the masked
    one; other recipes keep the backend's."""
    import epmoe.experts.triton_experts as te
    seen = []

    def spy(fn):
        def wrapped(*args, block_m=None, **kwargs):
            seen.append(block_m)
            return fn(*args, block_m=block_m, **kwargs)
        return wrapped

    monkeypatch.setattr(te, "triton_m_grouped_gemm_nt_masked",
                        spy(te.triton_m_grouped_gemm_nt_masked))
    monkeypatch.setattr(te, "triton_m_grouped_gemm_nt_contiguous",
                        spy(te.triton_m_grouped_gemm_nt_contiguous))
    cfg = CFG.replace(num_experts=4, top_k=2)
    for recipe, want in (("w4a8_mxfp4", [64, 64, 128, 128, 16, 16, 32, 32]),
                         ("fp8_block", [64, 64, 64, 64, 64, 64, 128, 128])):
        quant = QuantConfig(recipe)
        tri = TritonExperts(_weights(cfg, quant), cfg, quant, block_m=128)
        # the shared MLP: one expert's weights under the model's config (as the Runtime)
        one = TritonExperts(_weights(cfg.replace(num_experts=1, top_k=1), quant), cfg, quant,
                            block_m=128)
        seen.clear()
        one.run_dense(quantize_act(torch.randn(40, cfg.hidden, device=DEV), quant))
        one.run_dense(quantize_act(torch.randn(300, cfg.hidden, device=DEV), quant))
        x = quantize_act(torch.randn(4, 24, cfg.hidden, device=DEV), quant)  # 24 x 2 / 4 = 12
        tri.run_masked(x, torch.full((4,), 24, dtype=torch.int32, device=DEV))
        ids = torch.randint(0, 4, (64, 2), dtype=torch.int32, device=DEV)  # 32 per expert
        tri.apply(quantize_act(torch.randn(64, cfg.hidden, device=DEV), quant), ids,
                  torch.rand(64, 2, device=DEV))
        assert seen == want, recipe
