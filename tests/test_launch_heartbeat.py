"""A rank's heartbeat says "waiting for a peer" while it is blocked on one, and still says so
after its own wait for that peer timed out (the error may not have reached the driver when the
driver's deadline passes: CI saw the rank whose gloo timeout fired first blamed as stopped
beside the rank that hung). The Worker is a plain class; Ray is not needed to ask it."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import pytest

from epmoe.launch.blame import RankFailure, RankState, attribute
from epmoe.launch.worker import Worker
from epmoe.peers import wait_works, waiting_on_peers


class BlockedWork:
    """A Work whose wait() blocks until released, then raises `error` (or returns)."""

    def __init__(self, error: Exception | None = None):
        self.release, self.error = threading.Event(), error

    def wait(self):
        assert self.release.wait(30), "never released"
        if self.error is not None:
            raise self.error


def beat_when(worker: Worker, pred, within: float = 10.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        hb = worker.progress()
        if pred(hb):
            return hb
        time.sleep(0.01)
    raise AssertionError(f"heartbeat never matched: {worker.progress()}")


def run_call(worker: Worker, fn) -> threading.Thread:
    """worker._run("rebalance", fn) on a thread of its own (as Ray runs a call); a
    RankFailure it raises lands in worker.last_failure."""

    def call():
        try:
            worker._run("rebalance", fn)
        except RankFailure as e:
            worker.last_failure = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    return t


@pytest.fixture
def worker(monkeypatch):
    monkeypatch.delenv("EPMOE_FAULT", raising=False)
    w = Worker(0, 2)
    w.last_failure = None
    return w


def test_blocked_in_wait_works_is_waiting_and_a_timeout_there_stays_waiting(worker):
    work = BlockedWork(RuntimeError("[gloo] Timed out waiting 10000ms for recv operation"))
    t = run_call(worker, lambda: wait_works([work]))
    hb = beat_when(worker, lambda hb: hb.busy)
    assert hb.in_collective and hb.call == "rebalance"
    work.release.set()
    t.join(10)
    hb = worker.progress()
    assert not hb.busy and hb.in_collective, hb  # gave up waiting: still a waiting rank
    assert worker.last_failure is not None and worker.last_failure.collective


def test_a_rank_busy_in_its_own_code_or_failing_by_itself_is_not_waiting(worker):
    go = threading.Event()

    def own_error():
        go.wait(30)
        raise ValueError("bad shape")

    t = run_call(worker, own_error)
    hb = beat_when(worker, lambda hb: hb.busy)
    assert not hb.in_collective
    go.set()
    t.join(10)
    hb = worker.progress()
    assert not hb.busy and not hb.in_collective
    assert worker.last_failure is not None and not worker.last_failure.collective


def test_the_next_call_forgets_that_the_last_one_gave_up(worker):
    work = BlockedWork(RuntimeError("Connection closed by peer"))
    work.release.set()
    run_call(worker, lambda: wait_works([work])).join(10)
    assert worker.progress().in_collective
    worker._run("rebalance", lambda: None)
    assert not worker.progress().in_collective


def test_the_verdict_blames_the_hung_rank_not_the_one_whose_wait_timed_out(worker):
    """Rank 2 hangs; rank 0's collective timed out just before the probe (its error not yet
    seen by the driver); ranks 1 and 3 still wait: only rank 2 is blamed."""
    work = BlockedWork(RuntimeError("[gloo] Timed out waiting 10000ms for recv operation"))
    work.release.set()
    run_call(worker, lambda: wait_works([work])).join(10)
    gave_up = worker.progress()
    hung = threading.Event()
    other = Worker(2, 4)
    t = threading.Thread(target=other._run, args=("rebalance", lambda: hung.wait(30)),
                         daemon=True)
    t.start()
    stuck = beat_when(other, lambda hb: hb.busy)
    waiting = BlockedWork()
    third = Worker(1, 4)
    t3 = threading.Thread(target=third._run, args=("rebalance", lambda: wait_works([waiting])),
                          daemon=True)
    t3.start()
    blocked = beat_when(third, lambda hb: hb.busy)
    states = [RankState(0, "pending", heartbeat=gave_up),
              RankState(1, "pending", heartbeat=blocked),
              RankState(2, "pending", heartbeat=dataclasses.replace(stuck, rank=2)),
              RankState(3, "pending", heartbeat=dataclasses.replace(blocked, rank=3))]
    f = attribute("rebalance after step 0", states, 10.0, 10.2)
    assert (f.kind, f.ranks, f.waiting) == ("hung", (2,), (0, 1, 3)), f.message()
    hung.set()
    waiting.release.set()
    t.join(10)
    t3.join(10)


def test_waiting_on_peers_reads_the_stack():
    assert not waiting_on_peers(sys._getframe())
    seen = []

    class Probe:
        def wait(self):
            seen.append(waiting_on_peers(sys._getframe()))

    wait_works([Probe()])
    assert seen == [True]
