"""`python -m epmoe.launch` end to end: one rank in-process (the recipe matrix) and Ray runs at
ep 2 and 4 (both token-moving backends) joining one Ray cluster of this module; the JSON
summary's fields."""

from __future__ import annotations

import json
import time

import pytest

from epmoe.launch.cli import main
from tests.launch_util import describe, new_tag, ray_nodes, tagged_procs, wait_gone

TINY = dict(model="deepseek-v3-tiny", experts=16, top_k=4, layers=2)


def run_cli(tmp_path, *flags: str) -> tuple[int, dict]:
    """A launch of these CPU tests: on the CPU (gloo ranks) whatever the machine has, unless
    the flags say otherwise."""
    out = tmp_path / "summary.json"
    where = () if "--device" in flags else ("--device", "cpu")
    rc = main([*flags, *where, "--quiet", "--out", str(out)])
    return rc, json.loads(out.read_text())


def assert_load(s: dict, ranks: int, tokens: int, steps: int, layers: int):
    """Every (token, k) pair routed is counted once: per expert and per rank."""
    pairs = tokens * ranks * TINY["top_k"] * layers * steps
    ld = s["load"]
    assert len(ld["tokens_per_rank"]) == ranks
    assert sum(ld["tokens_per_rank"]) == pairs, ld
    assert len(ld["tokens_per_expert"]) == TINY["experts"]
    assert sum(ld["tokens_per_expert"]) == pairs
    assert 0 < ld["balancedness"] <= 1
    want = (pairs / ranks) / max(ld["tokens_per_rank"])
    assert ld["balancedness"] == pytest.approx(want)


# ---------------------------------------------------------------------------------- one rank


