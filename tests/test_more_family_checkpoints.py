"""Checkpoints of the families in tests/test_more_families.py, under each family's naming and
fused layout: random tensors written as the family's safetensors, read by the loader, computed
as the family's modeling code computes them (float64, to 1e-12) and launched on one rank (and
two where a width splits unevenly) against the float64 oracle."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.hf_config import read_hf_config
from tests.launch_util import config_folder, launch_in_process
from tests.test_more_families import (AFMOE, GRANITE_SHARED, HUNYUAN, KIMI_LINEAR, LFM2,
                                      QWEN3_OMNI, QWEN3_VL)

def _checkpoint(folder, names, layers, e, d, i, shared_width=0, prefix=None):
    """A random bf16 checkpoint under a naming's templates (epmoe.checkpoint.NAMINGS); prefix:
    its layers under this prefix instead of model.layers. (a multimodal checkpoint's)."""
    from safetensors.torch import save_file

    from epmoe.checkpoint import NAMINGS

    nm, g, t = NAMINGS[names], torch.Generator().manual_seed(21), {}
    if prefix:
        nm = {k: v.replace("model.layers.", prefix) if isinstance(v, str) else v
              for k, v in nm.items()}
    gp, up, dp = nm["proj"]
    for cl in layers:
        t[nm["gate"].format(l=cl)] = torch.randn(e, d, generator=g) * d ** -0.5
        if nm["bias"]:
            t[nm["bias"].format(l=cl)] = torch.randn(e, generator=g) * 0.02
        subs = [(nm["expert"].format(l=cl, e=x), i, (gp, up, dp)) for x in range(e)]
        subs += [(nm["shared"].format(l=cl), shared_width, nm.get("shared_proj", nm["proj"]))] \
            if shared_width else []
        for pre, width, (g_n, u_n, d_n) in subs:
            for n, shape in ((g_n, (width, d)), (u_n, (width, d)), (d_n, (d, width))):
                t[f"{pre}{n}.weight"] = (torch.randn(*shape, generator=g)
                                         * shape[1] ** -0.5).bfloat16()
    save_file(t, str(folder / "model.safetensors"))
    return t


@pytest.mark.parametrize("family", ["hunyuan", "afmoe", "qwen3_omni", "lfm2", "kimi"])
def test_a_checkpoint_of_each_naming_passes_the_oracle(tmp_path, family):
    from epmoe.checkpoint import load_layer

    tiny = {"hunyuan": dict(HUNYUAN, hidden_size=256, intermediate_size=128, num_experts=8,
                            moe_topk=[2] * 2, moe_intermediate_size=[128] * 2,
                            num_shared_expert=[1] * 2, num_hidden_layers=2),
            "afmoe": dict(AFMOE, hidden_size=256, moe_intermediate_size=128, num_experts=8,
                          num_experts_per_tok=2, num_shared_experts=2, route_scale=2.0,
                          num_hidden_layers=3, num_dense_layers=1),
            "qwen3_omni": dict(QWEN3_OMNI, thinker_config=dict(text_config=dict(
                QWEN3_OMNI["thinker_config"]["text_config"], hidden_size=256,
                moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                num_hidden_layers=2))),
            "lfm2": dict(LFM2, hidden_size=256, moe_intermediate_size=128, num_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=3, num_dense_layers=1,
                         routed_scaling_factor=1.5),
            "kimi": dict(KIMI_LINEAR, hidden_size=256, moe_intermediate_size=128, num_experts=8,
                         num_experts_per_token=2, num_hidden_layers=3)}[family]
    folder = config_folder(tmp_path, f"tiny-{family}", tiny)
    hf = read_hf_config(str(folder))
    c = hf.cfg
    t = _checkpoint(folder, hf.naming, hf.moe_layers, c.num_experts, c.hidden,
                    c.moe_intermediate, c.shared_intermediate if c.num_shared_experts else 0)
    lw = load_layer(str(folder), None, c, QuantConfig("bf16"), 0, [3])
    from epmoe.checkpoint import NAMINGS

    nm = NAMINGS[hf.naming]
    torch.testing.assert_close(lw.gate_ED, t[nm["gate"].format(l=hf.moe_layers[0])])
    if nm["bias"]:
        torch.testing.assert_close(lw.bias_E, t[nm["bias"].format(l=hf.moe_layers[0])])
    assert (lw.shared is not None) == bool(c.num_shared_experts)
    rc, s = launch_in_process(tmp_path, ["--weights", str(folder)])
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]
    assert len(s["correctness"]["per_layer"]) == len(hf.moe_layers)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inter,shared,extra", [
    (256, 384, []), (256, 384, ["--ep", "2", "--no-dp"]), (384, 512, ["--ep", "2", "--no-dp"])],
    ids=["one-rank", "ep2-rank0-alone", "ep2-split"])
