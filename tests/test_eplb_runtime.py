"""EPLB in the runtime: the load recorder, a rebalance on gloo ranks that keeps the layer equal
to the float64 oracle (before and after the weights migrate), and a CPU `--eplb` run."""

from __future__ import annotations

import json

import pytest
import torch

from epmoe.config import QuantConfig
from epmoe.eplb.recorder import LoadRecorder, balancedness_per_layer
from epmoe.launch.report import check_correctness
from epmoe.reference import TOLERANCE, max_rel_err
from epmoe.runtime import RunConfig, Runtime
from tests.dist import run_ranks

# ---------------------------------------------------------------------------------- recorder


def test_recorder_window_slides_and_counts_valid_pairs():
    rec = LoadRecorder(num_layers=2, num_slots=4, window=2)
    for step, ids in enumerate(([0, 0, 1, -1], [2, 2, 2, 3], [3, 3, -1, -1])):
        rec.begin_step()
        rec.record(0, torch.tensor(ids).view(2, 2))
        rec.record(1, torch.tensor([step % 4]))
    assert rec.num_steps == 2
    # the window holds steps 1 and 2 only; -1 (dropped pairs) are not counted
    assert rec.window_load().tolist() == [[0, 0, 3, 3], [0, 1, 1, 0]]
    rec.clear()
    assert rec.num_steps == 0 and rec.window_load().sum() == 0
    with pytest.raises(ValueError, match=r"load window \(0\) must be >= 1 step"):
        LoadRecorder(1, 4, 0)


def test_balancedness_per_layer():
    load = torch.tensor([[4, 4, 4, 4], [8, 0, 0, 0], [0, 0, 0, 0]])
    got = balancedness_per_layer(load, 2).tolist()  # ranks hold slots {0,1} and {2,3}
    assert got == [1.0, 0.5, 1.0]
    assert balancedness_per_layer(load, 4)[1].item() == pytest.approx(0.25)


# ---------------------------------------------------------------------------------- runtime

WORLD = 4
CASES = {  # backend -> recipe: both backends, both a plain and a quantized recipe
    "all2all": "fp8_block",
    "allgather": "bf16",
}


def _run_cfg(backend: str, recipe: str) -> RunConfig:
    return RunConfig(model="deepseek-v3-tiny", quant=QuantConfig(recipe), world=WORLD,
                     backend=backend, tokens=32, layers=2, steps=6, seed=5, routing="zipf:1.2",
                     redundant_experts=4, eplb=True, eplb_window=4)


def _rebalance_rank(rank, world, group, cases):
    out = {}
    for backend, recipe in cases.items():
        rt = Runtime(_run_cfg(backend, recipe), rank=rank, group=group)
        phy_before = [list(p) for p in rt.phy2log]
        for s in range(2):
            rt.step(s)
        before_last = rt.report()["last"]
        window_before = rt.window_balancedness()
        res = rt.rebalance()
        rt.step(1)  # the same tokens and routing as before the rebalance
        same_step = rt.report()["last"]
        for s in range(2, 4):
            rt.step(s)
        out[backend] = dict(rank=rank, before=before_last, same_step=same_step, after=rt.report()["last"],
                            res=res, window_before=window_before,
                            window_after=rt.window_balancedness(),
                            phy_before=phy_before, phy_after=[list(p) for p in rt.phy2log])
    return out


