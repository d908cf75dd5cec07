"""Bad numbers, lists and models on the benchmark command lines are refused when parsed (exit 2,
`argument --x: ...`): before, `bench.comm --world 0` was a ZeroDivisionError, `--recipes abc`
and `--hidden 0` ran and exited 0, `bench.integration --ep 0` ran the whole test suite at ep 2,
`bench.calibrate --ranks 0` and `bench.plan_accuracy --budget-s 0` exited 0 measuring nothing,
`bench.eplb_placement --threads 0` was torch's RuntimeError."""

from __future__ import annotations

import argparse
import importlib

import pytest

from epmoe.argtypes import at_least, int_list, model_name, name_list, seconds


def test_the_types_take_good_values_and_name_the_bad_ones():
    assert at_least(1)("3") == 3 and at_least(0)("0") == 0
    assert int_list(1)("128, 4096") == (128, 4096) and int_list(0)("0") == (0,)
    assert name_list(("bf16", "fp8_block"))("fp8_block,bf16,fp8_block") == ("fp8_block", "bf16")
    assert seconds("0.5") == 0.5 and model_name("deepseek-v3-tiny") == "deepseek-v3-tiny"
    bad = [(at_least(1), "0", "0 must be >= 1"), (at_least(1), "1.5", "'1.5' is not a whole"),
           (int_list(1), "", "give comma-separated"), (int_list(1), "4,,8", "give comma"),
           (int_list(1), "4,-8", "-8 must be >= 1"),
           (name_list(("a", "b")), "a,c", "'c' is not one of a, b"),
           (name_list(("a", "b")), "", "'' is not one of"),
           (seconds, "0", "must be a finite number of seconds > 0"),
           (seconds, "nan", "must be a finite"), (seconds, "inf", "must be a finite"),
           (seconds, "soon", "'soon' is not a number of seconds"),
           (model_name, "nope-7b", "unknown preset 'nope-7b'"),
           (model_name, "/no/such/config.json", "no such file or folder")]
    for parse, text, msg in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=msg.replace("(", r"\(")):
            parse(text)


# (module, argv, the message after "argument "): found by a sweep of every benchmark CLI with
# 0, -1, "abc" and "1,,x" for each of its options (2026-12-06)
REFUSED = [
    ("comm", ["--world", "0"], "--world: 0 must be >= 2"),
    ("comm", ["--iters", "0"], "--iters: 0 must be >= 1"),
    ("comm", ["--ht-tokens", "abc"], "--ht-tokens: 'abc' is not a whole number"),
    ("comm", ["--ll-tokens", "-1"], "--ll-tokens: -1 must be >= 1"),
    ("comm", ["--recipes", "abc"], "--recipes: 'abc' is not one of bf16, fp8_block"),
    ("comm", ["--hidden", "0"], "--hidden: 0 must be >= 128"),
    ("comm", ["--num-sms", "-1"], "--num-sms: -1 must be >= 0"),
    ("comm", ["--job-timeout", "0"], "--job-timeout: 0 must be a finite number"),
    ("comm", ["--sweep", "24:x"], "--sweep: item '24:x': 1 to 10 whole numbers >= 0"),
    ("comm", ["--sweep", "24:0:0:0:0:3"], "pipelined must be 0 (default), 1 (on) or 2 (off)"),
    ("comm", ["--backends", "all2all,nope"], "--backends: 'nope' is not one of all2all"),
    ("calibrate", ["--out", "{tmp}/p.json", "--ranks", "0"], "--ranks: 0 must be >= 1"),
    ("calibrate", ["--out", "{tmp}/p.json", "--budget-s", "-1"], "--budget-s: -1 must be"),
    ("calibrate", ["--out", "{tmp}/p.json", "--model", "nope"], "--model: unknown preset"),
    ("eplb_placement", ["--threads", "0"], "--threads: 0 must be >= 1"),
    ("eplb_placement", ["--reps", "0"], "--reps: 0 must be >= 1"),
    ("plan_accuracy", ["--budget-s", "0"], "--budget-s: 0 must be a finite number"),
    ("plan_accuracy", ["--layers", "-1"], "--layers: -1 must be >= 1"),
    ("plan_accuracy", ["--tokens", "128,0"], "--tokens: 0 must be >= 1"),
    ("integration", ["--ep", "0"], "--ep: 0 must be >= 1"),
    ("integration", ["--model", "nope"], "--model: unknown preset 'nope'"),
    ("integration", ["--sweep-tokens", "x"], "--sweep-tokens: 'x' is not a whole number"),
    ("integration", ["--step-timeout", "0"], "--step-timeout: 0 must be a finite number"),
    ("kernels", ["--tokens", "0"], "--tokens: 0 must be >= 1"),
    ("kernels", ["--only", "gemm,x"], "--only: 'x' is not one of router, bandwidth, gemm"),
    ("gpu_moe", ["--only", "z"], "--only: 'z' is not one of a, b, t, s, c, d, e"),
    ("kernel_tune", ["--workers", "0"], "--workers: 0 must be >= 1"),
    ("kernel_tune", ["--compile-timeout", "-5"], "--compile-timeout: -5 must be a finite"),
    ("symm_sync", ["--ctas", "1,x"], "--ctas: 'x' is not a whole number"),
    ("symm_sync", ["--launches", "0"], "--launches: 0 must be >= 1"),
    ("symm_host", ["--iters", "0"], "--iters: 0 must be >= 1"),
    ("profile_layer", ["--model", "nope"], "--model: unknown preset 'nope'"),
    ("profile_layer", ["--recipe", "int3"], "--recipe: invalid choice: 'int3'"),
    ("expert_bias", ["--recipes", "fp8_block"], "--recipes: 'fp8_block' is not one of bf16, "
                                                "mxfp8"),
    ("w4a8_gemm", ["--tokens", "1,,2"], "--tokens: '1,,2': give comma-separated"),
    ("ll_gather", ["--recipes", "mxfp8"], "--recipes: 'mxfp8' is not one of fp8_block, bf16"),
    ("ll_gather", ["--iters", "0"], "--iters: 0 must be >= 1"),
    ("ll_gather", ["--tokens", "0"], "--tokens: 0 must be >= 1"),
    ("ht_gather", ["--recipes", "mxfp8"], "--recipes: 'mxfp8' is not one of fp8_block, bf16"),
    ("ht_gather", ["--tokens", "4096,x"], "--tokens: 'x' is not a whole number"),
    ("gather_gemm", ["--tokens", "0"], "--tokens: 0 must be >= 1"),
    ("gather_gemm", ["--recipes", "int3"], "--recipes: 'int3' is not one of bf16, fp8_block"),
]


@pytest.mark.parametrize("module,argv,msg", REFUSED, ids=[f"{m}{' '.join(a)}" for m, a, _ in
                                                          REFUSED])
def test_every_benchmark_refuses_bad_values_when_parsed(module, argv, msg, capsys, tmp_path):
    main = importlib.import_module(f"epmoe.bench.{module}").main
    with pytest.raises(SystemExit) as e:
        main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"python -m epmoe.bench.{module}: error: argument ") and msg in line, \
        line


def test_comm_names_the_shape_it_cannot_split(capsys):
    from epmoe.bench.comm import main

    assert main(["--hidden", "200"]) == 2
    err = capsys.readouterr().err
    assert "--hidden (200) must be a multiple of 128" in err and "--num-experts" not in err
    assert main(["--num-experts", "3"]) == 2
    err = capsys.readouterr().err
    assert "--num-experts (3) must be a multiple of --world (2)" in err and "--hidden" not in err