def test_a_shared_mlp_of_its_own_width_passes_the_oracle(tmp_path, inter, shared, extra):
    """Granite's shared MLP of its own width (no multiple of an expert's): 384 beside 256-wide
    experts on one rank, and over two ranks where 384 does not split into 128-wide groups
    (rank 0 runs it alone); 512 beside 384-wide experts over two ranks (each rank half); fp8
    (its groups tile both widths)."""
    tiny = dict(GRANITE_SHARED, hidden_size=256, intermediate_size=inter, num_local_experts=8,
                num_hidden_layers=2, shared_intermediate_size=shared)
    folder = config_folder(tmp_path, "tiny-granite", tiny)
    c = read_hf_config(str(folder)).cfg
    assert (c.num_shared_experts, c.shared_intermediate_size) == (1, shared)
    from epmoe.weights import synthetic_layer

    lw = synthetic_layer(c, QuantConfig("bf16"), 0, 5, range(8))
    assert lw.shared.w13.data.shape == (1, 2 * shared, 256)  # the width the runtime runs
    rc, s = launch_in_process(tmp_path, ["--model", str(folder)], "--quant", "fp8_block",
                              *extra)
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]


def _granite_checkpoint(folder, e, d, i, s_width):
    """Granite's fused layout: router.layer [E, D], input_linear [E, 2I, D] (gate rows, then
    up), output_linear [E, D, I]; shared_mlp.input_linear [2S, D], output_linear [D, S]."""
    from safetensors.torch import save_file

    g, t = torch.Generator().manual_seed(31), {}
    for cl in (0, 1):
        moe, sh = f"model.layers.{cl}.block_sparse_moe.", f"model.layers.{cl}.shared_mlp."
        t[moe + "router.layer.weight"] = torch.randn(e, d, generator=g) * d ** -0.5
        t[moe + "input_linear.weight"] = (torch.randn(e, 2 * i, d, generator=g)
                                          * d ** -0.5).bfloat16()
        t[moe + "output_linear.weight"] = (torch.randn(e, d, i, generator=g) * i ** -0.5).bfloat16()
        t[sh + "input_linear.weight"] = (torch.randn(2 * s_width, d, generator=g)
                                         * d ** -0.5).bfloat16()
        t[sh + "output_linear.weight"] = (torch.randn(d, s_width, generator=g)
                                          * s_width ** -0.5).bfloat16()
    save_file(t, str(folder / "model.safetensors"))
    return t


