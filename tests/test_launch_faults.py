"""The fault matrix: {exit, kill -9, raise, hang} x a rank x each stage (start, build, step,
rebalance, migrate, measure) at ep 2, and each stage once at ep 4 (ranks 1..3), on CPU. Every
case must exit 3 and blame the right rank at the right stage (a process that dies says nothing:
its stage is the call in flight, and for a fault inside a call, the last heartbeat), finish
within --timeout + 15 s of the stage, and leave no process of the run behind.

Cost: the runs join one Ray cluster of this module (started once) from this process, so a case
pays for its ranks only; ep 4 is `slow`. Timeouts: 60 s for faults that fail by themselves; for
hangs (only found at the deadline) twice the slowest stage of a clean ep 4 run measured first on
the same cluster (at least 10 s), so a loaded machine does not turn a slow stage into a false
hang. Starting is bounded apart (--start-timeout, the launcher's default outside a start hang):
on 2 loaded cores four ranks importing torch vary far more than a step.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest

import math

from epmoe.launch.blame import START_STAGES
from epmoe.launch.cli import main
from tests.launch_util import describe, new_tag, ray_nodes, tagged_procs, wait_gone

pytestmark = pytest.mark.ray

KINDS = ("exit", "kill", "raise", "hang")
STAGES = ("start", "build", "step", "rebalance", "migrate", "measure")
# the driver's name of the stage each fault point falls in (steps=2, --rebalance-every 1: a
# rebalance after step 0, the final window measured after step 1)
DRIVER_STAGE = {"start": "start", "build": "build", "step": "step 0",
                "rebalance": "rebalance after step 0", "migrate": "rebalance after step 0",
                "measure": "measure final window"}
BASE = ["--tokens", "4", "--steps", "2", "--layers", "1", "--experts", "torch", "--quiet",
        "--no-check"]
EPLB = ["--eplb", "--rebalance-every", "1", "--routing", "zipf:1.5"]


@pytest.fixture(scope="module")
def cluster():
    """The module's Ray cluster (token auth, loopback), joined by every case."""
    with ray_nodes(num_cpus=4) as nodes:
        yield nodes


@dataclass(frozen=True)
class HangTimeouts:
    stage: int  # --timeout for a hang after start
    start: int  # --start-timeout for a hang in start


@pytest.fixture(scope="module")
def hang_timeout(cluster, tmp_path_factory) -> HangTimeouts:
    """2 x the slowest stage of a clean ep 4 EPLB run + 4 s, in [10, 60] s (start and the
    process group apart, in [30, 100] s)."""
    out = tmp_path_factory.mktemp("calibrate") / "s.json"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in dict(cluster.auth, EPMOE_TEST_TAG=new_tag()).items():
            mp.setenv(k, v)
        mp.delenv("EPMOE_FAULT", raising=False)
        rc = main(["--ep", "4", *BASE, *EPLB, "--timeout", "120", "--address", cluster.address,
                   "--out", str(out)])
    assert rc == 0
    launch = json.loads(out.read_text())["timing"]["launch_s"]
    slowest = max(v for k, v in launch.items() if k not in ("connect", *START_STAGES))
    starting = max(launch[k] for k in START_STAGES)
    t = HangTimeouts(min(60, max(10, math.ceil(2 * slowest + 4))),
                     min(100, max(30, math.ceil(2 * starting + 4))))
    print(f"hang timeouts {t} (stages of a clean run: {launch})")
    return t


# ep 4: each stage once, at the ranks ep 2 has not (1..3), every kind at least once; one hang
# (the others named as waiting), as a hang costs its whole timeout. The kind x stage matrix is
# ep 2's (the blame does not depend on how many ranks wait).
EP4 = (("start", "kill", 3), ("build", "raise", 2), ("step", "hang", 3),
       ("rebalance", "exit", 2), ("migrate", "raise", 3), ("measure", "kill", 1))


def cases():
    out = []
    for i, stage in enumerate(STAGES):
        for j, kind in enumerate(KINDS):
            rank = (i + j) % 2
            out.append(pytest.param(2, rank, stage, kind, id=f"ep2-rank{rank}-{stage}-{kind}"))
    for stage, kind, rank in EP4:
        out.append(pytest.param(4, rank, stage, kind, marks=[pytest.mark.slow],
                                id=f"ep4-rank{rank}-{stage}-{kind}"))
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ep,rank,stage,kind", cases())
def test_fault_exit_3_blames_rank_and_stage(cluster, hang_timeout, ep, rank, stage, kind,
                                            tmp_path, monkeypatch, capsys):
    tag = new_tag()
    fault = f"{rank}:{stage}:{kind}"
    for k, v in dict(cluster.auth, EPMOE_TEST_TAG=tag, EPMOE_FAULT=fault).items():
        monkeypatch.setenv(k, v)
    timeout = hang_timeout.stage if kind == "hang" else 60
    out = tmp_path / "failure.json"
    args = ["--ep", str(ep), *BASE, "--timeout", str(timeout), "--address", cluster.address,
            "--out", str(out)]
    if stage == "start" and kind == "hang":
        timeout = hang_timeout.start
        args += ["--start-timeout", str(timeout)]
    if stage in ("rebalance", "migrate", "measure"):
        args += EPLB
    t0 = time.monotonic()
    rc = main(args)
    wall = time.monotonic() - t0
    err = capsys.readouterr().err.strip()
    print(f"{wall=:.1f}s {err}")
    assert rc == 3, err
    f = json.loads(out.read_text())["failure"]
    assert f["ranks"][0] == rank, f["message"]
    assert f["stage"] == DRIVER_STAGE[stage], f["message"]
    assert err == f"error: {f['message']}"
    assert f["kind"] == {"exit": "died", "kill": "died", "raise": "failed",
                         "hang": "hung"}[kind] or (stage == "start" and f["kind"] == "died"), f
    where = f["where"].get(str(rank), "")
    if kind in ("raise", "hang") and stage == "migrate":  # inside a call: the rank says where
        assert where.endswith("at stage eplb.migrate"), f["message"]
    if kind == "hang":
        assert f["ranks"] == [rank], f["message"]  # the others are named as waiting
        assert set(f["waiting"]) | set(f["finished"]) == set(range(ep)) - {rank}, f
    assert f["stage_seconds"] <= timeout + 15, f
    left = wait_gone(tag, within=15)
    assert not left, f"left behind: {describe(left)}"
    assert tagged_procs(cluster.tag), "the joined cluster must keep running"
