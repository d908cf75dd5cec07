"""`--backend auto` from a measured table (epmoe.comm.auto): the fastest measured candidate at
the run's token count, never extrapolated past a backend's measured range."""

from __future__ import annotations

from epmoe.comm.auto import pick

TABLE = {"world": 2, "measured": "2xH200 2026-12-01", "entries": {
    "symm-ll": {"fp8_block": [[1, 30.0], [256, 60.0]]},
    "deepep-ll": {"fp8_block": [[1, 50.0], [256, 80.0]]},
    "symm-ht": {"fp8_block": [[512, 100.0], [8192, 900.0]]},
    "deepep-ht": {"fp8_block": [[512, 90.0], [8192, 1200.0]]},
}}
ALL = ["symm-ll", "symm-ht", "deepep-ll", "deepep-ht", "all2all"]


def test_auto_picks_the_fastest_measured_backend_and_says_why():
    name, why = pick(ALL, "fp8_block", 2, 128, TABLE)
    assert name == "symm-ll"
    assert why.startswith("auto: symm-ll (128 tokens/rank, fp8_block: 45 us") and "2xH200" in why
    # 512 tokens: only the HT paths were measured there; deepep-ht is faster at the low end
    assert pick(ALL, "fp8_block", 2, 512, TABLE)[0] == "deepep-ht"
    # interpolated: symm-ht 100 + 800 * 3584/7680 = 473, deepep-ht 90 + 1110 * 0.4667 = 608
    assert pick(ALL, "fp8_block", 2, 4096, TABLE)[0] == "symm-ht"


def test_auto_table_does_not_apply_elsewhere():
    assert pick(ALL, "bf16", 2, 128, TABLE) is None  # recipe not measured
    assert pick(ALL, "fp8_block", 4, 128, TABLE) is None  # another world
    assert pick(ALL, "fp8_block", 2, 16384, TABLE) is None  # past every measured range
    assert pick(["all2all"], "fp8_block", 2, 128, TABLE) is None  # candidate not measured
    assert pick(ALL, "fp8_block", 2, 128, None) is None