@pytest.mark.timeout(300)
def test_a_granite_checkpoint_computes_as_its_modeling_code(tmp_path):
    """The fused tensors read into epmoe's [gate | up] rows: one expert and the shared MLP on
    the checkpoint's own tensors, computed as GraniteMoeMoE / GraniteMoeSharedMLP do
    (input_linear, chunk(2): silu(first) * second, output_linear), equal the oracle's MLP
    on what the loader read; then launches on one rank and on two (the 384-wide shared MLP
    does not split into 128-wide groups: rank 0 runs it)."""
    from epmoe.checkpoint import load_layer
    from epmoe.quant import dequantize_weight
    from epmoe.reference import expert_mlp_ref

    tiny = dict(GRANITE_SHARED, hidden_size=256, intermediate_size=128, num_local_experts=8,
                num_hidden_layers=2, shared_intermediate_size=384)
    folder = config_folder(tmp_path, "tiny-granite", tiny)
    t = _granite_checkpoint(folder, 8, 256, 128, 384)
    c = read_hf_config(str(folder)).cfg
    lw = load_layer(str(folder), None, c, QuantConfig("bf16"), 1, [5])
    x = torch.randn(6, 256, dtype=torch.float64)

    def granite_mlp(w_in, w_out):
        h = x @ w_in.double().T
        gate, up = h.chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w_out.double().T

    pre = "model.layers.1.block_sparse_moe."
    want = granite_mlp(t[pre + "input_linear.weight"][5], t[pre + "output_linear.weight"][5])
    got = expert_mlp_ref(x, dequantize_weight(lw.experts.w13)[0].double(),
                         dequantize_weight(lw.experts.w2)[0].double(), c, QuantConfig("bf16"),
                         fake_quant=False)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    sh = "model.layers.1.shared_mlp."
    want = granite_mlp(t[sh + "input_linear.weight"], t[sh + "output_linear.weight"])
    got = expert_mlp_ref(x, dequantize_weight(lw.shared.w13)[0].double(),
                         dequantize_weight(lw.shared.w2)[0].double(), c, QuantConfig("bf16"),
                         fake_quant=False)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lw.gate_ED, t[pre + "router.layer.weight"])
    for extra in ([], ["--ep", "2", "--no-dp"]):
        rc, s = launch_in_process(tmp_path, ["--weights", str(folder)], *extra)
        assert rc == 0 and s["correctness"]["passed"] is True, (extra, s["correctness"])


def _bmm_checkpoint(folder, naming, layers, e, d, i, shared_width=0, hub=True):
    """Llama 4 / Qwen3-VL's fused layout: gate_up_proj [E, D, 2I] (x @ w: gate columns, then
    up), down_proj [E, I, D]; hub=False: saved [E, 2I, D] / [E, D, I] instead (both read)."""
    from safetensors.torch import save_file

    from epmoe.checkpoint import NAMINGS

    nm, g, t = NAMINGS[naming], torch.Generator().manual_seed(41), {}
    for cl in layers:
        ex = nm["expert"].format(l=cl)
        t[nm["gate"].format(l=cl)] = torch.randn(e, d, generator=g) * d ** -0.5
        gu = (torch.randn(e, d, 2 * i, generator=g) * d ** -0.5).bfloat16()
        dn = (torch.randn(e, i, d, generator=g) * i ** -0.5).bfloat16()
        t[ex + "gate_up_proj"] = gu if hub else gu.transpose(1, 2).contiguous()
        t[ex + "down_proj"] = dn if hub else dn.transpose(1, 2).contiguous()
        if shared_width:
            sh = nm["shared"].format(l=cl)
            for n, shape in (("gate_proj", (shared_width, d)), ("up_proj", (shared_width, d)),
                             ("down_proj", (d, shared_width))):
                t[f"{sh}{n}.weight"] = (torch.randn(*shape, generator=g)
                                        * shape[1] ** -0.5).bfloat16()
    save_file(t, str(folder / "model.safetensors"))
    return t


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,hub", [("llama4", True), ("qwen3_vl", True),
                                        ("qwen3_vl", False)],
                         ids=["llama4", "qwen3-vl", "qwen3-vl-saved-out-in"])
