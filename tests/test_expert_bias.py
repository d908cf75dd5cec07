"""gpt-oss's biases: the router's (added to the logits) and every expert's gate/up and down
biases, from the oracle's definition to the kernels and the checkpoint loader.

The anchor is Hugging Face's gpt-oss MLP (GptOssTopKRouter + GptOssExperts), re-written here in
float64 from its published definition: gate_up_proj [E, D, 2I] with gate / up columns
interleaved, down_proj [E, I, D], top-k on logits x W^T + b then a softmax over the k values,
out = sum_k w_k * (((up + 1) * glu) @ down + down_bias). Nothing in epmoe is used to build it.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from epmoe.checkpoint import dequantize_mxfp4, load_layer
from epmoe.config import QuantConfig, get_preset
from epmoe.experts.base import ExpertWeights
from epmoe.experts.torch_experts import TorchExperts
from epmoe.kernels.act_quant import ValidRows
from epmoe.quant import dequantize_weight
from epmoe.reference import TOLERANCE, Oracle, max_rel_err, reference_moe, reference_route
from epmoe.router import route
from epmoe.weights import layer_to_oracle, synthetic_layer

OSS = get_preset("gpt-oss-tiny")  # E 16, K 4, D 256, I 256, swigluoai, limit 7
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def hf_gpt_oss_mlp(x, router_w, router_b, gate_up, gate_up_b, down, down_b, top_k,
                   alpha=1.702, limit=7.0):
    """float64 [T, D], Hugging Face's gpt-oss MLP (HF tensor layouts)."""
    x = x.double()
    logits = x @ router_w.double().T + router_b.double()
    top, idx = logits.topk(top_k, dim=-1)
    wk = torch.softmax(top, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(idx[t, j])
            gu = x[t] @ gate_up[e].double() + gate_up_b[e].double()
            gate, up = gu[::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
            glu = gate * torch.sigmoid(gate * alpha)
            out[t] += wk[t, j] * (((up + 1) * glu) @ down[e].double() + down_b[e].double())
    return out


def hf_tensors(gen, cfg=OSS, gu_scale=1.0):
    """Random HF-layout gpt-oss tensors of one layer (float32)."""
    e, d, i = cfg.num_experts, cfg.hidden, cfg.moe_intermediate
    return dict(router_w=torch.randn(e, d, generator=gen) / d ** 0.5,
                router_b=torch.randn(e, generator=gen),
                gate_up=torch.randn(e, d, 2 * i, generator=gen) * gu_scale / d ** 0.5,
                gate_up_b=torch.randn(e, 2 * i, generator=gen) * 2.0,
                down=torch.randn(e, i, d, generator=gen) / i ** 0.5,
                down_b=torch.randn(e, d, generator=gen))


def hf_to_oracle(t) -> Oracle:
    """HF layouts -> epmoe's: w13 rows [gate | up] (de-interleaved), w2 [E, D, I]."""
    gu = t["gate_up"].double().transpose(1, 2)  # [E, 2I, D], rows interleaved
    w13 = torch.cat([gu[:, 0::2], gu[:, 1::2]], dim=1)
    b13 = torch.cat([t["gate_up_b"][:, 0::2], t["gate_up_b"][:, 1::2]], dim=1).double()
    return Oracle(t["router_w"].double(), t["router_b"].double(), w13,
                  t["down"].double().transpose(1, 2), None, b13, t["down_b"].double())


def test_oracle_is_hugging_faces_gpt_oss_mlp(seed):
    g = torch.Generator().manual_seed(seed)
    t = hf_tensors(g, gu_scale=4.0)  # large enough that the clamp at 7 bites
    x = torch.randn(24, OSS.hidden, generator=g)
    want = hf_gpt_oss_mlp(x, **t, top_k=OSS.top_k)
    got = reference_moe(x, hf_to_oracle(t), OSS, QuantConfig("bf16"), fake_quant=False)
    assert max_rel_err(got, want) < 1e-12
    gu = x.double() @ t["gate_up"][0].double() + t["gate_up_b"][0].double()
    assert (gu[:, ::2] > 7).any() and (gu[:, 1::2].abs() > 7).any(), "the clamp never bit"
    # every bias matters: each one dropped moves the output far past any tolerance
    o = hf_to_oracle(t)
    for drop in ("bias", "b13", "b2"):
        off = reference_moe(x, o._replace(**{drop: None}), OSS, QuantConfig("bf16"),
                            fake_quant=False)
        assert max_rel_err(off, want) > 2 * TOLERANCE["bf16"], drop


@pytest.mark.interpreter  # Triton kernels on CPU tensors
def test_router_bias_on_the_logits_torch_and_triton(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(200, OSS.num_experts, generator=g)
    bias = torch.randn(OSS.num_experts, generator=g)
    ref_ids, ref_w = reference_route(logits.double(), OSS, bias)
    unbiased_ids, _ = reference_route(logits.double(), OSS, None)
    assert (ref_ids.sort(1).values != unbiased_ids.sort(1).values).any(1).float().mean() > 0.3
    for backend in ("torch", "triton"):
        r = route(logits, OSS, bias, backend=backend)
        ids, order = r.topk_ids_TK.long().sort(1)
        assert torch.equal(ids, ref_ids.sort(1).values), backend
        w = r.topk_weights_TK.double().gather(1, order)
        want = ref_w.gather(1, ref_ids.sort(1).indices)
        assert (w - want).abs().max() < 1e-5, backend


@pytest.mark.interpreter  # Triton kernels on CPU tensors
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_experts_with_biases_match_the_oracle(backend, recipe, seed):
    """Contiguous (apply) and masked paths on gpt-oss-tiny's synthetic weights and biases."""
    from epmoe.experts.triton_experts import TritonExperts
    from epmoe.layout import make_masked_layout

    quant = QuantConfig(recipe)
    lw = synthetic_layer(OSS, quant, 0, seed, range(OSS.num_experts))
    ew = lw.experts
    assert ew.b13.shape == (16, 512) and ew.b2.shape == (16, 256)
    oracle = layer_to_oracle(lw)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(20, OSS.hidden, generator=g).to(torch.bfloat16)
    ids, w = reference_route(x.double() @ oracle.gate.T, OSS, oracle.bias)
    ref = reference_moe(x, oracle, OSS, quant, ids, w)
    cls = TorchExperts if backend == "torch" else TritonExperts
    ex = cls(ew, OSS, quant)
    xq = ex.quantize_input(x)
    out = ex.apply(xq, ids.to(torch.int32), w.float())
    assert max_rel_err(out, ref) <= TOLERANCE[recipe]
    layout = make_masked_layout(ids.to(torch.int32), OSS.num_experts, x.shape[0])
    xm = _masked_input(xq, layout)
    out_m = ex.apply_masked(xm, layout.counts_E, layout, w.float())
    assert max_rel_err(out_m, ref) <= TOLERANCE[recipe]
    # without b2 the same backend misses the oracle: the bias reached the output
    no_b2 = cls(ExpertWeights(ew.w13, ew.w2, ew.expert_ids_E, ew.b13, None), OSS, quant)
    assert max_rel_err(no_b2.apply(xq, ids.to(torch.int32), w.float()), ref) > 0.05


def _masked_input(xq, layout):
    from epmoe.layout import scatter_masked

    scale = None if xq.scale is None else scatter_masked(xq.scale, layout)
    return type(xq)(scatter_masked(xq.data, layout), scale, xq.recipe, xq.group, xq.scale_fmt)


@pytest.mark.interpreter  # Triton kernels on CPU tensors
@pytest.mark.parametrize("masked", [False, True])
def test_add_expert_bias_kernel_leaves_padding_rows(masked, seed):
    from epmoe.kernels.expert_bias import triton_add_expert_bias_

    g = torch.Generator().manual_seed(seed)
    e, c, n = 3, 8, 96
    bias = torch.randn(e, n, generator=g)
    if masked:
        counts = torch.tensor([5, 0, 8], dtype=torch.int32)
        y = torch.randn(e, c, n, generator=g).to(torch.bfloat16)
        valid = torch.arange(c)[None, :] < counts[:, None].long()
        y[~valid] = float("nan")
        expert = torch.arange(e)[:, None].expand(e, c)
        rows = ValidRows.masked(counts, c)
    else:
        expert = torch.tensor([0, 0, -1, -1, 2, 2, 2, -1, 1, -1], dtype=torch.int32)
        y = torch.randn(expert.shape[0], n, generator=g).to(torch.bfloat16)
        valid = expert >= 0
        y[~valid] = float("nan")
        rows = ValidRows.contiguous(expert)
    want = (y.float() + bias[expert.long().clamp(min=0)]).to(torch.bfloat16)
    out = triton_add_expert_bias_(y.clone(), bias, rows)
    assert torch.equal(out[valid], want[valid])
    assert out[~valid].isnan().all(), "a padding row was written"


@pytest.mark.interpreter  # Triton kernels on CPU tensors
def test_act_quant_adds_each_rows_expert_bias(seed):
    from epmoe.experts.base import activation
    from epmoe.kernels.act_quant import triton_act_quant

    g = torch.Generator().manual_seed(seed)
    expert = torch.tensor([1, 1, -1, 0, 0, 0, 2, -1], dtype=torch.int32)
    h = (torch.randn(8, 256, generator=g) * 4).to(torch.bfloat16)
    bias = torch.randn(3, 256, generator=g) * 2
    a = triton_act_quant(h, OSS, QuantConfig("bf16"), rows=ValidRows.contiguous(expert),
                         bias_EF=bias)
    v = expert >= 0
    want = activation(h.float()[v] + bias[expert[v].long()], OSS).to(torch.bfloat16)
    assert (a.data[v].float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    with pytest.raises(ValueError, match="pass rows"):
        triton_act_quant(h, OSS, QuantConfig("bf16"), bias_EF=bias)


def test_tp_slices_keep_b2_once(seed):
    quant = QuantConfig("bf16")
    i = OSS.moe_intermediate
    full = synthetic_layer(OSS, quant, 0, seed, [3, 7]).experts
    a = synthetic_layer(OSS, quant, 0, seed, [3, 7], inter_slice=(0, i // 2)).experts
    b = synthetic_layer(OSS, quant, 0, seed, [3, 7], inter_slice=(i // 2, i // 2)).experts
    assert torch.equal(a.b2, full.b2) and b.b2 is None
    assert torch.equal(torch.cat([a.b13[:, :i // 2], b.b13[:, :i // 2]], 1), full.b13[:, :i])
    assert torch.equal(torch.cat([a.b13[:, i // 2:], b.b13[:, i // 2:]], 1), full.b13[:, i:])


# ------------------------------------------------------------------------ checkpoints


def test_dequantize_mxfp4_nibble_order_and_scale():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)  # one row, one group of 32
    blocks[0, 0, 0] = 0x21  # low nibble 1 (0.5) first, then 2 (1.0)
    blocks[0, 0, 1] = 0xF9  # 9 (-0.5), then 15 (-6.0)
    v = dequantize_mxfp4(blocks, torch.tensor([[128]], dtype=torch.uint8))  # x 2**1
    assert v.shape == (1, 32)
    assert v[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0] and not v[0, 4:].any()


def _mxfp4_pack(gen, shape_nk, scale_lo=118, scale_hi=124):
    """Random MXFP4 [E, N, K/32, 16] blocks + scales, and their values [E, N, K] decoded here
    (independently of epmoe: the e2m1 table above, low nibble first)."""
    e, n, k = shape_nk
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(scale_lo, scale_hi, (e, n, k // 32), generator=gen,
                           dtype=torch.uint8)
    lut = torch.tensor(E2M1, dtype=torch.float64)
    lo, hi = lut[(blocks & 15).long()], lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], -1).reshape(e, n, k // 32, 32)
    vals = vals * torch.exp2(scales.double() - 127)[..., None]
    return blocks, scales, vals.reshape(e, n, k)


@pytest.mark.parametrize("form", ["bf16", "mxfp4"])
def test_gpt_oss_checkpoint_matches_hugging_faces_mlp(tmp_path, form, seed):
    g = torch.Generator().manual_seed(seed)
    cfg = OSS
    e, d, i, layer = cfg.num_experts, cfg.hidden, cfg.moe_intermediate, 1
    t = hf_tensors(g)
    pre = f"model.layers.{layer}.mlp."
    out = {pre + "router.weight": t["router_w"].to(torch.bfloat16),
           pre + "router.bias": t["router_b"].to(torch.bfloat16),
           pre + "experts.gate_up_proj_bias": t["gate_up_b"].to(torch.bfloat16),
           pre + "experts.down_proj_bias": t["down_b"].to(torch.bfloat16)}
    if form == "bf16":
        out[pre + "experts.gate_up_proj"] = t["gate_up"].to(torch.bfloat16)
        out[pre + "experts.down_proj"] = t["down"].to(torch.bfloat16)
    else:  # stored [E, out, in] as blocks; HF's tensors are the transposes of the values
        gb, gs, gv = _mxfp4_pack(g, (e, 2 * i, d))
        db, ds, dv = _mxfp4_pack(g, (e, d, i))
        out.update({pre + "experts.gate_up_proj_blocks": gb,
                    pre + "experts.gate_up_proj_scales": gs,
                    pre + "experts.down_proj_blocks": db, pre + "experts.down_proj_scales": ds})
        t["gate_up"], t["down"] = gv.transpose(1, 2), dv.transpose(1, 2)
    save_file(out, str(tmp_path / "model.safetensors"))
    hf = {k: (v.to(torch.bfloat16).double() if k not in ("gate_up", "down") or form == "bf16"
              else v) for k, v in t.items()}

    recipe = "bf16" if form == "bf16" else "w4a8_mxfp4"
    lw = load_layer(str(tmp_path), "gpt_oss", cfg, QuantConfig(recipe), 0, range(e),
                    ckpt_layer=layer)
    want = hf_to_oracle(hf)
    assert torch.equal(dequantize_weight(lw.experts.w13).double(), want.w13)  # exact values
    assert torch.equal(dequantize_weight(lw.experts.w2).double(), want.w2)
    x = torch.randn(16, d, generator=g)
    ref = hf_gpt_oss_mlp(x, **{k: v for k, v in hf.items()}, top_k=cfg.top_k)
    got = reference_moe(x, layer_to_oracle(lw), cfg, QuantConfig(recipe), fake_quant=False)
    assert max_rel_err(got, ref) < 1e-9
    # a subset of experts reads only those (and in the order asked)
    part = load_layer(str(tmp_path), "gpt_oss", cfg, QuantConfig(recipe), 0, [9, 2],
                      ckpt_layer=layer)
    assert torch.equal(part.experts.b2, lw.experts.b2[[9, 2]])
    assert torch.equal(part.experts.w13.data, lw.experts.w13.data[[9, 2]])
    # TP: the slice that starts at 0 holds b2, the other none
    sl = load_layer(str(tmp_path), "gpt_oss", cfg, QuantConfig("bf16"), 0, [2],
                    ckpt_layer=layer, inter_slice=(i // 2, i // 2))
    assert sl.experts.b2 is None and sl.experts.b13.shape == (1, i)


def test_gpt_oss_checkpoint_errors(tmp_path):
    g = torch.Generator().manual_seed(0)
    t = hf_tensors(g)
    pre = "model.layers.0.mlp."
    save_file({pre + "router.weight": t["router_w"], pre + "router.bias": t["router_b"],
               pre + "experts.gate_up_proj": t["gate_up"], pre + "experts.down_proj": t["down"]},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="expert_bias=True but the checkpoint has no"):
        load_layer(str(tmp_path), "gpt_oss", OSS, QuantConfig(), 0, [0])
    with pytest.raises(ValueError, match="naming 'qwen3_moe' stores none"):
        load_layer(str(tmp_path), "qwen3_moe", OSS, QuantConfig(), 0, [0])
    with pytest.raises(ValueError, match="router_bias applies to the softmax router"):
        get_preset("deepseek-v3-tiny").replace(router_bias=True)


@pytest.mark.interpreter  # Triton kernels on CPU tensors
def test_triton_mxfp8_at_a_hidden_size_of_32_groups(seed):
    """gpt-oss-120b's hidden 2880 is 90 groups of 32 but no multiple of 128: mxfp8 runs on the
    Triton experts (here hidden 160, intermediate 96: K steps of 32 in both GEMMs)."""
    from epmoe.experts.triton_experts import TritonExperts

    cfg, quant = OSS.replace(hidden=160, moe_intermediate=96), QuantConfig("mxfp8")
    assert TritonExperts.supports(cfg, quant, torch.device("cpu")) is None
    lw = synthetic_layer(cfg, quant, 0, seed, range(cfg.num_experts))
    oracle = layer_to_oracle(lw)
    x = torch.randn(12, cfg.hidden, generator=torch.Generator().manual_seed(seed))
    ids, w = reference_route(x.double() @ oracle.gate.T, cfg, oracle.bias)
    ex = TritonExperts(lw.experts, cfg, quant)
    out = ex.apply(ex.quantize_input(x.to(torch.bfloat16)), ids.to(torch.int32), w.float())
    ref = reference_moe(x.to(torch.bfloat16), oracle, cfg, quant, ids, w)
    assert max_rel_err(out, ref) <= TOLERANCE["mxfp8"]


def test_gpt_oss_checkpoint_with_no_experts_here(tmp_path):
    """A rank that holds none of a layer's experts reads none of their rows."""
    t = hf_tensors(torch.Generator().manual_seed(1))
    pre = "model.layers.0.mlp."
    save_file({pre + "router.weight": t["router_w"], pre + "router.bias": t["router_b"],
               pre + "experts.gate_up_proj": t["gate_up"], pre + "experts.down_proj": t["down"],
               pre + "experts.gate_up_proj_bias": t["gate_up_b"],
               pre + "experts.down_proj_bias": t["down_b"]}, str(tmp_path / "model.safetensors"))
    lw = load_layer(str(tmp_path), "gpt_oss", OSS, QuantConfig(), 0, [])
    e = lw.experts
    assert e.num_experts == 0 and e.b13.shape == (0, 512) and e.b2.shape == (0, 256)
    assert lw.gate_ED.shape == (16, 256) and lw.bias_E.shape == (16,)
