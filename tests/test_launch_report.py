"""What a person reads: tables that fit 80 columns (stages as rows with their share of the
step), labels that say what they count, `FAIL ... > tol`, no ANSI codes in pipes, one progress
line per phase while the cluster starts and the layers are built, `--help` with defaults, and a
README that lists every flag and preset; plus the plots (`--plot DIR`, valid PNGs) and the
metric names registered with Ray's metrics API."""

from __future__ import annotations

import copy
import io
import json
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from epmoe.launch.cli import main, parser

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def eplb_run(tmp_path_factory):
    """One small in-process EPLB run: its summary and the plots it wrote."""
    d = tmp_path_factory.mktemp("run")
    out, plots = d / "s.json", d / "plots"
    rc = main(["--eplb", "--rebalance-every", "1", "--steps", "3", "--routing", "zipf:1.2",
               "--tokens", "4", "--layers", "2", "--quiet", "--out", str(out), "--plot",
               str(plots)])
    assert rc == 0
    return json.loads(out.read_text()), plots


def eight_ranks(s: dict) -> dict:
    """The summary as if from 8 ranks on 2 nodes with long host names and a long reason."""
    s = copy.deepcopy(s)
    w = s["world"]
    w["ranks"] = [dict(rank=r, host=f"gpu-node-{r // 4}.cluster.example.internal", node=r // 4,
                       device="cuda") for r in range(8)]
    w["backend_reason"] = "auto: all2all (deepep-ll: ImportError: No module named 'deep_ep'; " \
                          "deepep-ht: ImportError: No module named 'deep_ep')"
    s["load"]["tokens_per_rank"] = [1234567 + r for r in range(8)]
    s["timing"]["step_ms_median_per_rank"] = [12.345 + r for r in range(8)]
    return s


def rendered(s: dict, width: int = 80) -> str:
    from rich.console import Console

    from epmoe.launch.render import render

    c = Console(width=width, file=io.StringIO(), record=True)
    render(s, c)
    return c.export_text()


def test_every_table_fits_80_columns_and_nothing_is_cut(eplb_run, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    s = eight_ranks(eplb_run[0])
    text = rendered(s)
    wide = [ln for ln in text.splitlines() if len(ln) > 80]
    assert not wide, wide
    assert "…" not in text, text
    # stages are rows: a stage name, its ms per step and its share of the step on one line
    for name in ("router", "dispatch", "experts", "combine"):
        ms = s["timing"]["stages_ms"][name]
        share = ms / s["timing"]["step_ms_median"]
        assert re.search(rf"^ {name} +{ms:.3f} +{share:.0%}", text, re.M), (name, text)
    assert re.search(r"^ +gemm1 +[\d.]+ +\d+%", text, re.M), text  # sub-stages indented
    for r in range(8):  # every rank's row, its host intact (folded, not cut)
        assert re.search(rf"^ +{r} +{r // 4} +gpu-node-{r // 4}", text, re.M), text
    assert "incremental" in text or "full" in text  # the EPLB table's mode, whole


def test_labels_say_what_they_count(eplb_run):
    text = " ".join(rendered(eplb_run[0]).split())  # cells wrap: compare words
    assert "pairs routed here" in text and "(token,k) pairs routed to each rank's" in text
    assert "= mean/max (token,k) pairs per rank" in text
    assert re.search(r"PASS max rel err \S+ <= tol 1e-02 \(past the rounding slack, \S+ "
                     r"without; max\|out-ref\|/max\|ref\|, float64 "
                     r"oracle, 4 tokens\)", text), text
    assert "ms median over steps 1.." in text


def test_a_failed_check_says_fail_greater_than_tol(eplb_run):
    s = copy.deepcopy(eplb_run[0])
    s["correctness"].update(passed=False, max_rel_err=3e-2)
    text = " ".join(rendered(s).split())
    assert re.search(r"FAIL max rel err 3\.00e-02 > tol 1e-02", text), text
    assert "PASS" not in text and "<= tol" not in text


def test_ranks_sharing_a_gpu_say_their_times_are_not_speeds(eplb_run):
    s = copy.deepcopy(eplb_run[0])
    assert s["world"]["ranks_per_gpu"] == 1
    assert "ranks per GPU" not in rendered(s)
    s["world"]["ranks_per_gpu"] = 2
    text = rendered(s)
    assert "2 ranks per GPU, time-sliced: the times are not speeds" in " ".join(text.split())
    assert all(len(ln) <= 80 for ln in text.splitlines())


def test_the_backend_line_names_the_comm_options(eplb_run):
    s = copy.deepcopy(eplb_run[0])
    assert s["world"]["comm_options"] == {}  # none given
    s["world"]["comm_options"] = {"ll_dedup": True, "num_sms": 32}
    s["world"]["comm_options_used"] = True
    assert "; ll_dedup=True; num_sms=32" in " ".join(rendered(s).split())
    assert "unused" not in rendered(s)


def test_comm_options_no_layer_used_are_said_unused(tmp_path):
    """`--backend auto --comm-option ...` that picked no symm backend: the knobs did nothing."""
    out = tmp_path / "s.json"
    assert main(["--tokens", "4", "--layers", "1", "--steps", "2", "--quiet", "--out",
                 str(out), "--comm-option", "ll_dedup=1"]) == 0
    summary = json.loads(out.read_text())
    w = summary["world"]
    assert w["backend"] not in ("symm-ht", "symm-ll") and w["comm_options"] == {"ll_dedup": True}
    assert w["comm_options_used"] is False
    assert "ll_dedup=True (unused: no layer ran symm-ht / symm-ll)" in " ".join(
        rendered(summary).split())


def test_help_shows_every_default():
    text = parser().format_help()
    text = text[text.index("options:"):]  # past the usage line
    for flag, default in (("--timeout", "120.0"), ("--tokens", "64"), ("--steps", "4"),
                          ("--ep", "1"), ("--model", "deepseek-v3-tiny"), ("--quant", "bf16"),
                          ("--backend", "auto"), ("--rebalance-every", "2"),
                          ("--eplb-window", "8"), ("--device", "auto"),
                          ("--ll-max-tokens", "256"), ("--eplb-migration", "sync")):
        block = text[text.index(f"\n  {flag}") + 1:]
        end = re.search(r"\n  -|\n\n", block)
        block = block[:end.start() if end else None]
        assert f"(default: {default})" in " ".join(block.split()), (flag, block)


def test_readme_lists_every_flag_and_preset():
    from epmoe.config import PRESETS

    readme = README.read_text()
    flags = {o for a in parser()._actions for o in a.option_strings if o.startswith("--")}
    flags -= {"--help"}
    missing = sorted(f for f in flags if f"`{f}" not in readme and f"/{f}`" not in readme
                     and f"`{f.replace('--no-', '--')}" not in readme)
    assert not missing, f"README lacks {missing}"
    missing = sorted(p for p in PRESETS if f"`{p}`" not in readme)
    assert not missing, f"README lacks presets {missing}"


# ---------------------------------------------------------------------------------- as a process


def run_process(*args: str, env: dict | None = None, timeout: float = 240):
    import os

    e = dict(os.environ)
    e.pop("EPMOE_FAULT", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "epmoe.launch", *args], capture_output=True,
                          text=True, timeout=timeout, env=e)


