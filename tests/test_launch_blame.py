"""Blame without Ray: given what each rank did when a stage went wrong, the rank that failed
first is named and the others are "waiting" (the orders and mixes seen with real ranks: a
bystander's "connection reset" arriving before the dead rank's death, a hang inside a
collective, a rank that stops answering)."""

from __future__ import annotations

import pytest

from epmoe.launch.blame import (Heartbeat, RankFailure, RankState, attribute, death_detail,
                                is_collective_error)


def beat(rank, stage, entered, in_collective=False, step=0, call="step", calls=5, depth=None):
    return Heartbeat(rank=rank, call=call, step=step, stage=stage, calls=calls, entered=entered,
                     busy=True, in_collective=in_collective, seconds_in_stage=1.0,
                     depth=int(stage is not None) if depth is None else depth)


RESET = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"


@pytest.mark.parametrize("world,dead", [(8, 7), (8, 0), (4, 2)])
def test_a_dead_rank_beats_bystanders_whose_errors_arrived_first(world, dead):
    states = []
    order = 0
    for r in range(world):  # every bystander's collective error is seen before the death
        if r != dead:
            states.append(RankState(r, "error", error=RESET, collective=True, order=order,
                                    where="step 0 at stage combine"))
            order += 1
    states.append(RankState(dead, "died", error="its process (pid 4242) died", order=order,
                            heartbeat=beat(dead, "experts", 40)))
    f = attribute("step 0", states)
    assert (f.kind, f.ranks) == ("died", (dead,))
    assert f.waiting == tuple(r for r in range(world) if r != dead)
    others = ", ".join(str(r) for r in range(world) if r != dead)
    assert f.message() == (f"rank {dead} died during step 0 (last seen in step 0 at stage "
                           f"experts): its process (pid 4242) died; ranks {others} were waiting "
                           f"in step 0 at stage combine")


def test_a_rank_error_of_its_own_beats_collective_errors():
    states = [RankState(0, "error", error=RESET, collective=True, order=0, where="step 1"),
              RankState(1, "error", error="ValueError: bad shape", order=1,
                        where="step 1 at stage experts"),
              RankState(2, "pending", heartbeat=beat(2, "combine", 50, True, step=1))]
    f = attribute("step 1", states)
    assert (f.kind, f.ranks, f.waiting) == ("failed", (1,), (0, 2))
    assert f.message().startswith("rank 1 failed in step 1 at stage experts: ValueError: bad "
                                  "shape; ranks 0, 2 were waiting in step 1")


def test_a_hang_names_the_rank_outside_the_collective():
    """The issue's example: rank 3 stopped in the experts, 0-2 wait in combine."""
    states = [RankState(r, "pending", heartbeat=beat(r, "combine", 44, in_collective=True))
              for r in range(3)]
    states.append(RankState(3, "pending", heartbeat=beat(3, "experts", 41)))
    f = attribute("step 0", states, timeout_s=10)
    assert (f.kind, f.ranks, f.waiting) == ("hung", (3,), (0, 1, 2))
    assert f.message() == ("rank 3 stopped in step 0 at stage experts and did not finish step 0 "
                           "within 10 s; ranks 0, 1, 2 are waiting in step 0 at stage combine "
                           "(hung, or too slow: raise --timeout if the job is just slow)")


def test_a_hang_while_starting_points_at_the_start_timeout():
    """Start is bounded by --start-timeout (driver.py): a silent rank there says so."""
    states = [RankState(0, "ok"), RankState(1, "pending", answered=False)]
    f = attribute("start", states, timeout_s=300)
    assert (f.kind, f.ranks, f.finished) == ("hung", (1,), (0,))
    assert f.message() == ("rank 1 stopped in start and did not finish start within 300 s (it "
                           "does not answer heartbeats); rank 0 finished start (hung, or too "
                           "slow: raise --start-timeout if the job is just slow)")


def test_a_hang_with_everyone_in_the_same_place_falls_back_to_fewest_stages():
    states = [RankState(0, "pending", heartbeat=beat(0, "eplb.migrate", 90)),
              RankState(1, "pending", heartbeat=beat(1, "eplb.migrate", 88))]
    assert attribute("rebalance after step 1", states, 5).ranks == (1,)
    states = [RankState(r, "pending", heartbeat=beat(r, "eplb.migrate", 90)) for r in (0, 1)]
    f = attribute("rebalance after step 1", states, 5)
    assert f.ranks == (0, 1) and f.message().startswith("ranks 0, 1 stopped in step 0 at stage")


