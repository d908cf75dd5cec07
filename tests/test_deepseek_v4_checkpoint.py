"""DeepSeek-V4's checkpoints as its hub release holds them (`--weights path/to/DeepSeek-V4`).

DeepSeek's own layout, no "model." prefix: layers.{l}.ffn.gate.weight and gate.bias (the
selection bias; hash layers hold gate.tid2eid instead), experts.{e}.w1 / w3 / w2 (gate / up /
down) in MXFP4: e2m1 codes two a byte [N, K/2] (int8 or torch's float4_e2m1fn_x2) and an e8m0
`scale` per 32 of a row [N, K/32]; shared_experts.w1 / w3 / w2 in fp8 e4m3 with an e8m0
`scale` per 128x128 block. Anchors, re-written here in float64 from DeepSeek-V4's inference
code (model.py's Linear, Expert and Gate): a weight is its code's value x 2**(scale - 127)
(low nibble = even column); Expert.forward clamps up to +-swiglu_limit and gate to <= it for
routed experts, the shared expert (built without the limit) does not clamp."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.hf_config import read_hf_config
from tests.launch_util import config_folder, launch_in_process
from tests.test_deepseek_v4 import V4

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TINY = dict(V4, hidden_size=256, moe_intermediate_size=128, n_routed_experts=8,
            num_experts_per_tok=2, num_hidden_layers=3, num_hash_layers=1, swiglu_limit=4.0,
            expert_dtype="fp4", quantization_config=dict(
                quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0", weight_block_size=[128, 128],
                activation_scheme="dynamic"))


def _mxfp4(g, n, k, as_fp4):
    """A random MXFP4 projection [n, k] as stored, and its value in float64 (computed here
    from the codes, not by epmoe)."""
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    exps = torch.randint(118, 128, (n, k // 32), generator=g, dtype=torch.uint8)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(n, k).long()
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    value = torch.where(codes >= 8, -mag, mag) * torch.pow(2.0, exps.double() - 127) \
        .repeat_interleave(32, dim=1)
    w = packed.view(torch.float4_e2m1fn_x2) if as_fp4 else packed.view(torch.int8)
    return w, exps.view(torch.float8_e8m0fnu), value


def _fp8_block(g, n, k):
    w = (torch.randn(n, k, generator=g) * 0.5).to(torch.float8_e4m3fn)
    exps = torch.randint(118, 128, (-(-n // 128), -(-k // 128)), generator=g, dtype=torch.uint8)
    s = torch.pow(2.0, exps.double() - 127).repeat_interleave(128, 0)[:n] \
        .repeat_interleave(128, 1)[:, :k]
    return w, exps.view(torch.float8_e8m0fnu), w.double() * s


def _v4_checkpoint(folder, as_fp4, e=8, d=256, i=128):
    """Layers 0 (hash-routed) to 2 in the hub layout; returns the float64 values by name."""
    from safetensors.torch import save_file

    g, t, want = torch.Generator().manual_seed(44), {}, {}
    for cl in range(3):
        pre = f"layers.{cl}.ffn."
        t[pre + "gate.weight"] = (torch.randn(e, d, generator=g) * d ** -0.5).bfloat16()
        if cl == 0:
            t[pre + "gate.tid2eid"] = torch.randint(0, e, (129280, 2), generator=g,
                                                    dtype=torch.int32)
        else:
            t[pre + "gate.bias"] = torch.randn(e, generator=g) * 0.05
        mlps = [(f"{pre}experts.{x}.", True) for x in range(e)] + [(pre + "shared_experts.", False)]
        for mlp, routed in mlps:
            for proj, (n, k) in (("w1", (i, d)), ("w3", (i, d)), ("w2", (d, i))):
                w, s, v = _mxfp4(g, n, k, as_fp4) if routed else _fp8_block(g, n, k)
                t[mlp + proj + ".weight"], t[mlp + proj + ".scale"] = w, s
                want[mlp + proj] = v
    save_file(t, str(folder / "model-00001-of-00001.safetensors"))
    return t, want


def _expert_forward(x, w1, w3, w2, limit):
    """model.py Expert.forward in float64 (weights already dequantized)."""
    gate, up = x @ w1.T, x @ w3.T
    if limit:
        up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
    return (torch.nn.functional.silu(gate) * up) @ w2.T


@pytest.mark.parametrize("as_fp4", [False, True], ids=["int8-codes", "float4_e2m1fn_x2"])
def test_the_hub_layout_reads_to_its_values(tmp_path, as_fp4):
    """MXFP4 experts and the fp8 shared MLP read to exactly their values (bf16 holds them:
    e2m1 and e4m3 times a power of two), and with recipe w4a8_mxfp4 the experts keep them
    (the same codes, rescaled by powers of two); the router's weight and bias as stored;
    routed and shared MLPs on the loaded weights compute as V4's Expert.forward."""
    from epmoe.checkpoint import load_layer
    from epmoe.quant import dequantize_weight
    from epmoe.reference import expert_mlp_ref

    folder = config_folder(tmp_path, "Tiny-V4", TINY)
    hf = read_hf_config(str(folder))
    c = hf.cfg
    assert hf.naming == "deepseek_v4" and hf.moe_layers == (0, 1, 2)
    assert c.hash_layers == (0,)
    assert hf.stored_recipe == "w4a8_mxfp4"
    t, want = _v4_checkpoint(folder, as_fp4)
    ids = [3, 6]
    x = torch.randn(5, 256, dtype=torch.float64)
    for recipe in ("bf16", "w4a8_mxfp4"):
        q = QuantConfig(recipe)
        lw = load_layer(str(folder), None, c, q, 2, ids)
        w13, w2 = dequantize_weight(lw.experts.w13).double(), dequantize_weight(lw.experts.w2)
        for n, e in enumerate(ids):
            pre = f"layers.2.ffn.experts.{e}."
            assert torch.equal(w13[n], torch.cat([want[pre + "w1"], want[pre + "w3"]])), recipe
            assert torch.equal(w2[n].double(), want[pre + "w2"]), recipe
            got = expert_mlp_ref(x, w13[n], w2[n].double(), c, QuantConfig("bf16"),
                                 fake_quant=False)
            ref = _expert_forward(x, want[pre + "w1"], want[pre + "w3"], want[pre + "w2"],
                                  c.swiglu_limit)
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        assert torch.equal(lw.gate_ED, t["layers.2.ffn.gate.weight"].float())
        assert torch.equal(lw.bias_E, t["layers.2.ffn.gate.bias"])
    lw = load_layer(str(folder), None, c, QuantConfig("bf16"), 2, ids)
    assert lw.tid2eid_VK is None
    sh, s13, s2 = "layers.2.ffn.shared_experts.", *(dequantize_weight(w)[0].double()
                                                     for w in (lw.shared.w13, lw.shared.w2))
    assert torch.equal(s13, torch.cat([want[sh + "w1"], want[sh + "w3"]]))
    assert torch.equal(s2, want[sh + "w2"])
    got = expert_mlp_ref(x, s13, s2, c.shared_mlp_cfg, QuantConfig("bf16"), fake_quant=False)
    ref = _expert_forward(x, want[sh + "w1"], want[sh + "w3"], want[sh + "w2"], None)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(ref, _expert_forward(x, want[sh + "w1"], want[sh + "w3"],
                                                   want[sh + "w2"], c.swiglu_limit))