@pytest.mark.timeout(120)
def test_pipes_get_no_ansi_codes_and_progress_lines_per_phase():
    r = run_process("--tokens", "4", "--steps", "2", "--layers", "1")
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout + r.stderr
    phases = re.findall(r"^\[ +(\d+\.\d) s\] (.*)$", r.stderr, re.M)
    names = [p[1] for p in phases]
    assert names[:3] == ["building the layers (1 rank, in this process)", "running 2 step(s)",
                         "checking against the float64 oracle"], r.stderr
    times = [float(p[0]) for p in phases]
    assert times == sorted(times)
    assert "correctness  " in r.stdout or "correctness" in r.stdout


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_a_failing_ray_run_prints_phases_and_one_error_without_ansi():
    """Ray forwards its raylet's "worker died" lines to the driver's output, coloured: not in a
    pipe. The phases show what the launcher was doing; the last line names the rank."""
    r = run_process("--ep", "2", "--tokens", "4", "--steps", "2", "--layers", "1",
                    "--timeout", "60", "--device", "cpu", env={"EPMOE_FAULT": "1:step:exit"})
    assert r.returncode == 3, r.stderr
    assert "\x1b[" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    names = re.findall(r"^\[ +\d+\.\d s\] (.*)$", r.stderr, re.M)
    assert names[:5] == ["starting a private Ray cluster (loopback only, token auth)",
                         "starting 2 ranks as Ray actors",
                         "connecting the ranks (gloo process group)",
                         "building the layers (weights, comm, experts)",
                         "running 2 step(s)"], r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "error: rank 1 died during step 0"), r.stderr


# ---------------------------------------------------------------------------------- plots, metrics


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, checking its signature and every chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    pos, size, chunks = 8, None, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(kind + body) == crc, (path, kind)
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        chunks.append(kind)
        pos += 12 + n
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks, chunks
    return size


def test_plots_are_valid_pngs_with_content(eplb_run):
    import matplotlib.image

    _, plots = eplb_run
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["eplb_balancedness.png", "layer_stages.png", "load_heatmap.png",
                     "stage_times.png"]
    for name in names:
        w, h = png_size(plots / name)
        assert w >= 300 and h >= 200, (name, w, h)
        img = matplotlib.image.imread(plots / name)
        assert img.shape[:2] == (h, w) and float(img[..., :3].std()) > 0.05, name


