"""Checkpoints that hold a family's tensors another common way, read as they hold them.

- Qwen3.5-MoE's release: experts fused as transformers 5 holds them (experts.gate_up_proj
  [E, 2I, D], gate rows then up; experts.down_proj [E, D, I]) under model.language_model.;
  its per-expert form (the FP8 release's names) reads to the same weights.
- Any per-expert family saved by transformers 5 (the same fused tensors) reads as its
  per-expert checkpoint does.
- One MLP's gate and up in one tensor: gate_up_proj (gate rows first), HunYuan's
  gate_and_up_proj (up rows first, as vLLM's loader splits it).
- DBRX: ffn.experts.mlp.w1 / v1 / w2 [E*I, D] (DbrxExpertGLU: x @ w1[e].T, x @ v1[e].T,
  (act(g) * u) @ w2[e]).

Each expert is computed here as its modeling code does, on the checkpoint's own float64
tensors, and compared with the oracle's MLP on what the loader read (1e-12); a gate/up swap
fails that. Launches on the checkpoint pass the float64 oracle."""

from __future__ import annotations

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.hf_config import read_hf_config
from tests.launch_util import config_folder, launch_in_process

QWEN35_TEXT = dict(model_type="qwen3_5_moe_text", hidden_size=256, num_hidden_layers=2,
                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                   shared_expert_intermediate_size=256)
QWEN35 = dict(model_type="qwen3_5_moe", text_config=QWEN35_TEXT,
              vision_config=dict(depth=2, hidden_size=64))
QWEN3 = dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512,
             moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
             num_hidden_layers=2, norm_topk_prob=True, decoder_sparse_step=1,
             mlp_only_layers=[], hidden_act="silu")
HUNYUAN = dict(model_type="hunyuan_v1_moe", hidden_size=256, intermediate_size=128,
               num_hidden_layers=2, hidden_act="silu", num_experts=8, moe_topk=[2, 2],
               moe_intermediate_size=[128, 128], num_shared_expert=[1, 1],
               use_mixed_mlp_moe=True)
DBRX = dict(model_type="dbrx", d_model=256, n_heads=4, n_layers=2,
            ffn_config=dict(ffn_hidden_size=128, moe_num_experts=8, moe_top_k=2,
                            ffn_act_fn={"name": "silu"}, moe_normalize_expert_weights=1))


def _w(g, *shape):
    return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).bfloat16()


def _save(folder, t):
    from safetensors.torch import save_file

    save_file(t, str(folder / "model.safetensors"))
    return t


def _oracle_mlp(lw_part, x, cfg):
    """The oracle's SwiGLU MLP on the loaded weights of one expert (or the shared MLP)."""
    from epmoe.quant import dequantize_weight
    from epmoe.reference import expert_mlp_ref

    return expert_mlp_ref(x, dequantize_weight(lw_part.w13)[0].double(),
                          dequantize_weight(lw_part.w2)[0].double(), cfg, QuantConfig("bf16"),
                          fake_quant=False)


def _silu_mlp(x, gate, up, down):
    """act(x @ gate.T) * (x @ up.T) @ down.T in float64 (every modeling code's SwiGLU)."""
    silu = torch.nn.functional.silu
    return (silu(x @ gate.double().T) * (x @ up.double().T)) @ down.double().T


def _qwen35_checkpoint(folder, e=8, d=256, i=128, s=256, fused=True):
    """Qwen3.5-MoE's names under model.language_model.: the experts fused (transformers 5)
    or one by one (the FP8 release's names, bf16 here); the same values either way."""
    g, t = torch.Generator().manual_seed(51), {}
    for cl in (0, 1):
        pre = f"model.language_model.layers.{cl}.mlp."
        t[pre + "gate.weight"] = _w(g, e, d)
        gu, dn = _w(g, e, 2 * i, d), _w(g, e, d, i)
        if fused:
            t[pre + "experts.gate_up_proj"], t[pre + "experts.down_proj"] = gu, dn
        else:
            for x in range(e):
                ex = f"{pre}experts.{x}."
                t[ex + "gate_proj.weight"] = gu[x, :i].clone()
                t[ex + "up_proj.weight"] = gu[x, i:].clone()
                t[ex + "down_proj.weight"] = dn[x].clone()
        sh = pre + "shared_expert."
        t[sh + "gate_proj.weight"], t[sh + "up_proj.weight"] = _w(g, s, d), _w(g, s, d)
        t[sh + "down_proj.weight"] = _w(g, d, s)
        t[pre + "shared_expert_gate.weight"] = _w(g, 1, d)
    return _save(folder, t)