@pytest.mark.timeout(300)
def test_a_v4_checkpoint_launches_against_the_oracle(tmp_path):
    """Its three MoE layers (layer 0 routes by token id through the checkpoint's table) on one
    rank and on two, bf16 and the checkpoint's own w4a8_mxfp4."""
    folder = config_folder(tmp_path, "Tiny-V4", TINY)
    _v4_checkpoint(folder, as_fp4=False)
    for extra in ([], ["--ep", "2", "--no-dp", "--quant", "w4a8_mxfp4"]):
        rc, s = launch_in_process(tmp_path, ["--weights", str(folder)], *extra)
        assert rc == 0 and s["correctness"]["passed"] is True, (extra, s["correctness"])
        assert len(s["correctness"]["per_layer"]) == 3
        assert s["correctness"]["router"]["agreement"] == 1.0


def test_transformers_names_for_v4_are_read_too(tmp_path):
    """A V4 checkpoint saved under transformers' names (model.layers.{l}.mlp., DeepSeek-V3's
    scheme) is found through the naming's alternative."""
    from safetensors.torch import save_file

    from epmoe.checkpoint import load_layer

    folder = config_folder(tmp_path, "Tiny-V4-hf", TINY)
    c = read_hf_config(str(folder)).cfg
    g, t, pre = torch.Generator().manual_seed(5), {}, "model.layers.2.mlp."
    t[pre + "gate.weight"] = torch.randn(8, 256, generator=g)
    t[pre + "gate.e_score_correction_bias"] = torch.randn(8, generator=g)
    for mlp in [f"{pre}experts.{x}." for x in range(8)] + [pre + "shared_experts."]:
        for proj, shape in (("gate_proj", (128, 256)), ("up_proj", (128, 256)),
                            ("down_proj", (256, 128))):
            t[mlp + proj + ".weight"] = torch.randn(*shape, generator=g).bfloat16()
    save_file(t, str(folder / "model.safetensors"))
    lw = load_layer(str(folder), None, c, QuantConfig("bf16"), 2, [4])
    assert torch.equal(lw.bias_E, t[pre + "gate.e_score_correction_bias"])
    assert torch.equal(lw.experts.w13.data[0], torch.cat([t[pre + "experts.4.gate_proj.weight"],
                                                          t[pre + "experts.4.up_proj.weight"]]))
    (folder / "model.safetensors").unlink()
    save_file({"elsewhere.weight": torch.zeros(1)}, str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match=r"tensor 'layers\.2\.ffn\..*' not in checkpoint"):
        load_layer(str(folder), None, c, QuantConfig("bf16"), 2, [4])


def test_a_hash_layers_table_is_read_beside_its_gate(tmp_path):
    """Layer 0 routes by token id: its gate.tid2eid [vocab, K] read as stored, no bias;
    a table of the wrong shape or with ids outside the experts is refused by name."""
    from safetensors.torch import load_file, save_file

    from epmoe.checkpoint import load_layer

    folder = config_folder(tmp_path, "Tiny-V4", TINY)
    t, _ = _v4_checkpoint(folder, as_fp4=False)
    c = read_hf_config(str(folder)).cfg
    lw = load_layer(str(folder), None, c, QuantConfig("bf16"), 0, [1])
    assert torch.equal(lw.tid2eid_VK, t["layers.0.ffn.gate.tid2eid"]) and lw.bias_E is None
    f = folder / "model-00001-of-00001.safetensors"
    for bad, match in ((t["layers.0.ffn.gate.tid2eid"][:, :1].contiguous(), r"tid2eid"),
                       (t["layers.0.ffn.gate.tid2eid"] + 8, r"must hold expert ids in \[0, 8\)")):
        tensors = load_file(str(f))
        tensors["layers.0.ffn.gate.tid2eid"] = bad
        save_file(tensors, str(f))
        with pytest.raises(ValueError, match=match):
            load_layer(str(folder), None, c, QuantConfig("bf16"), 0, [1])
