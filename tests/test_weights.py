"""epmoe.weights: deterministic synthetic weights, TP slices, and safetensors checkpoints.

Checkpoints are written here (tmp_path) in the three namings, holding only some experts: a
loader that touched any other expert would fail with a KeyError. Loaded layers are run against
the oracle built from the same tensors (`layer_to_oracle`)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from epmoe.comm.local import LocalComm
from epmoe.config import QuantConfig, get_preset
from epmoe.experts.torch_experts import TorchExperts
from epmoe.layer import MoELayer
from epmoe.plan.forms import LayerPlan
from epmoe.quant import FP8_DTYPE, QWeight, dequantize_weight, quantize_weight
from epmoe.reference import TOLERANCE, max_rel_err, reference_moe
from epmoe.router import route
import epmoe.weights as weights_mod
from epmoe.checkpoint import SafetensorsCheckpoint, load_layer
from epmoe.weights import (
    counter_normal, dequantized_full_layer, layer_to_oracle, synthetic_layer, weight_key,
)

RECIPES = [("bf16", "fp32"), ("fp8_block", "fp32"), ("mxfp8", "fp32"), ("w4a8_mxfp4", "fp32"),
           ("fp8_block", "ue8m0_fp32")]


def _same_qweight(a: QWeight, b: QWeight) -> bool:
    """Bit-identical data and scales."""
    def raw(t):
        return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
    return (a.recipe == b.recipe and a.scale_fmt == b.scale_fmt
            and torch.equal(raw(a.data), raw(b.data))
            and ((a.scale is None and b.scale is None) or torch.equal(a.scale, b.scale)))


# ------------------------------------------------------------------------------ synthetic

@pytest.mark.parametrize("recipe,fmt", RECIPES)
def test_synthetic_is_deterministic_and_per_expert(recipe, fmt, seed):
    cfg, quant = get_preset("deepseek-v3-tiny"), QuantConfig(recipe, fmt)
    full = synthetic_layer(cfg, quant, 1, seed, range(cfg.num_experts))
    again = synthetic_layer(cfg, quant, 1, seed, range(cfg.num_experts))
    assert _same_qweight(full.experts.w13, again.experts.w13), f"{seed=}"
    assert _same_qweight(full.experts.w2, again.experts.w2), f"{seed=}"
    assert _same_qweight(full.shared.w13, again.shared.w13)
    assert torch.equal(full.gate_ED, again.gate_ED) and torch.equal(full.bias_E, again.bias_E)
    for e in (0, 7, cfg.num_experts - 1):
        alone = synthetic_layer(cfg, quant, 1, seed, [e])
        assert _same_qweight(alone.experts.w13, full.experts.w13.select([e])), f"{e=} {seed=}"
        assert _same_qweight(alone.experts.w2, full.experts.w2.select([e])), f"{e=} {seed=}"
        assert alone.experts.expert_ids_E.tolist() == [e]
    other = synthetic_layer(cfg, quant, 1, seed + 1, [0])
    assert not torch.equal(dequantize_weight(other.experts.w13),
                           dequantize_weight(full.experts.w13.select([0])))
    layer0 = synthetic_layer(cfg, quant, 0, seed, [0])
    assert not torch.equal(dequantize_weight(layer0.experts.w13),
                           dequantize_weight(full.experts.w13.select([0])))


def test_synthetic_scales_keep_activations_order_one(seed):
    cfg = get_preset("qwen3-moe-tiny")
    o = dequantized_full_layer(cfg, QuantConfig(), 0, seed)
    w13, w2 = o.w13, o.w2
    assert w13.shape == (16, 256, 256) and w2.shape == (16, 256, 128)
    assert 0.8 < float(w13.std() * cfg.hidden ** 0.5) < 1.2
    assert 0.8 < float(w2.std() * cfg.moe_intermediate ** 0.5) < 1.2


@pytest.mark.parametrize("recipe,fmt", RECIPES)
def test_tp_slices_concatenate_to_the_whole(recipe, fmt, seed):
    cfg, quant = get_preset("mixtral-tiny"), QuantConfig(recipe, fmt)  # intermediate 256
    i = cfg.moe_intermediate
    ids = [1, 6]
    whole = synthetic_layer(cfg, quant, 0, seed, ids)
    w13 = dequantize_weight(whole.experts.w13)
    w2 = dequantize_weight(whole.experts.w2)
    for tp in (2,):
        n = i // tp
        parts = [synthetic_layer(cfg, quant, 0, seed, ids, inter_slice=(r * n, n))
                 for r in range(tp)]
        p13 = [dequantize_weight(p.experts.w13) for p in parts]
        gate = torch.cat([p[:, :n] for p in p13], 1)
        up = torch.cat([p[:, n:] for p in p13], 1)
        down = torch.cat([dequantize_weight(p.experts.w2) for p in parts], 2)
        assert torch.equal(torch.cat([gate, up], 1), w13), f"{tp=} {seed=}"
        assert torch.equal(down, w2), f"{tp=} {seed=}"
        # the plan's slices are the same slices
        for r in range(tp):
            assert LayerPlan("tp", rank=r, world=tp).inter_slice(cfg) == (r * n, n)


def test_shared_slices_concatenate_to_the_whole(seed):
    cfg, quant = get_preset("deepseek-v3-tiny"), QuantConfig("bf16")  # shared width 128
    whole = synthetic_layer(cfg, quant, 0, seed, [])
    assert whole.experts.num_experts == 0
    halves = [synthetic_layer(cfg, quant, 0, seed, [], shared_slice=(r * 64, 64))
              for r in range(2)]
    w13 = dequantize_weight(whole.shared.w13)[0]
    h13 = [dequantize_weight(h.shared.w13)[0] for h in halves]
    assert torch.equal(torch.cat([h13[0][:64], h13[1][:64], h13[0][64:], h13[1][64:]]), w13)
    assert torch.equal(torch.cat([dequantize_weight(h.shared.w2)[0] for h in halves], 1),
                       dequantize_weight(whole.shared.w2)[0])


def _py_counter_normal(i: int, key, std: float) -> float:
    """Element i of counter_normal, in Python integers (the generator's definition)."""
    k1, k2 = key
    m = 0xFFFFFFFF

    def h(x):
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & m
        x ^= (x >> 15) ^ k2
        x = (x * 0x735A2D97) & m
        return x ^ (x >> 15)

    h1, h2 = h((2 * i) ^ k1), h((2 * i + 1) ^ k1)
    s = (h1 & 0xFFFF) + (h1 >> 16) + (h2 & 0xFFFF) + (h2 >> 16) - 2 * 65535
    scale = torch.tensor(std / ((65536 ** 2 - 1) / 3) ** 0.5, dtype=torch.float32)
    return float(torch.tensor(float(s), dtype=torch.float32) * scale)


def test_counter_normal_is_its_integer_definition_at_any_block_size(monkeypatch, seed):
    key, shape, std = weight_key(seed, 2, 5, "w13"), (37, 29), 0.3
    whole = counter_normal(shape, key, std)
    monkeypatch.setattr(weights_mod, "_CPU_BLOCK", 100)  # blocks end mid-row, last one short
    assert torch.equal(counter_normal(shape, key, std), whole)
    flat = whole.reshape(-1)
    g = torch.Generator().manual_seed(seed)
    for i in [0, 99, 100, flat.numel() - 1, *torch.randint(flat.numel(), (20,), generator=g)]:
        assert float(flat[int(i)]) == _py_counter_normal(int(i), key, std), f"{i=} {seed=}"
    assert weight_key(seed, 2, 5, "w2") != key and weight_key(seed, 2, 6, "w13") != key


def test_counter_normal_moments_and_range(seed):
    x = counter_normal((256, 1024), weight_key(seed, 0, 0, "w13"), 2.0).double()
    assert abs(float(x.mean())) < 0.02 and abs(float(x.std()) / 2.0 - 1) < 0.01
    assert float(x.abs().max()) <= 2.0 * 12 ** 0.5 * 1.0001  # four uniforms: +-2 sqrt(3) std


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,fmt", RECIPES)
def test_synthetic_layer_on_gpu_is_bit_identical_to_cpu(recipe, fmt, seed):
    """What a rank generates on its device is what the CPU oracle rebuilds."""
    cfg, quant = get_preset("deepseek-v3-tiny"), QuantConfig(recipe, fmt)
    ids = [0, 5, cfg.num_experts - 1]
    cpu = synthetic_layer(cfg, quant, 1, seed, ids)
    gpu = synthetic_layer(cfg, quant, 1, seed, ids, device="cuda")
    assert gpu.experts.w13.data.is_cuda
    for a, b in ((cpu.experts.w13, gpu.experts.w13), (cpu.experts.w2, gpu.experts.w2),
                 (cpu.shared.w13, gpu.shared.w13), (cpu.shared.w2, gpu.shared.w2)):
        assert _same_qweight(a, b.to("cpu")), f"{recipe=} {fmt=} {seed=}"
    assert torch.equal(cpu.gate_ED, gpu.gate_ED.cpu()) and torch.equal(cpu.bias_E, gpu.bias_E.cpu())
    full = (2048, 7168)  # a DeepSeek-V3-sized tensor (float32 ops, one pass on the GPU)
    key = weight_key(seed, 0, 3, "w13")
    assert torch.equal(counter_normal(full, key, 0.01),
                       counter_normal(full, key, 0.01, device="cuda").cpu())


def test_bad_slice_raises():
    cfg = get_preset("mixtral-tiny")
    with pytest.raises(ValueError, match=r"intermediate slice \(200, 128\) outside \[0, 256\)"):
        synthetic_layer(cfg, QuantConfig(), 0, 0, [0], inter_slice=(200, 128))


# ------------------------------------------------------------------------------ safetensors

def _fp8_block(w: torch.Tensor):
    """fp32 [N, K] -> (fp8 [N, K], fp32 weight_scale_inv [N/128, K/128]) as DeepSeek stores."""
    q = quantize_weight(w[None], QuantConfig("fp8_block"))
    return q.data[0].contiguous(), q.scale[0].contiguous()


def _expert_tensors(naming, layer, e, d, i, g, fp8=False, dtype=torch.bfloat16):
    pre = {"deepseek": f"model.layers.{layer}.mlp.experts.{e}.",
           "qwen3_moe": f"model.layers.{layer}.mlp.experts.{e}.",
           "mixtral": f"model.layers.{layer}.block_sparse_moe.experts.{e}.",
           "shared": f"model.layers.{layer}.mlp.shared_experts."}[naming]
    names = ("w1", "w3", "w2") if naming == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    shapes = ((i, d), (i, d), (d, i))
    out = {}
    for name, (n, k) in zip(names, shapes):
        w = torch.randn(n, k, generator=g) / k ** 0.5
        if fp8:
            out[pre + name + ".weight"], out[pre + name + ".weight_scale_inv"] = _fp8_block(w)
        else:
            out[pre + name + ".weight"] = w.to(dtype).contiguous()
    return pre, names, out


class _Recorder(SafetensorsCheckpoint):
    """Records every tensor name read."""

    def __init__(self, path):
        super().__init__(path)
        self.read = []

    def get(self, name):
        self.read.append(name)
        return super().get(name)


def _run_layer_vs_oracle(lw, cfg, quant, loaded_ids, seed, t=32):
    """Route all experts, run the loaded ones (others are not on this 'rank'), compare with the
    oracle built from the same loaded tensors."""
    emap = torch.full((cfg.num_experts,), -1, dtype=torch.int32)
    emap[loaded_ids] = torch.arange(len(loaded_ids), dtype=torch.int32)
    shared = TorchExperts(lw.shared, cfg, quant) if lw.shared is not None else None
    layer = MoELayer(cfg, quant, lw, LayerPlan("ep_dp"), LocalComm(cfg, quant, emap),
                     TorchExperts(lw.experts, cfg, quant), shared)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, cfg.hidden, generator=g).to(torch.bfloat16)
    out = layer.forward(x)
    r = layer.last_routing
    want = route(x.float() @ lw.gate_ED.T, cfg, lw.bias_E)
    assert torch.equal(r.topk_ids_TK, want.topk_ids_TK)
    local = emap[r.topk_ids_TK.long()]
    assert (local >= 0).any(), "no token reached a loaded expert"
    ref = reference_moe(x, layer_to_oracle(lw), cfg, quant, local, r.topk_weights_TK)
    err = max_rel_err(out, ref)
    assert err <= TOLERANCE[quant.recipe], f"rel err {err:.2e} {quant} {seed=}"