def test_a_bmm_layout_checkpoint_computes_as_its_modeling_code(tmp_path, family, hub):
    """Llama4TextExperts / Qwen3VLMoeTextExperts: gate_up = x @ gate_up_proj[e], chunk(2):
    act(gate) * up, @ down_proj[e]; the loader's [gate | up] rows give the same in the oracle's
    MLP; a launch on the checkpoint passes."""
    from epmoe.checkpoint import NAMINGS, load_layer
    from epmoe.quant import dequantize_weight
    from epmoe.reference import expert_mlp_ref
    from tests.test_llama4 import SCOUT, SCOUT_TEXT

    if family == "llama4":
        tiny = dict(SCOUT, text_config=dict(SCOUT_TEXT, hidden_size=384, intermediate_size=128,
                                            num_local_experts=8, num_hidden_layers=2))
    else:
        tiny = dict(QWEN3_VL, text_config=dict(QWEN3_VL["text_config"], hidden_size=384,
                                               moe_intermediate_size=128, num_experts=8,
                                               num_experts_per_tok=2, num_hidden_layers=2))
    folder = config_folder(tmp_path, f"tiny-{family}", tiny)
    hf = read_hf_config(str(folder))
    c = hf.cfg
    t = _bmm_checkpoint(folder, hf.naming, hf.moe_layers, 8, 384, 128,
                        c.shared_intermediate if c.num_shared_experts else 0, hub)
    lw = load_layer(str(folder), None, c, QuantConfig("bf16"), 1, [6])
    ex = NAMINGS[hf.naming]["expert"].format(l=hf.moe_layers[1])
    gu, dn = t[ex + "gate_up_proj"][6].double(), t[ex + "down_proj"][6].double()
    if not hub:
        gu, dn = gu.T, dn.T
    x = torch.randn(5, 384, dtype=torch.float64)  # D != 2I: either layout reads
    gate, up = (x @ gu).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up) @ dn
    got = expert_mlp_ref(x, dequantize_weight(lw.experts.w13)[0].double(),
                         dequantize_weight(lw.experts.w2)[0].double(), c, QuantConfig("bf16"),
                         fake_quant=False)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (lw.shared is not None) == (family == "llama4")
    rc, s = launch_in_process(tmp_path, ["--weights", str(folder)])
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]


def test_a_multimodal_checkpoints_language_model_is_found_under_its_prefix(tmp_path):
    """GLM-4.5V keeps GLM-4.5's MoE layers (DeepSeek's names) under model.language_model.:
    the reader finds the router there and reads the layer; a launch passes the oracle."""
    from epmoe.checkpoint import load_layer

    glm_v = {"model_type": "glm4v_moe", "vision_config": {"depth": 2}, "text_config": dict(
        model_type="glm4v_moe_text", hidden_size=256, intermediate_size=512,
        moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, routed_scaling_factor=1.0, norm_topk_prob=True, n_group=1,
        topk_group=1, num_hidden_layers=3, first_k_dense_replace=1)}
    folder = config_folder(tmp_path, "tiny-glm-4.5v", glm_v)
    hf = read_hf_config(str(folder))
    t = _checkpoint(folder, hf.naming, hf.moe_layers, 8, 256, 128, 128,
                    prefix="model.language_model.layers.")
    lw = load_layer(str(folder), None, hf.cfg, QuantConfig("bf16"), 0, [2])
    torch.testing.assert_close(lw.gate_ED, t["model.language_model.layers.1.mlp.gate.weight"])
    torch.testing.assert_close(
        lw.bias_E, t["model.language_model.layers.1.mlp.gate.e_score_correction_bias"])
    assert lw.shared is not None
    rc, s = launch_in_process(tmp_path, ["--weights", str(folder)])
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]
    (folder / "model.safetensors").unlink()
    _checkpoint(folder, hf.naming, hf.moe_layers, 8, 256, 128, 128, prefix="elsewhere.")
    with pytest.raises(KeyError, match=r"tensor .model\.layers\.1\.mlp\..* not in checkpoint"):
        load_layer(str(folder), None, hf.cfg, QuantConfig("bf16"), 0, [2])
