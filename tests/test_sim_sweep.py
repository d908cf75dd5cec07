"""`python -m epmoe.sim SWEEP`: a sweep file -> table, JSON, PNG plots; bad input exits 2."""

import json

import pytest

from epmoe.sim.__main__ import main
from epmoe.sim.sweep import Sweep, run

SWEEP = """
name = "tiny"
model = "deepseek-v3"
gpus = ["b200"]
ep = [8, 16]
tokens = [128]
routing = ["zipf:1.0"]
redundant_per_rank = [0, 1]
candidates = ["ep_dp/deepep-ll/deepgemm"]
layers = 2
"""


def test_sweep_file_to_table_json_and_plots(tmp_path, capsys):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP)
    out = tmp_path / "out"
    assert main([str(f), "--out", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in table)
    doc = json.loads((out / "sim.json").read_text())
    rows = doc["rows"]
    assert len([r for r in rows if r["kind"] == "pick"]) == 2 * 2
    assert len([r for r in rows if r["kind"] == "fixed"]) == 2 * 2
    assert {r["nodes"] for r in rows} == {1, 2} and all(r["step_ms"] > 0 for r in rows)
    assert all(r["rdma_MB"] > 0 for r in rows if r["nodes"] == 2)
    for name in ("step_time", "comm_share", "link_bytes"):
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        import matplotlib.image

        assert matplotlib.image.imread(out / f"{name}.png").shape[2] in (3, 4)


def test_redundancy_lowers_the_skewed_step():
    s = Sweep.from_dict({"gpus": ["h200"], "ep": [8], "tokens": [4096], "routing":
                         ["zipf:1.2"], "redundant_per_rank": [0, 2], "layers": 1,
                         "candidates": ["ep_dp/deepep-ht/deepgemm"]})
    fixed = [r for r in run(s) if r["kind"] == "fixed"]
    plain, eplb = sorted(fixed, key=lambda r: r["redundant"])
    assert eplb["imbalance"] < plain["imbalance"] and eplb["step_ms"] < plain["step_ms"]


def test_a_config_json_beside_the_sweep_file_is_its_model(tmp_path, monkeypatch):
    """The same layer as the preset, read from a config.json next to the sweep: same rows."""
    from tests.test_hf_config import PUBLISHED

    (tmp_path / "exp" / "v3").mkdir(parents=True)
    (tmp_path / "exp" / "v3" / "config.json").write_text(json.dumps(PUBLISHED["deepseek-v3"]))
    f = tmp_path / "exp" / "s.json"
    f.write_text(json.dumps({"model": "v3", "gpus": ["h200"], "ep": [16], "tokens": [128],
                             "layers": 2}))
    monkeypatch.chdir(tmp_path)  # not the sweep's folder
    s = Sweep.load(f)
    assert s.model == str(tmp_path / "exp" / "v3")
    preset = Sweep.from_dict({"gpus": ["h200"], "ep": [16], "tokens": [128], "layers": 2})
    assert [r["step_ms"] for r in run(s)] == [r["step_ms"] for r in run(preset)]


@pytest.mark.parametrize("text,msg", [
    ('{"ep": [8], "colour": 1}', "unknown keys"),
    ('{"ep": [0]}', "ep"),
    ('{"candidates": ["ep_dp/deepep"]}', "form/backend/experts"),
    ('{"model": "nope"}', "unknown preset"),
    ("{not json", "is not JSON"),
    ('{"gpus": []}', "sweep gpus ([]) must be profile names"),
    ('{"gpus": [3]}', "sweep gpus ([3]) must be profile names"),
    ('{"ep": [true]}', "sweep ep ([True]) must be ints >= 1"),
    ('{"tokens": [1.5]}', "sweep tokens ([1.5]) must be ints >= 1"),
    ('{"redundant_per_rank": [-1]}', "sweep redundant_per_rank ([-1]) must be ints >= 0"),
    ('{"redundant_per_rank": ["a"]}', "must be ints >= 0"),
    ('{"gpus_per_node": 0}', "sweep gpus_per_node ({'default': 0}) must be ints >= 1"),
    ('{"gpus_per_node": {"h200": "x"}}', "sweep gpus_per_node ({'h200': 'x'})"),
    ('{"model": 5}', "sweep model (5) must be a string"),
    ('{"name": 3}', "sweep name (3) must be a string"),
    ('{"layers": 0}', "sweep layers (0) must be an int >= 1"),
    ('{"routing": ["missing.json"]}', "sweep routing missing.json: cannot read it"),
    ('{"model": "deepseek-v3-tiny", "routing": [5, 1]}',  # a load vector, flat: 2 specs
     "a recorded load has one entry per expert (16), it has 1"),
])
def test_bad_sweep_exits_2(tmp_path, capsys, text, msg):
    f = tmp_path / "bad.json"
    f.write_text(text)
    assert main([str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and err.count("\n") == 1


def test_a_step_with_queued_figures_runs_its_later_layers_behind_the_first():
    """stack_layers_us: layer 0 as on an idle GPU, the rest from the queued figures while the GPU
    runs behind the host (the launch report's and the planner's rule); a host slower than a
    layer, or a profile without queued figures: layers x the first."""
    from epmoe.config import QuantConfig, get_preset
    from epmoe.plan.cost import Candidate, Workload, predict_layer
    from epmoe.plan.profile import AlphaBeta, Provenance, load_profile
    from epmoe.plan.topology import Topology
    from epmoe.sim.layers import stack_layers_us

    m = Provenance("measured", "test")
    cfg = get_preset("deepseek-v3")
    base = load_profile("h200")
    topo = Topology.parse("1x8", gpu="h200")
    work = Workload(cfg, QuantConfig("fp8_block"), 128)
    c = Candidate("ep_dp", "deepep-ll", "deepgemm")
    p0 = predict_layer(c, work, topo, base)
    assert stack_layers_us([(p0, work, None)] * 4, topo, base) == \
        pytest.approx(4 * p0.total_us)
    kern = {**base.kernels, "router": {cfg.router: AlphaBeta(900.0, 1e9, m),
                                       f"{cfg.router}.queued": AlphaBeta(100.0, 1e9, m)}}
    for issue_us, later in ((1.0, 800.0), (1e7, 0.0)):
        prof = base.replace(kernels={**kern, "layer": {"issue": AlphaBeta(issue_us, 1e9, m)}})
        first = predict_layer(c, work, topo, prof)
        got = stack_layers_us([(first, work, None)] * 4, topo, prof)
        assert got == pytest.approx(4 * first.total_us - 3 * later), issue_us


def test_a_point_where_nothing_fits_is_a_row_with_the_reason(tmp_path, capsys):
    """DeepSeek-V3 on 8 H800 (80 GB): no candidate fits, so the point is an "infeasible" row
    (no time, the reason; the table says so under it), not a row left out; 16 fit."""
    f = tmp_path / "s.toml"
    f.write_text('model = "deepseek-v3"\ngpus = ["h800"]\nep = [8, 16]\ntokens = [128]\n')
    out = tmp_path / "out"
    assert main([str(f), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert all(len(line) <= 80 for line in text.splitlines())
    rows = json.loads((out / "sim.json").read_text())["rows"]
    assert [(r["ep"], r["kind"]) for r in rows] == [(8, "infeasible"), (16, "pick")]
    bad = rows[0]
    assert bad["step_ms"] is None and "GiB per rank" in bad["reason"]
    assert "infeasible" in text and "h800 ep 8, 128 tokens: no feasible candidate" in text
    assert (out / "step_time.png").stat().st_size > 5000


def test_a_sweep_without_a_recipe_takes_the_first_that_tiles_the_model(tmp_path, capsys):
    """gpt-oss's hidden 2880 does not tile fp8_block's 128-wide groups: a sweep file without
    `quant` plans it as mxfp8 and says so under the table (stderr beside --json); DeepSeek-V3
    stays fp8_block; a file's `quant` is taken as given."""
    from epmoe.config import fitting_recipe, get_preset

    assert fitting_recipe(get_preset("deepseek-v3")) == ("fp8_block", None)
    assert fitting_recipe(get_preset("gpt-oss-120b"))[0] == "mxfp8"
    f = tmp_path / "oss.toml"
    f.write_text('model = "gpt-oss-120b"\ngpus = ["h200"]\nep = [8]\ntokens = [128]\n')
    assert main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "infeasible" not in out and "planned as mxfp8" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    assert main([str(f), "--json"]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["recipe"] == "mxfp8" and doc["sweep"]["quant"] is None
    assert "planned as mxfp8" in cap.err
    assert Sweep.from_dict({"model": "gpt-oss-120b", "quant": "bf16"}).recipe() == ("bf16", None)


def test_experts_that_do_not_split_and_fixed_candidates_that_cannot_run_are_rows(tmp_path,
                                                                                   capsys):
    """Mixtral's 8 experts over 16 ranks: the ep forms are refused with the reason and tp is
    picked (the sweep once stopped at the first such point); a fixed candidate that cannot
    run at a point is an infeasible row naming it and why."""
    f = tmp_path / "m.toml"
    f.write_text('model = "mixtral-8x7b"\ngpus = ["h800"]\nep = [8, 16]\ntokens = [128]\n'
                 'candidates = ["ep_dp/symm-ht/deepgemm", "ep/local/deepgemm"]\n')
    out = tmp_path / "out"
    assert main([str(f), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert all(len(line) <= 80 for line in text.splitlines())
    rows = json.loads((out / "sim.json").read_text())["rows"]
    got = [(r["ep"], r["kind"], r["choice"]) for r in rows]
    assert got[:3] == [(8, "pick", rows[0]["choice"]), (8, "fixed", "ep_dp/symm-ht/deepgemm"),
                       (8, "fixed", "ep/local/deepgemm")]
    assert rows[3]["kind"] == "pick" and rows[3]["choice"].startswith("tp/")
    assert rows[3]["step_ms"] > 0
    for r, name in ((rows[4], "ep_dp/symm-ht/deepgemm"), (rows[5], "ep/local/deepgemm")):
        assert (r["ep"], r["kind"], r["choice"], r["step_ms"]) == (16, "infeasible", name, None)
    assert "experts (8) must be divisible by ep (16)" in rows[4]["reason"]
    assert "experts (8) must be divisible by ep (16)" in rows[5]["reason"]
    assert "=ep/local/deepgemm" in text and "fixed candidate ep/local/deepgemm" in text


def test_a_long_sweep_says_how_far_it_is():
    """run() reports (points done, points in all) after each point: the CLI prints it every
    5 s on stderr (a 240-point sweep takes ~20 s on one core)."""
    s = Sweep.from_dict({"model": "deepseek-v3-tiny", "gpus": ["h200", "b200"], "ep": [2, 4],
                         "tokens": [64], "routing": ["uniform", "zipf:1.0"], "layers": 2})
    seen = []
    rows = run(s, lambda done, total: seen.append((done, total)))
    assert seen == [(i, 8) for i in range(1, 9)] and len(rows) == 8


def test_an_infeasible_point_names_each_forms_reason(tmp_path):
    """EP 7 on DeepSeek-V3: tp fails on the intermediate, ep and ep_dp on the experts; the
    row names each distinct reason once (not the first candidate's alone), and ep_dp's local
    backend, which moves no tokens across ranks, is not a candidate there."""
    from epmoe.plan.planner import candidates

    assert ("ep_dp", "local") not in {(c.form, c.backend) for c in candidates(7)}
    assert ("ep_dp", "local") in {(c.form, c.backend) for c in candidates(1)}
    asked = candidates(2, forms=("ep_dp",), backends=("local",))
    assert [(c.form, c.backend) for c in asked] == [("ep_dp", "local")] * len(asked)
    f = tmp_path / "s.toml"
    f.write_text('model = "deepseek-v3"\ngpus = ["h100"]\nep = [7]\ntokens = [128]\n')
    out = tmp_path / "out"
    assert main([str(f), "--out", str(out), "--json"]) == 0
    (row,) = json.loads((out / "sim.json").read_text())["rows"]
    why = row["reason"]
    assert row["kind"] == "infeasible" and f"{len(candidates(7))} rejected" in why, why
    assert "moe intermediate (2048) must be divisible by tp (7)" in why
    assert "experts (256) must be divisible by ep (7)" in why
    assert why.count("divisible by ep") == 1 and "moves none" not in why