@pytest.mark.parametrize("recipe", ["fp8_block", "bf16", "mxfp8"])
def test_deepseek_fp8_checkpoint(tmp_path, recipe, seed):
    cfg = get_preset("deepseek-v3-tiny")  # D 256, I 128, 16 experts, 1 shared
    quant = QuantConfig(recipe)
    d, i, cl = cfg.hidden, cfg.moe_intermediate, 3  # checkpoint layer 3 = MoE layer 0
    g = torch.Generator().manual_seed(seed)
    have = [2, 5, 11]  # the checkpoint holds only these experts
    tensors, experts = {}, {}
    for e in have:
        pre, names, t = _expert_tensors("deepseek", cl, e, d, i, g, fp8=True)
        tensors.update(t)
        experts[e] = [(t[pre + n + ".weight"], t[pre + n + ".weight_scale_inv"]) for n in names]
    spre, snames, st = _expert_tensors("shared", cl, None, d, i, g, fp8=True)
    tensors.update(st)
    gate = torch.randn(cfg.num_experts, d, generator=g) / d ** 0.5
    bias = torch.randn(cfg.num_experts, generator=g) * 0.1
    tensors[f"model.layers.{cl}.mlp.gate.weight"] = gate.to(torch.bfloat16)
    tensors[f"model.layers.{cl}.mlp.gate.e_score_correction_bias"] = bias
    save_file(tensors, str(tmp_path / "model.safetensors"))

    load = [11, 2]
    ckpt = _Recorder(str(tmp_path))
    lw = load_layer(ckpt, "deepseek", cfg, quant, 0, load, ckpt_layer=cl)
    assert not [n for n in ckpt.read if ".experts.5." in n], "read an expert not asked for"
    assert lw.experts.expert_ids_E.tolist() == load
    assert torch.equal(lw.gate_ED, gate.to(torch.bfloat16).float())
    assert torch.equal(lw.bias_E, bias)

    def deq(w, s):
        return w.float() * s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)

    if recipe == "fp8_block":  # fp8 bytes and scales kept exactly
        want13 = torch.stack([torch.cat([experts[e][0][0], experts[e][1][0]]) for e in load])
        want_s13 = torch.stack([torch.cat([experts[e][0][1], experts[e][1][1]]) for e in load])
        assert lw.experts.w13.data.dtype == FP8_DTYPE
        assert torch.equal(lw.experts.w13.data.view(torch.uint8), want13.view(torch.uint8))
        assert torch.equal(lw.experts.w13.scale, want_s13)
        want2 = torch.stack([experts[e][2][0] for e in load])
        assert torch.equal(lw.experts.w2.data.view(torch.uint8), want2.view(torch.uint8))
        assert torch.equal(lw.experts.w2.scale, torch.stack([experts[e][2][1] for e in load]))
    else:  # dequantized, then quantized with the recipe
        w13 = torch.stack([torch.cat([deq(*experts[e][0]), deq(*experts[e][1])]) for e in load])
        assert _same_qweight(lw.experts.w13, quantize_weight(w13, quant))
        w2 = torch.stack([deq(*experts[e][2]) for e in load])
        assert _same_qweight(lw.experts.w2, quantize_weight(w2, quant))
    sw13 = torch.cat([deq(*[st[spre + n + s] for s in (".weight", ".weight_scale_inv")])
                      for n in snames[:2]])
    assert _same_qweight(lw.shared.w13, quantize_weight(sw13[None], quant))
    _run_layer_vs_oracle(lw, cfg, quant, load, seed)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "w4a8_mxfp4"])