def test_plots_without_eplb_and_for_many_ranks(eplb_run, tmp_path):
    from epmoe.launch.plots import write_plots

    s = eight_ranks(eplb_run[0])
    s["timing"]["stages_ms_per_rank"] = [dict(s["timing"]["stages_ms"]) for _ in range(8)]
    del s["eplb"]
    paths = write_plots(s, str(tmp_path / "p"))
    assert [p.name for p in paths] == ["load_heatmap.png", "stage_times.png",
                                       "layer_stages.png"]
    for p in paths:
        png_size(p)
    # a summary without per-layer times (older JSON): no per-layer plot, the others drawn
    del s["timing"]["stages_ms_per_layer"], s["timing"]["predicted_ms_per_layer"]
    paths = write_plots(s, str(tmp_path / "q"))
    assert [p.name for p in paths] == ["load_heatmap.png", "stage_times.png"]


def test_metric_names_are_registered_and_recorded(eplb_run):
    import warnings

    from epmoe.launch import metrics

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Ray warns about (and drops) invalid metric names
        run = metrics.RunMetrics()
        run.record(eplb_run[0])  # tags checked by Ray: a missing or unknown tag raises
        rank = metrics.RankMetrics(3, "deepseek-v3-tiny")
        rank.step(12.5)
    got = {m.info["name"]: m.info for m in [*run.by_name.values(), rank.step_ms]}
    assert set(got) == set(metrics.NAMES) == {"epmoe_step_time_ms", "epmoe_stage_time_ms",
                                              "epmoe_routed_pairs", "epmoe_eplb_balancedness"}
    assert not any(m._discard_metric for m in [*run.by_name.values(), rank.step_ms])
    assert got["epmoe_stage_time_ms"]["tag_keys"] == ("model", "rank", "stage")
    doc = metrics.__doc__
    assert all(f"| {n}" in doc for n in metrics.NAMES), "the module's table lists every metric"


def test_the_check_widens_fp8_tolerance_only_for_tensor_core_gemms(seed):
    """The report states the tolerance it used: fp8_block's 2e-2, or 3e-2 when a rank's experts
    ran their fp8 GEMMs on tensor cores (`reference.tolerance`); the verdict follows it."""
    import torch

    from epmoe.config import QuantConfig
    from epmoe.launch.oracle import LazyOracleLayer, check_correctness
    from epmoe.plan.run import RunConfig
    from epmoe.reference import reference_moe, rounding_slack
    from epmoe.runtime import Runtime

    run = RunConfig(model="deepseek-v3-tiny", quant=QuantConfig("fp8_block"), experts="torch",
                    tokens=8, layers=1, steps=1, seed=seed)
    rt = Runtime(run, device="cpu")
    rt.step(0)
    rep = rt.report()
    assert rep["fp8_mma"] is False  # the torch experts sum in fp32
    plain = check_correctness(run, [rep])
    assert plain["passed"] and plain["tolerance"] == 2e-2 and plain["fp8_mma"] is False
    # the oracle's output off by 2.5% of max|ref| at one element past its rounding slack
    # (bf16: +-0.2%): fails at 2e-2, passes where the GEMMs were fp8 MMAs
    rec = rep["last"][0]
    args = (LazyOracleLayer(run, 0).as_tuple(), run.cfg, run.quant, rec["ids"][:8],
            rec["w"][:8])
    ref = reference_moe(rec["x"][:8], *args)
    ref[0, 0] += 0.025 * ref.abs().max() + rounding_slack(rec["x"][:8], *args)[0, 0]
    last = [dict(rec, out=ref.to(torch.bfloat16))]
    assert not check_correctness(run, [dict(rep, last=last)])["passed"]
    wide = check_correctness(run, [dict(rep, last=last, fp8_mma=True)])
    assert wide["tolerance"] == pytest.approx(3e-2) and wide["fp8_mma"] is True
    assert wide["passed"], wide["max_rel_err"]


def test_the_report_names_the_layer_the_model_misses_most():
    """The stage and layer whose predicted / measured is furthest from 1 (either way), among
    those measured at or above the noise floor; nothing for a one-layer stack."""
    from epmoe.launch.render import layer_miss_line

    t = dict(noise_floor_ms=0.05,
             stages_ms_per_layer={"router": [0.30, 0.04], "experts": [2.0, 2.0],
                                  "dispatch": [0.10, 0.10]},
             predicted_ms_per_layer={"router": [0.28, 0.001], "experts": [2.2, 1.9],
                                     "dispatch": [0.10, 0.04]})
    line = layer_miss_line(dict(timing=t))  # router layer 1 is under the floor
    assert line.startswith("largest per-layer miss: dispatch, layer 1: 0.100 ms measured, "
                           "0.040 predicted (0.40x)")
    t["predicted_ms_per_layer"]["experts"] = [2.0, 5.1]  # 2.55x beats 0.40x (1/2.5)
    assert "experts, layer 1" in layer_miss_line(dict(timing=t))
    one = dict(noise_floor_ms=0.05, stages_ms_per_layer={"experts": [2.0]},
               predicted_ms_per_layer={"experts": [9.0]})
    assert layer_miss_line(dict(timing=one)) is None
    assert layer_miss_line(dict(timing={})) is None