@pytest.mark.timeout(300)
def test_qwen35_fused_experts_compute_as_its_modeling_code(tmp_path):
    """Qwen3_5MoeExperts: gate, up = linear(x, gate_up_proj[e]).chunk(2, -1);
    linear(act(gate) * up, down_proj[e]). The loader's weights give the same; the per-expert
    form of the same checkpoint reads to equal tensors; launches on one and two ranks pass."""
    from epmoe.checkpoint import load_layer

    folder = config_folder(tmp_path, "tiny-qwen35", QWEN35)
    hf = read_hf_config(str(folder))
    c = hf.cfg
    assert hf.naming == "qwen2_moe" and c.shared_gate
    t = _qwen35_checkpoint(folder)
    lw = load_layer(str(folder), None, c, QuantConfig("bf16"), 1, [3, 6])
    pre = "model.language_model.layers.1.mlp."
    x = torch.randn(6, 256, dtype=torch.float64)
    gate, up = (x @ t[pre + "experts.gate_up_proj"][6].double().T).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up) @ t[pre + "experts.down_proj"][6].double().T
    six = load_layer(str(folder), None, c, QuantConfig("bf16"), 1, [6]).experts
    torch.testing.assert_close(_oracle_mlp(six, x, c), want, rtol=1e-12, atol=1e-12)
    sh = pre + "shared_expert."
    torch.testing.assert_close(_oracle_mlp(lw.shared, x, c), _silu_mlp(
        x, t[sh + "gate_proj.weight"], t[sh + "up_proj.weight"], t[sh + "down_proj.weight"]),
        rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lw.shared_gate_D, t[pre + "shared_expert_gate.weight"][0].float())

    per = config_folder(tmp_path, "tiny-qwen35-per-expert", QWEN35)
    _qwen35_checkpoint(per, fused=False)
    lw2 = load_layer(str(per), None, c, QuantConfig("bf16"), 1, [3, 6])
    assert torch.equal(lw.experts.w13.data, lw2.experts.w13.data)
    assert torch.equal(lw.experts.w2.data, lw2.experts.w2.data)
    for extra in ([], ["--ep", "2", "--no-dp"]):
        rc, s = launch_in_process(tmp_path, ["--weights", str(folder)], *extra)
        assert rc == 0 and s["correctness"]["passed"] is True, (extra, s["correctness"])


def test_a_per_expert_family_saved_by_transformers5_reads_as_its_per_expert_checkpoint(
        tmp_path):
    from epmoe.checkpoint import load_layer

    g, per, fused = torch.Generator().manual_seed(52), {}, {}
    e, d, i = 8, 256, 128
    for cl in (0, 1):
        pre = f"model.layers.{cl}.mlp."
        per[pre + "gate.weight"] = fused[pre + "gate.weight"] = _w(g, e, d)
        gu, dn = _w(g, e, 2 * i, d), _w(g, e, d, i)
        fused[pre + "experts.gate_up_proj"], fused[pre + "experts.down_proj"] = gu, dn
        for x in range(e):
            per[f"{pre}experts.{x}.gate_proj.weight"] = gu[x, :i].clone()
            per[f"{pre}experts.{x}.up_proj.weight"] = gu[x, i:].clone()
            per[f"{pre}experts.{x}.down_proj.weight"] = dn[x].clone()
    a, b = config_folder(tmp_path, "per", QWEN3), config_folder(tmp_path, "tf5", QWEN3)
    _save(a, per)
    _save(b, fused)
    c = read_hf_config(str(a)).cfg
    for layer in (0, 1):
        la = load_layer(str(a), None, c, QuantConfig("bf16"), layer, [0, 5, 7])
        lb = load_layer(str(b), None, c, QuantConfig("bf16"), layer, [0, 5, 7])
        assert torch.equal(la.experts.w13.data, lb.experts.w13.data)
        assert torch.equal(la.experts.w2.data, lb.experts.w2.data)
        assert torch.equal(la.gate_ED, lb.gate_ED)
    # the gate/up halves are told apart: a swapped fused tensor reads to other weights
    swapped = {k: (torch.cat(v.chunk(2, dim=1)[::-1], dim=1) if k.endswith("gate_up_proj")
                   else v) for k, v in fused.items()}
    sw = config_folder(tmp_path, "tf5-swapped", QWEN3)
    _save(sw, swapped)
    ls = load_layer(str(sw), None, c, QuantConfig("bf16"), 0, [5])
    assert not torch.equal(ls.experts.w13.data, load_layer(
        str(a), None, c, QuantConfig("bf16"), 0, [5]).experts.w13.data)
    rc, s = launch_in_process(tmp_path, ["--weights", str(b)])
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]


@pytest.mark.parametrize("name,up_first", [("gate_and_up_proj", True), ("gate_up_proj", False)],
                         ids=["hunyuan-up-first", "gate-first"])