@pytest.mark.timeout(240)
def test_ep1_in_process_summary_fields(tmp_path):
    rc, s = run_cli(tmp_path, "--ep", "1", "--tokens", "8", "--steps", "2")
    assert rc == 0
    c = s["correctness"]
    assert c["checked"] is True and c["passed"] is True
    assert 0 < c["max_rel_err"] <= c["tolerance"] == 1e-2
    assert len(c["per_layer"]) == TINY["layers"]
    t = s["timing"]
    assert t["step_ms_median"] > 0 and len(t["step_ms"]) == 2
    for stage in ("norm", "router", "dispatch", "experts", "combine", "residual"):
        assert t["stages_ms"][stage] >= 0, t["stages_ms"]
    assert t["stages_ms"]["experts"] > 0 and t["stages_ms"]["residual"] > 0
    # the work between the layers is a stage of each layer
    assert len(t["stages_ms_per_layer"]["norm"]) == TINY["layers"]
    w = s["world"]
    assert (w["ep"], w["dp"], w["tp"], w["backend"], w["device"], w["nodes"]) == \
        (1, 1, 1, "local", "cpu", 1)
    assert [r["rank"] for r in w["ranks"]] == [0]
    assert_load(s, ranks=1, tokens=8, steps=2, layers=2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe,tol", [("bf16", 1e-2), ("fp8_block", 2e-2), ("mxfp8", 2e-2)])
def test_ep1_recipes(tmp_path, recipe, tol):
    rc, s = run_cli(tmp_path, "--ep", "1", "--quant", recipe, "--tokens", "8", "--steps", "1",
                    "--layers", "1")
    c = s["correctness"]
    print(f"{recipe=} max_rel_err={c['max_rel_err']:.2e} tol={c['tolerance']:.0e}")
    assert rc == 0 and c["passed"] is True
    assert s["config"]["recipe"] == recipe and c["tolerance"] == tol
    assert 0 < c["max_rel_err"] <= tol
    assert_load(s, ranks=1, tokens=8, steps=1, layers=1)


@pytest.mark.timeout(120)
def test_no_check_exits_0_and_reports_unchecked(tmp_path):
    rc, s = run_cli(tmp_path, "--tokens", "4", "--steps", "1", "--layers", "1", "--no-check")
    assert rc == 0
    assert s["correctness"]["checked"] is False and s["correctness"]["passed"] is None


# ---------------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def cluster():
    """One Ray cluster (token auth, loopback) for every Ray run of this module, joined with
    --address: each run pays for its ranks, not for a cluster."""
    with ray_nodes(num_cpus=4) as nodes:
        yield nodes


@pytest.fixture
def joined(cluster, monkeypatch):
    """This process joins `cluster` (its token) and tags the ranks it starts."""
    tag = new_tag()
    for k, v in dict(cluster.auth, EPMOE_TEST_TAG=tag).items():
        monkeypatch.setenv(k, v)
    return cluster, tag


def assert_cluster_clean(cluster, tag):
    """The run's actors are gone and every CPU of the cluster is free again (no bundle left)."""
    import ray

    left = wait_gone(tag, within=15)
    assert not left, f"left behind: {describe(left)}"
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        deadline = time.monotonic() + 20
        while ray.available_resources().get("CPU") != 4 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ray.available_resources().get("CPU") == 4, "actors or bundles left behind"
    finally:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_ep4_all2all_bf16(joined, tmp_path):
    cluster, tag = joined
    rc, s = run_cli(tmp_path, "--ep", "4", "--backend", "all2all", "--tokens", "8",
                    "--steps", "2", "--address", cluster.address)
    c = s["correctness"]
    assert rc == 0 and c["passed"] is True, c
    w = s["world"]
    assert (w["form"], w["ep"], w["dp"], w["tp"], w["backend"]) == ("ep_dp", 4, 4, 1, "all2all")
    assert [r["rank"] for r in w["ranks"]] == [0, 1, 2, 3] and w["nodes"] == 1
    assert c["tokens_checked"] == 8 * 4
    assert_load(s, ranks=4, tokens=8, steps=2, layers=2)
    assert s["timing"]["launch_s"]["start"] > 0 and "step 1" in s["timing"]["launch_s"]
    assert_cluster_clean(cluster, tag)  # the cluster keeps running, the run's actors are gone


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_ep2_allgather_fp8_block(joined, tmp_path):
    cluster, tag = joined
    rc, s = run_cli(tmp_path, "--ep", "2", "--backend", "allgather", "--quant", "fp8_block",
                    "--tokens", "8", "--steps", "2", "--address", cluster.address)
    c = s["correctness"]
    assert rc == 0 and c["passed"] is True, c
    assert s["config"]["recipe"] == "fp8_block" and c["tolerance"] == 2e-2
    w = s["world"]
    assert (w["ep"], w["backend"], len(w["ranks"])) == (2, "allgather", 2)
    assert_load(s, ranks=2, tokens=8, steps=2, layers=2)


# ---------------------------------------------------------------------------------- choices


@pytest.mark.interpreter  # auto picks triton on CPU tensors
@pytest.mark.timeout(240)
def test_auto_experts_run_packed_ue8m0_scales(tmp_path):
    """The plain-torch experts cannot reorder packed UE8M0 scales: auto picks one that can."""
    rc, s = run_cli(tmp_path, "--quant", "fp8_block", "--scale-fmt", "ue8m0_packed",
                    "--tokens", "4", "--steps", "1", "--layers", "1")
    assert rc == 0 and s["correctness"]["passed"] is True, s["correctness"]
    assert s["world"]["experts"].endswith("triton: chosen"), s["world"]["experts"]
    assert "torch: its plain-torch row permute cannot reorder packed UE8M0" in \
        s["world"]["experts"]


# ---------------------------------------------------------------------------------- traces


def record_trace(path, spec: str, layers: int, tokens: int, steps: int, seed: int = 0):
    """The routing a run with `--routing spec` uses, step by step, saved with save_trace."""
    import torch

    from epmoe.eplb.routing import make_routing, save_trace

    ids = torch.stack([make_routing(spec, layers, TINY["experts"], TINY["top_k"], tokens, s, seed)
                       for s in range(steps)])
    save_trace(path, ids)
    return path


@pytest.mark.timeout(240)
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_trace_replay_gives_the_recorded_runs_loads(tmp_path, suffix):
    args = ["--tokens", "8", "--steps", "3", "--layers", "2", "--seed", "5"]
    rc, rec = run_cli(tmp_path, *args, "--routing", "zipf:1.2")
    assert rc == 0
    path = record_trace(tmp_path / f"t{suffix}", "zipf:1.2", 2, 8, 3, seed=5)
    rc, rep = run_cli(tmp_path, *args, "--routing", f"trace:{path}")
    assert rc == 0 and rep["correctness"]["passed"] is True, rep["correctness"]
    assert rep["load"]["tokens_per_layer_expert"] == rec["load"]["tokens_per_layer_expert"]
    assert_load(rep, ranks=1, tokens=8, steps=3, layers=2)
    assert max(rep["load"]["tokens_per_expert"]) > 2 * min(rep["load"]["tokens_per_expert"])


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trace_replay_over_ranks_gives_the_recorded_runs_loads(joined, tmp_path):
    """ep 2: the trace covers both ranks' tokens (16 = 8 per rank x 2); each rank replays its
    own rows, so per-rank and per-expert loads equal the run the trace was recorded from."""
    cluster, tag = joined
    args = ["--ep", "2", "--tokens", "8", "--steps", "2", "--layers", "2", "--address",
            cluster.address]
    rc, rec = run_cli(tmp_path, *args, "--routing", "zipf:1.2")
    assert rc == 0
    path = record_trace(tmp_path / "t.pt", "zipf:1.2", 2, 16, 2)
    rc, rep = run_cli(tmp_path, *args, "--routing", f"trace:{path}")
    assert rc == 0 and rep["correctness"]["passed"] is True, rep["correctness"]
    assert rep["load"]["tokens_per_layer_expert"] == rec["load"]["tokens_per_layer_expert"]
    assert rep["load"]["tokens_per_rank"] == rec["load"]["tokens_per_rank"]
    assert_load(rep, ranks=2, tokens=8, steps=2, layers=2)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_backend_the_joined_cluster_cannot_run_is_exit_2_before_any_rank(joined, capsys):
    """With --address the ranks' device is known only once connected (here: a CPU cluster):
    DeepEP is refused then, before any actor starts."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the machine has CUDA: the ranks decide")
    cluster, tag = joined
    rc = main(["--ep", "2", "--backend", "deepep-ll", "--address", cluster.address, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: backend 'deepep-ll' cannot run here"), err
    assert len(err.strip().splitlines()) == 1 and not tagged_procs(tag)