def test_qwen3_moe_sharded_checkpoint(tmp_path, recipe, seed):
    cfg = get_preset("qwen3-moe-tiny")  # 16 experts, no shared
    quant = QuantConfig(recipe)
    d, i, layer = cfg.hidden, cfg.moe_intermediate, 1
    g = torch.Generator().manual_seed(seed)
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    written = {}
    files = list(shards)
    for e in range(cfg.num_experts):
        pre, names, t = _expert_tensors("qwen3_moe", layer, e, d, i, g)
        shards[files[e // 8]].update(t)
        written[e] = [t[pre + n + ".weight"] for n in names]
    gate = torch.randn(cfg.num_experts, d, generator=g) / d ** 0.5
    shards[files[0]][f"model.layers.{layer}.mlp.gate.weight"] = gate
    weight_map = {}
    for fn, tensors in shards.items():
        save_file(tensors, str(tmp_path / fn))
        weight_map.update({k: fn for k in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))

    # experts of the first shard only: the second file is never opened
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    lw = load_layer(ckpt, "qwen3_moe", cfg, quant, layer, [3, 1])
    assert set(ckpt._handles) == {files[0]}
    assert lw.bias_E is None and lw.shared is None
    assert torch.equal(lw.gate_ED, gate)

    load = [1, 9, 14]
    lw = load_layer(str(tmp_path), "qwen3_moe", cfg, quant, layer, load)
    w13 = torch.stack([torch.cat(written[e][:2]) for e in load])
    w2 = torch.stack([written[e][2] for e in load])
    if recipe == "bf16":
        assert torch.equal(lw.experts.w13.data, w13) and torch.equal(lw.experts.w2.data, w2)
    assert _same_qweight(lw.experts.w13, quantize_weight(w13.float(), quant))
    assert _same_qweight(lw.experts.w2, quantize_weight(w2.float(), quant))
    _run_layer_vs_oracle(lw, cfg, quant, load, seed)


@pytest.mark.parametrize("recipe", ["fp8_block", "bf16"])
def test_mixtral_checkpoint(tmp_path, recipe, seed):
    cfg = get_preset("mixtral-tiny")  # 8 experts, top 2, I 256
    quant = QuantConfig(recipe)
    d, i = cfg.hidden, cfg.moe_intermediate
    g = torch.Generator().manual_seed(seed)
    have = [0, 3, 6]
    tensors, written = {}, {}
    for e in have:
        pre, names, t = _expert_tensors("mixtral", 0, e, d, i, g, dtype=torch.float32)
        tensors.update(t)
        written[e] = [t[pre + n + ".weight"] for n in names]  # w1 gate, w3 up, w2 down
    gate = torch.randn(cfg.num_experts, d, generator=g) / d ** 0.5
    tensors["model.layers.0.block_sparse_moe.gate.weight"] = gate
    save_file(tensors, str(tmp_path / "model.safetensors"))
    load = [6, 0]
    ckpt = _Recorder(str(tmp_path))
    lw = load_layer(ckpt, "mixtral", cfg, quant, 0, load)
    assert not [n for n in ckpt.read if ".experts.3." in n]
    w13 = torch.stack([torch.cat(written[e][:2]) for e in load])
    w2 = torch.stack([written[e][2] for e in load])
    assert _same_qweight(lw.experts.w13, quantize_weight(w13, quant))
    assert _same_qweight(lw.experts.w2, quantize_weight(w2, quant))
    _run_layer_vs_oracle(lw, cfg, quant, load, seed)


def test_load_errors(tmp_path):
    cfg = get_preset("qwen3-moe-tiny")
    g = torch.Generator().manual_seed(0)
    _, _, t = _expert_tensors("qwen3_moe", 0, 0, cfg.hidden, cfg.moe_intermediate, g)
    t["model.layers.0.mlp.gate.weight"] = torch.randn(cfg.num_experts, cfg.hidden)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unknown checkpoint naming 'llama'"):
        load_layer(str(tmp_path), "llama", cfg, QuantConfig(), 0, [0])
    with pytest.raises(KeyError, match=r"model.layers.0.mlp.experts.1.gate_proj.weight"):
        load_layer(str(tmp_path), "qwen3_moe", cfg, QuantConfig(), 0, [1])
    with pytest.raises(ValueError, match=r"checkpoint router gate has shape \(16, 256\), the "
                                         r"config needs \(8, 256\)"):
        load_layer(str(tmp_path), "qwen3_moe", cfg.replace(num_experts=8), QuantConfig(), 0, [0])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no .safetensors files in"):
        SafetensorsCheckpoint(str(empty))


@pytest.mark.parametrize("recipe", ["fp8_block", "bf16"])
def test_fp8_checkpoint_shape_mismatch_raises(tmp_path, recipe):
    """The fp8 fast path (bytes kept) checks shapes like the dequantizing path."""
    cfg = get_preset("deepseek-v3-tiny")
    g = torch.Generator().manual_seed(0)
    _, _, t = _expert_tensors("deepseek", 0, 0, cfg.hidden, cfg.moe_intermediate, g, fp8=True)
    t["model.layers.0.mlp.gate.weight"] = torch.randn(cfg.num_experts, cfg.hidden)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint experts' gate/up has shape \(1, 256, 256\), "
                                         r"the config needs \(1, 512, 256\)"):
        load_layer(str(tmp_path), "deepseek", cfg.replace(moe_intermediate=256),
                   QuantConfig(recipe), 0, [0], with_shared=False)