@pytest.fixture(scope="module")
def rebalanced():
    return run_ranks(_rebalance_rank, WORLD, CASES, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("backend", list(CASES))
def test_rebalance_keeps_layer_equal_to_oracle(rebalanced, backend):
    run = _run_cfg(backend, CASES[backend])
    ranks = [r[backend] for r in rebalanced]
    res = [r["res"] for r in ranks]
    print(f"{backend=} recipe={CASES[backend]} {res[0]=}")
    # every rank applied the same placement, and it moved slots
    assert all(r["phy_after"] == ranks[0]["phy_after"] for r in ranks)
    assert ranks[0]["phy_after"] != ranks[0]["phy_before"]
    assert res[0]["slots_moved"] > 0 and all(r["slots_moved"] == res[0]["slots_moved"]
                                             for r in res)
    for l, p in enumerate(ranks[0]["phy_after"]):  # every logical expert keeps a replica
        assert sorted(set(p)) == list(range(16)), f"layer {l}: {p}"
    tol = TOLERANCE[CASES[backend]]
    for name in ("before", "same_step", "after"):
        c = check_correctness(run, [dict(last=r[name]) for r in ranks])
        assert c["checked"] and c["passed"], f"{name}: {c}"
        assert 0 < c["max_rel_err"] <= tol
    # the same step after the migration: the same output up to accumulation order
    for r in ranks:
        for l in range(run.num_layers):
            b, a = r["before"][l], r["same_step"][l]
            assert torch.equal(b["ids"], a["ids"])
            if l == 0:  # deeper layers see x + out of the previous one: equal up to rounding
                assert torch.equal(b["x"], a["x"])
                err = max_rel_err(a["out"], b["out"].double())
                assert err <= tol / 2, f"rank {r['rank']}: layer 0 changed by {err:.2e}"
    # routed to different physical slots than before on at least one rank/layer
    assert any(not torch.equal(r["before"][l]["phys"], r["same_step"][l]["phys"])
               for r in ranks for l in range(run.num_layers))


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_rebalance_improves_measured_balancedness(rebalanced):
    for backend in CASES:
        ranks = [r[backend] for r in rebalanced]
        res = ranks[0]["res"]
        assert all(r["window_before"] == ranks[0]["window_before"] for r in ranks)
        assert res["balancedness_before"] == pytest.approx(ranks[0]["window_before"])
        assert res["balancedness_before"] < 0.75, res
        assert res["balancedness_predicted"] > res["balancedness_before"] + 0.1, res
        assert ranks[0]["window_after"] > res["balancedness_before"] + 0.1, (backend, res,
                                                                           ranks[0]["window_after"])


def test_rebalance_without_eplb_is_refused():
    rt = Runtime(RunConfig(tokens=4, layers=1))
    with pytest.raises(RuntimeError, match=r"rebalance needs RunConfig\(eplb=True\)"):
        rt.rebalance()


# ---------------------------------------------------------------------------------- CLI run


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_eplb_run_on_8_ranks_rebalances(tmp_path):
    from epmoe.launch.cli import main

    out = tmp_path / "eplb.json"
    rc = main(["--ep", "8", "--eplb", "--redundant-experts", "8", "--routing", "zipf:1.2",
               "--rebalance-every", "3", "--steps", "8", "--tokens", "128", "--quiet",
               "--timeout", "300", "--out", str(out)])
    s = json.loads(out.read_text())
    assert rc == 0, s["correctness"]
    e = s["eplb"]
    print(json.dumps({k: v for k, v in e.items() if k not in ("events", "slot_load_LS")}),
          e["events"])
    assert s["correctness"]["passed"] is True
    assert s["world"]["ep"] == 8 and len(s["world"]["ranks"]) == 8
    assert e["rebalances"] >= 1 and len(e["events"]) == e["rebalances"]
    assert e["slots_moved"] > 0 and e["slots_moved"] == sum(ev["slots_moved"] for ev in e["events"])
    assert e["balancedness_before"] < 0.6, e
    assert e["balancedness_after"] >= 0.9, e
    assert [ev["step"] for ev in e["events"]] == [3, 6]
    assert all("balancedness_after" in ev for ev in e["events"])
    # the recorder's per layer x slot load: every routed (token, k) pair of every rank and step
    cfg_k, layers, slots = s["config"]["top_k"], s["config"]["layers"], 16 + 8
    assert len(e["slot_load_LS"]) == layers and all(len(r) == slots for r in e["slot_load_LS"])
    assert sum(map(sum, e["slot_load_LS"])) == 128 * 8 * cfg_k * layers * 8
    phy = e["final_phy2log_LR"]
    assert len(phy) == layers and all(sorted(set(r)) == list(range(16)) for r in phy)