@pytest.mark.parametrize("hung", [0, 1])
def test_of_ranks_that_entered_as_many_stages_the_one_still_inside_is_behind(hung):
    """Seen on a GPU (symm-ht, a hang injected at one rank's combine): the hung rank sits in
    the stage it just entered, its peer left that stage and blocks in the step's next sync
    (its kernel spins on the hung rank): both entered 40 stages. Before, both were named."""
    states = [RankState(r, "pending", heartbeat=beat(r, "combine" if r == hung else None, 40))
              for r in (0, 1)]
    f = attribute("step 0", states, timeout_s=45)
    assert (f.kind, f.ranks, f.waiting) == ("hung", (hung,), (1 - hung,))
    assert f.message() == (f"rank {hung} stopped in step 0 at stage combine and did not finish "
                           f"step 0 within 45 s; rank {1 - hung} is waiting in step 0 (hung, or "
                           f"too slow: raise --timeout if the job is just slow)")
    nested = [RankState(0, "pending", heartbeat=beat(0, "experts.gemm1", 40, depth=2)),
              RankState(1, "pending", heartbeat=beat(1, "experts", 40, depth=1))]
    assert attribute("step 0", nested, 45).ranks == (0,)


SYMM_TIMEOUT = ("symm comm: rank 0 timed out on peer 1 in ht-dispatch receive, waiting for the "
                "peer's data (flag 0, expected >= 1); the peer never reached this call")


def test_a_symm_timeout_blames_the_peer_that_stopped_not_the_rank_that_waited():
    """Rank 1 hangs before its dispatch; rank 0's receive times out on the device, finishes
    its step on an empty layout and raises at the step's sync: rank 1 is the one named."""
    states = [RankState(0, "error", error=f"SymmTimeoutError: {SYMM_TIMEOUT}", collective=True,
                        order=0, where="step 0"),
              RankState(1, "pending", heartbeat=beat(1, "dispatch", 12))]
    f = attribute("step 0", states, timeout_s=60)
    assert (f.kind, f.ranks, f.waiting) == ("stopped", (1,), (0,))
    assert f.message() == (f"rank 1 stopped in step 0 at stage dispatch (rank 0 gave up "
                           f"waiting: SymmTimeoutError: {SYMM_TIMEOUT}); rank 0 was waiting in "
                           f"step 0")


def test_a_rank_that_does_not_answer_is_the_one_stopped():
    states = [RankState(0, "ok"), RankState(1, "pending", answered=False),
              RankState(2, "pending", heartbeat=beat(2, None, 3, call="start", calls=1))]
    f = attribute("start", states, 30)
    assert (f.ranks, f.waiting, f.finished) == ((1,), (2,), (0,))
    assert "it does not answer heartbeats" in f.message() and "rank 0 finished start" in \
        f.message()


def test_failure_json_round_trip():
    f = attribute("build", [RankState(0, "ok"), RankState(1, "error", error="boom",
                                                            where="build")], None, 1.5)
    d = f.to_json()
    assert d["ranks"] == (1,) and d["where"] == {"1": "build"} and d["stage_seconds"] == 1.5
    assert d["message"] == "rank 1 failed in build: boom; rank 0 finished build"


@pytest.mark.parametrize("text,collective", [
    (RESET, True), ("RuntimeError: Connection reset by peer", True),
    ("DistBackendError: NCCL error in: ...", True), ("RuntimeError: Socket Timeout", True),
    ("ValueError: trace expert ids span [0, 17]", False),
    ("InjectedFault: injected fault on rank 1 at step", False),
    (f"SymmTimeoutError: {SYMM_TIMEOUT}", True)])
def test_collective_errors_are_told_apart(text, collective):
    kind, _, msg = text.partition(": ")
    e = type(kind, (Exception,), {})(msg)
    assert is_collective_error(e) is collective


def test_rank_failure_pickles_with_its_fields():
    import pickle

    e = pickle.loads(pickle.dumps(RankFailure(3, "step 0 at stage experts", False, "boom")))
    assert (e.rank, e.where, e.collective, e.error) == (3, "step 0 at stage experts", False,
                                                        "boom")


def test_death_detail_reads_rays_message():
    msg = ("The actor died unexpectedly before finishing this task.\n\tclass_name: Worker\n\t"
           "pid: 8689\nThe actor is dead because its worker process has died. Worker exit "
           "type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection "
           "error code 2. End of file. Some common causes include: ...")
    assert death_detail(msg) == ("its process (pid 8689) died (Worker unexpectedly exits with "
                                 "a connection error code 2)")
    msg = ("The actor died because of an error raised in its creation task, \x1b[36mray::Worker"
           ".__init__()\x1b[39m (pid=1, ip=127.0.0.1)\n  File \"x.py\", line 8, in __init__\n"
           "epmoe.launch.faults.InjectedFault: injected fault on rank 1 at start")
    assert death_detail(msg) == ("its constructor raised epmoe.launch.faults.InjectedFault: "
                                 "injected fault on rank 1 at start")


def test_the_stage_timer_reports_how_many_stages_are_open():
    from epmoe.timing import StageTimer

    t = StageTimer(enabled=False)
    assert (t.where().stage, t.where().entered, t.where().depth) == (None, 0, 0)
    with t.stage("experts"):
        with t.stage("experts.gemm1"):
            assert (t.where().stage, t.where().entered, t.where().depth) == (
                "experts.gemm1", 2, 2)
        assert (t.where().stage, t.where().depth) == ("experts", 1)
    assert (t.where().stage, t.where().entered, t.where().depth) == (None, 2, 0)
