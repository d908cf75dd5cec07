"""Synthetic routing generators and trace replay."""

import pytest
import torch

from epmoe.eplb import load_trace, make_routing, save_trace

L, E, K, T = 3, 32, 4, 512


def expert_share(ids_LTK):
    """fp64 [L, E]: fraction of the L*T*K picks that went to each expert, per layer."""
    counts = torch.zeros(ids_LTK.shape[0], E, dtype=torch.float64)
    counts.scatter_add_(1, ids_LTK.flatten(1), torch.ones(ids_LTK.flatten(1).shape,
                                                          dtype=torch.float64))
    return counts / counts.sum(1, keepdim=True)


@pytest.mark.parametrize("spec", ["uniform", "zipf:1.2", "drift:1.0:2", "zipf:0"])
def test_shape_dtype_distinct_deterministic(spec, seed):
    ids = make_routing(spec, L, E, K, T, step=3, seed=seed)
    assert ids.shape == (L, T, K) and ids.dtype == torch.int64
    assert ((ids >= 0) & (ids < E)).all()
    s = ids.sort(-1).values
    assert (s[..., 1:] != s[..., :-1]).all(), "experts must be distinct per token"
    assert torch.equal(ids, make_routing(spec, L, E, K, T, step=3, seed=seed))
    assert not torch.equal(ids, make_routing(spec, L, E, K, T, step=4, seed=seed))


def test_zipf_skew_visible():
    top_zipf = expert_share(make_routing("zipf:1.2", L, E, K, T, 0, seed=1)).max(1).values
    top_unif = expert_share(make_routing("uniform", L, E, K, T, 0, seed=1)).max(1).values
    print(f"top expert share: zipf {top_zipf.tolist()}, uniform {top_unif.tolist()}")
    assert (top_zipf > 2.5 / E).all() and (top_zipf > 2 * top_unif).all()  # uniform: 1/E
    # the hot expert differs between layers (per-layer permutation), fixed over steps
    hot = expert_share(make_routing("zipf:1.2", 8, E, K, T, 0, seed=1)).argmax(1)
    assert hot.unique().numel() > 1
    hot5 = expert_share(make_routing("zipf:1.2", 8, E, K, T, 5, seed=1)).argmax(1)
    assert torch.equal(hot, hot5)


def test_drift_moves_the_hot_set():
    spec = "drift:2.0:3"  # steep: the hottest expert dominates
    hot = [expert_share(make_routing(spec, 1, E, 1, 4096, step, seed=2)).argmax(1).item()
           for step in (0, 2, 3, 6)]
    assert hot[0] == hot[1], "inside one period the hot expert stays"
    assert hot[2] != hot[0] and hot[3] not in (hot[0], hot[2])
    # rotation by one: the expert ranked 2nd at step 0 is the hottest one period later
    share0 = expert_share(make_routing(spec, 1, E, 1, 4096, 0, seed=2))[0]
    assert share0.argsort(descending=True)[1].item() == hot[2]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_trace_round_trip_and_replay(tmp_path, suffix):
    steps = torch.stack([make_routing("zipf:1.0", L, E, K, 16, s, seed=0) for s in range(3)])
    path = tmp_path / f"trace{suffix}"
    save_trace(path, steps.to(torch.int32))
    back = load_trace(path)
    assert back.dtype == torch.int64 and torch.equal(back, steps)
    for step in range(7):  # replay wraps around
        assert torch.equal(make_routing(f"trace:{path}", L, E, K, 16, step, seed=9),
                           steps[step % 3])
    with pytest.raises(ValueError, match=r"trace shape .* must match the request"):
        make_routing(f"trace:{path}", L, E, K, 8, 0, seed=0)


def test_trace_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "missing.pt")
    torch.save({"ids": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="must hold a tensor named 'topk_ids'"):
        load_trace(tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"integer tensor \[steps, layers, tokens, top_k\]"):
        save_trace(tmp_path / "x.pt", torch.zeros(2, 2))
    save_trace(tmp_path / "big.pt", torch.full((1, 1, 2, 1), E))
    with pytest.raises(ValueError, match=r"must lie in \[0, 32\)"):
        make_routing(f"trace:{tmp_path / 'big.pt'}", 1, E, 1, 2, 0, seed=0)


@pytest.mark.parametrize("spec", ["zipf", "zipf:x", "zipf:-1", "drift:1.0", "drift:1.0:0",
                                  "drift:1:2.5", "gauss:1", "uniform:3", "trace:", ""])
def test_bad_spec(spec):
    with pytest.raises(ValueError, match=r"grammar: uniform \| zipf:S \| drift:S:P"):
        make_routing(spec, L, E, K, T, 0, seed=0)


def test_bad_sizes():
    with pytest.raises(ValueError, match=r"top_k \(40\) must be <= num_experts \(32\)"):
        make_routing("uniform", L, E, 40, T, 0, seed=0)
    with pytest.raises(ValueError, match=r"num_tokens \(0\) must be a positive int"):
        make_routing("uniform", L, E, K, 0, 0, seed=0)
