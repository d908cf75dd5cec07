"""`launch --weights DIR`: the layers' weights from a Hugging Face checkpoint folder.

A tiny Qwen3-MoE-shaped checkpoint (its config.json: MoE layers are the checkpoint's layers 1
and 3) is written with random tensors; the ranks must hold exactly those tensors, and the
float64 oracle, reading the same folder, must agree with the run (one rank in-process, and two
Ray ranks with EPLB moving replicas of the real weights)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from epmoe.launch.checks import build_run
from epmoe.launch.cli import main, parser

CONFIG = dict(model_type="qwen3_moe", hidden_size=256, moe_intermediate_size=128,
              intermediate_size=512, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
              num_hidden_layers=4, decoder_sparse_step=2, hidden_act="silu")
MOE_LAYERS = (1, 3)


@pytest.fixture
def ckpt(tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "Tiny-Qwen3-MoE"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    d, i = CONFIG["hidden_size"], CONFIG["moe_intermediate_size"]
    g = torch.Generator().manual_seed(11)
    t = {}
    for cl in MOE_LAYERS:
        t[f"model.layers.{cl}.mlp.gate.weight"] = (torch.randn(16, d, generator=g) /
                                                   d ** 0.5).bfloat16()
        for e in range(16):
            pre = f"model.layers.{cl}.mlp.experts.{e}."
            for n, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
                t[pre + n + ".weight"] = (torch.randn(*shape, generator=g) /
                                          shape[1] ** 0.5).bfloat16()
    save_file(t, str(folder / "model.safetensors"))
    return folder, t


def _run(tmp_path, *flags):
    out = tmp_path / "s.json"
    rc = main([*flags, "--device", "cpu", "--quiet", "--out", str(out)])
    return rc, json.loads(out.read_text()) if out.exists() else None


def test_the_ranks_hold_the_checkpoints_tensors(ckpt):
    from epmoe.runtime import Runtime

    folder, t = ckpt
    run = build_run(parser().parse_args(["--weights", str(folder), "--tokens", "4"]))
    assert run.model == str(folder) and run.num_layers == 2  # --model defaults to the folder
    rt = Runtime(run, device="cpu")
    for layer, cl in zip(rt.layers, MOE_LAYERS):
        assert torch.equal(layer.weights.gate_ED, t[f"model.layers.{cl}.mlp.gate.weight"].float())
        w13 = layer.weights.experts.w13.data[7]
        assert torch.equal(w13[:128], t[f"model.layers.{cl}.mlp.experts.7.gate_proj.weight"])
        assert torch.equal(w13[128:], t[f"model.layers.{cl}.mlp.experts.7.up_proj.weight"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("quant", ["bf16", "fp8_block"])
def test_one_rank_on_checkpoint_weights_passes_the_oracle(ckpt, tmp_path, quant):
    folder, _ = ckpt
    rc, s = _run(tmp_path, "--weights", str(folder), "--quant", quant, "--tokens", "16",
                 "--steps", "2")
    c = s["correctness"]
    assert rc == 0 and c["passed"] is True, c
    assert s["config"]["weights"] == str(folder) and len(c["per_layer"]) == 2


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_two_ranks_with_eplb_move_the_real_weights(ckpt, tmp_path):
    """Replicas and a rebalance move checkpoint weights between ranks; the oracle, reading the
    checkpoint, checks the last step (after the rebalance)."""
    folder, _ = ckpt
    rc, s = _run(tmp_path, "--weights", str(folder), "--ep", "2", "--tokens", "8", "--steps",
                 "3", "--eplb", "--redundant-experts", "2", "--rebalance-every", "1",
                 "--routing", "zipf:1.5", "--timeout", "120")
    c = s["correctness"]
    assert rc == 0 and c["passed"] is True, c
    assert s["eplb"]["rebalances"] >= 1 and s["eplb"]["slots_moved"] > 0, s["eplb"]["events"]


@pytest.mark.parametrize("flags,msg", [
    (["--weights", "{missing}"], "nope': no such folder"),
    (["--weights", "{bare}"], "no Hugging Face config.json there"),
    (["--weights", "{empty}"], "no .safetensors files"),
    (["--weights", "{ckpt}", "--model", "mixtral-tiny"],
     "its config.json has moe_intermediate 128, --model mixtral-tiny has 256"),
    (["--weights", "{ckpt}", "--layers", "3"], "--layers 3: the checkpoint"),
])
def test_a_checkpoint_that_does_not_fit_is_exit_2_before_any_rank(ckpt, tmp_path, capsys,
                                                                 flags, msg):
    folder, _ = ckpt
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "bare").mkdir()
    paths = dict(missing=tmp_path / "nope", empty=empty, ckpt=folder, bare=tmp_path / "bare")
    argv = [f.format(**paths) for f in flags]
    rc, _ = _run(tmp_path, *argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and re.search(msg, err), err


@pytest.mark.parametrize("quant", ["bf16", "fp8_block"])
def test_the_oracle_reads_each_expert_alone_and_the_router_once(ckpt, monkeypatch, quant):
    """The lazy oracle reads one expert at a time (load_experts: the layer's experts only, the
    same values as load_layer's) and the router once, not again per expert."""
    import epmoe.checkpoint as ck
    from epmoe.launch.oracle import LazyOracleLayer
    from epmoe.quant import dequantize_weight

    folder, _ = ckpt
    run = build_run(parser().parse_args(["--weights", str(folder), "--tokens", "4",
                                         "--quant", quant]))
    whole = ck.load_layer(str(folder), None, run.cfg, run.quant, 1, range(16))
    reads, real = [], ck._finish_layer

    def counted(*a, **kw):
        reads.append(a[5].expert_ids_E.tolist())  # the experts it finishes a layer with
        return real(*a, **kw)

    monkeypatch.setattr(ck, "_finish_layer", counted)
    lazy = LazyOracleLayer(run, 1)
    for e in (3, 9, 3, 15):
        assert torch.equal(lazy.w13[e], dequantize_weight(whole.experts.w13)[e].double())
        assert torch.equal(lazy.w2[e], dequantize_weight(whole.experts.w2)[e].double())
    assert torch.equal(lazy.gate, whole.gate_ED.double())
    assert reads == [[]]  # the router (with no experts) read once, at construction
