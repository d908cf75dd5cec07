"""`python -m epmoe.plan`: the table (80 columns), JSON, plan files, and exit 2 on bad input."""

import json

import pytest

from epmoe.plan.__main__ import main
from epmoe.plan.planfile import Plan


def test_table_fits_80_columns(capsys):
    assert main(["--model", "deepseek-v3", "--topology", "1x8", "--tokens", "128,4096",
                 "--layers", "3"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert "deepseek-v3" in lines[0] and "0-2" in out and "beats" in out


def test_json_and_plan_file(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert main(["--model", "qwen3-30b-a3b", "--topology", "2x8", "--tokens", "64",
                 "--layers", "2", "--profile", "b200", "--json", "--out", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["buckets"] == [64] and len(doc["layers"]) == 2
    plan = Plan.load(path)
    assert plan.world == 16 and plan.profile == "b200"
    assert plan.quant.scale_fmt == "ue8m0_fp32"  # SM100 DeepGEMM reads UE8M0 scales


@pytest.mark.parametrize("argv,msg", [
    (["--topology", "2y8"], "NODESxGPUS"),
    (["--tokens", "12,abc"], "comma-separated"),
    (["--model", "gpt-9"], "unknown preset"),
    (["--profile", "h9000"], "neither a shipped profile"),
    (["--routing", "pareto:1"], "routing"),
    (["--forms", "tp,dp"], "--forms"),
    (["--layers", "0"], "--layers"),
    (["--memory-gib", "-1"], "--memory-gib (-1.0) must be > 0"),
    (["--redundant-experts", "-2"], "--redundant-experts (-2) must be >= 0"),
])
def test_bad_input_exits_2_with_one_line(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and err.count("\n") == 1


def test_a_recipe_without_curves_is_named(capsys):
    """w4a8_mxfp4 has no GEMM curves in the shipped h200 profile: the model prices it from
    fp8_block's, and the plan says so (stdout under the table; stderr beside --json)."""
    argv = ["--model", "deepseek-v3", "--topology", "1x8", "--tokens", "4096", "--layers", "1"]
    assert main([*argv, "--quant", "w4a8_mxfp4"]) == 0
    out = capsys.readouterr().out
    assert "w4a8_mxfp4 GEMMs are priced from fp8_block curves: profile\n  h200 has none" in out
    assert "calibrate --recipes w4a8_mxfp4" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    assert main([*argv, "--quant", "w4a8_mxfp4", "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["quant"]["recipe"] == "w4a8_mxfp4" and "priced from" in cap.err
    assert main([*argv, "--quant", "fp8_block"]) == 0  # measured curves: no note
    assert "note:" not in capsys.readouterr().out


def test_gpt_oss_mxfp8_is_priced_from_its_own_curves(capsys):
    """gpt-oss-120b's shapes were calibrated for Triton mxfp8 and bf16 (2026-12-03): mxfp8
    runs its GEMMs slower than bf16 there (in-kernel dequantization), and the plan knows."""
    argv = ["--model", "gpt-oss-120b", "--topology", "1x8", "--tokens", "4096", "--layers", "1",
            "--json"]
    ms = {}
    for q in ("bf16", "mxfp8"):
        assert main([*argv, "--quant", q]) == 0
        cap = capsys.readouterr()
        assert "priced from" not in cap.err
        ms[q] = Plan.from_dict(json.loads(cap.out)).step_us(4096)
    assert ms["mxfp8"] > ms["bf16"]


def test_the_default_recipe_is_the_first_whose_groups_tile_the_model(capsys):
    """No --quant: fp8_block where the widths tile its 128-wide groups (DeepSeek-V3), else
    mxfp8 (gpt-oss's hidden 2880 = 90 x 32), said in a note; a --quant is taken as given."""
    argv = ["--topology", "1x8", "--tokens", "128", "--layers", "1"]
    assert main(["--model", "deepseek-v3", *argv]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: deepseek-v3 fp8_block") and "note:" not in out
    assert main(["--model", "gpt-oss-120b", *argv]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: gpt-oss-120b mxfp8")
    assert "note: fp8_block does not fit (hidden (2880)" in out and "planned as mxfp8" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    assert main(["--model", "gpt-oss-120b", *argv, "--quant", "fp8_block"]) == 2
    assert "must be a multiple" in capsys.readouterr().err
