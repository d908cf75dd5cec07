"""`python -m epmoe.launch` end to end: one rank in-process (the recipe matrix) and Ray runs at
ep 2 and 4 (both token-moving backends) sharing one Ray cluster; the JSON summary's fields."""

from __future__ import annotations

import json
import time

import pytest

from epmoe.launch.cli import main

TINY = dict(model="deepseek-v3-tiny", experts=16, top_k=4, layers=2)


def run_cli(tmp_path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "summary.json"
    rc = main([*flags, "--quiet", "--out", str(out)])
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
    for stage in ("router", "dispatch", "experts", "combine"):
        assert t["stages_ms"][stage] >= 0, t["stages_ms"]
    assert t["stages_ms"]["experts"] > 0
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
def ray_cluster():
    """One local Ray cluster for every Ray run of this module (the driver reuses a connected
    Ray and leaves it running)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_ep4_all2all_bf16(ray_cluster, tmp_path):
    rc, s = run_cli(tmp_path, "--ep", "4", "--backend", "all2all", "--tokens", "8",
                    "--steps", "2")
    c = s["correctness"]
    assert rc == 0 and c["passed"] is True, c
    w = s["world"]
    assert (w["form"], w["ep"], w["dp"], w["tp"], w["backend"]) == ("ep_dp", 4, 4, 1, "all2all")
    assert [r["rank"] for r in w["ranks"]] == [0, 1, 2, 3] and w["nodes"] == 1
    assert c["tokens_checked"] == 8 * 4
    assert_load(s, ranks=4, tokens=8, steps=2, layers=2)
    # the driver left the shared cluster running and its actors gone
    assert ray_cluster.is_initialized()
    deadline = time.monotonic() + 20
    while ray_cluster.available_resources().get("CPU") != 8 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_cluster.available_resources().get("CPU") == 8, "actors or bundles left behind"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_ep2_allgather_fp8_block(ray_cluster, tmp_path):
    rc, s = run_cli(tmp_path, "--ep", "2", "--backend", "allgather", "--quant", "fp8_block",
                    "--tokens", "8", "--steps", "2")
    c = s["correctness"]
    assert rc == 0 and c["passed"] is True, c
    assert s["config"]["recipe"] == "fp8_block" and c["tolerance"] == 2e-2
    w = s["world"]
    assert (w["ep"], w["backend"], len(w["ranks"])) == (2, "allgather", 2)
    assert_load(s, ranks=2, tokens=8, steps=2, layers=2)