def test_one_mlps_fused_gate_and_up_reads_in_its_order(tmp_path, name, up_first):
    """HunYuan's release names: its shared MLP's gate_and_up_proj [2I, D] holds up's rows,
    then gate's (vLLM's loader: the first half to shard 1, up); a gate_up_proj holds gate's
    first. Experts fused per expert alike."""
    from epmoe.checkpoint import load_layer

    g, t = torch.Generator().manual_seed(53), {}
    e, d, i = 8, 256, 128
    for cl in (0, 1):
        pre = f"model.layers.{cl}.mlp."
        t[pre + "gate.wg.weight"] = _w(g, e, d).float()
        for sub in [f"experts.{x}." for x in range(e)] + ["shared_mlp."]:
            t[pre + sub + name + ".weight"] = _w(g, 2 * i, d)
            t[pre + sub + "down_proj.weight"] = _w(g, d, i)
    folder = config_folder(tmp_path, "tiny-hunyuan", HUNYUAN)
    _save(folder, t)
    c = read_hf_config(str(folder)).cfg
    lw = load_layer(str(folder), None, c, QuantConfig("bf16"), 1, [4])
    x = torch.randn(5, d, dtype=torch.float64)
    for part, sub in ((lw.experts, "experts.4."), (lw.shared, "shared_mlp.")):
        first, second = t[f"model.layers.1.mlp.{sub}{name}.weight"].chunk(2)
        gate, up = (second, first) if up_first else (first, second)
        want = _silu_mlp(x, gate, up, t[f"model.layers.1.mlp.{sub}down_proj.weight"])
        torch.testing.assert_close(_oracle_mlp(part, x, c), want, rtol=1e-12, atol=1e-12)
    rc, s = launch_in_process(tmp_path, ["--weights", str(folder)])
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]


def _dbrx_checkpoint(folder, e=8, d=256, i=128, rows=None):
    g, t = torch.Generator().manual_seed(54), {}
    for cl in (0, 1):
        pre = f"transformer.blocks.{cl}.ffn."
        t[pre + "router.layer.weight"] = _w(g, e, d)
        for n in ("w1", "v1"):
            t[pre + "experts.mlp." + n] = _w(g, rows or e * i, d)
        t[pre + "experts.mlp.w2"] = (torch.randn(rows or e * i, d, generator=g)
                                     * i ** -0.5).bfloat16()
    return _save(folder, t)


@pytest.mark.timeout(300)
def test_a_dbrx_checkpoint_computes_as_its_modeling_code(tmp_path):
    """DbrxExpertGLU: w1 / v1 / w2 viewed [E, I, D]; x @ w1[e].T, x @ v1[e].T,
    (act(gate) * up) @ w2[e]. The loader's weights give the same; launches on one rank and
    two pass; a checkpoint whose rows do not make E x I is refused by name."""
    from epmoe.checkpoint import load_layer

    folder = config_folder(tmp_path, "tiny-dbrx", DBRX)
    hf = read_hf_config(str(folder))
    c = hf.cfg
    assert hf.naming == "dbrx" and c.renormalize
    t = _dbrx_checkpoint(folder)
    lw = load_layer(str(folder), None, c, QuantConfig("bf16"), 1, [2])
    pre, i = "transformer.blocks.1.ffn.", 128
    w1, v1, w2 = (t[pre + "experts.mlp." + n].view(8, i, 256)[2] for n in ("w1", "v1", "w2"))
    x = torch.randn(5, 256, dtype=torch.float64)
    want = (torch.nn.functional.silu(x @ w1.double().T) * (x @ v1.double().T)) @ w2.double()
    torch.testing.assert_close(_oracle_mlp(lw.experts, x, c), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lw.gate_ED, t[pre + "router.layer.weight"].float())
    for extra in ([], ["--ep", "2", "--no-dp"]):
        rc, s = launch_in_process(tmp_path, ["--weights", str(folder)], *extra)
        assert rc == 0 and s["correctness"]["passed"] is True, (extra, s["correctness"])
    bad = config_folder(tmp_path, "tiny-dbrx-bad", DBRX)
    _dbrx_checkpoint(bad, rows=7 * i)
    with pytest.raises(ValueError, match=r"experts' w1 \(as \[E\*I, D\]\) has shape"):
        load_layer(str(bad), None, c, QuantConfig("bf16"), 0, [1])


def test_fp8_fused_experts_are_refused_by_name(tmp_path):
    from epmoe.checkpoint import load_layer
    from epmoe.quant import FP8_DTYPE

    g, t = torch.Generator().manual_seed(55), {}
    for cl in (0, 1):
        pre = f"model.layers.{cl}.mlp."
        t[pre + "gate.weight"] = _w(g, 8, 256)
        t[pre + "experts.gate_up_proj"] = _w(g, 8, 256, 256).to(FP8_DTYPE)
        t[pre + "experts.down_proj"] = _w(g, 8, 256, 128).to(FP8_DTYPE)
    folder = config_folder(tmp_path, "tf5-fp8", QWEN3)
    _save(folder, t)
    c = read_hf_config(str(folder)).cfg
    with pytest.raises(ValueError, match=r"experts.gate_up_proj' is torch.float8_e4m3fn"):
        load_layer(str(folder), None, c, QuantConfig("bf16"), 0, [1])
