"""CPU ranks time-slicing their cores (epmoe/plan/timeslice.py): which stages show it."""

import os
import random
import sys

import pytest

from epmoe.plan.cost import TOP_STAGES as TOP
from epmoe.plan.timeslice import base_slice_us, time_sliced

KIDS = ("experts.permute", "experts.gemm1", "experts.act_quant", "experts.gemm2",
        "experts.gather")


def layer(**kw):
    st = {s: 0.0 for s in TOP + KIDS + ("dispatch.quantize",)}
    st.update(kw)
    return st


def total(st, tail):
    return sum(st[s] for s in TOP) + tail


def test_a_layer_worked_by_hand():
    """f = 4 ranks per core, a 2.5 us slice. After the dispatch: permute [0, 1] runs inside the
    first slice (1), gemm1 [1, 4] is preempted for 1.5 of its 3 (3 + 3 x 1.5 = 7.5), act [4, 5]
    4, gemm2 [5, 7] 8, gather [7, 8] 4; each rank queues 2.5 behind the others' first slices:
    3 x 2.5 / 2 = 3.75 on the dispatch and on the combine. After the combine: shared [0, 1],
    tail [1, 1.5], router [1.5, 2.5] all inside the slice; 3.75 more on each collective.
    Collectives: 4 x 2 + 3.75 + 3.75 = 15.5."""
    st = layer(router=1.0, dispatch=2.0, **{"dispatch.quantize": 0.5}, experts=8.0,
               combine=2.0, shared=1.0, **dict(zip(KIDS, (1.0, 3.0, 1.0, 2.0, 1.0))))
    out, tail = time_sliced(st, 0.5, 4.0, 2.5, {"dispatch", "combine", "all_reduce"})
    want = {"router": 1.0, "dispatch": 15.5, "dispatch.quantize": 2.0, "experts": 24.5,
            "combine": 15.5, "shared": 1.0, "all_reduce": 0.0, "experts.permute": 1.0,
            "experts.gemm1": 7.5, "experts.act_quant": 4.0, "experts.gemm2": 8.0,
            "experts.gather": 4.0, "relayout": 0.0, "norm": 0.0, "residual": 0.0}
    assert out == pytest.approx(want) and tail == pytest.approx(0.5)
    assert total(out, tail) == pytest.approx(4 * total(st, 0.5))


def test_experts_own_remainder_and_one_collective():
    """The experts stage's time beyond its kernels runs after them; with one collective (the
    all-reduce of a replicated form) the compute between two of its calls is one stretch."""
    st = layer(router=1.0, dispatch=1.0, experts=5.0, combine=1.0, all_reduce=4.0,
               **dict(zip(KIDS, (1.0, 1.0, 1.0, 0.5, 0.5))))
    out, tail = time_sliced(st, 0.0, 2.0, 3.0, {"all_reduce"})
    # one stretch: router [0,1] dispatch [1,2] kernels [2,6] rest [6,7] combine [7,8]
    assert out["router"] == out["dispatch"] == 1.0 and out["experts.permute"] == 1.0
    assert out["experts.gemm1"] == pytest.approx(2.0)  # [3, 4]: past the slice
    assert out["experts"] == pytest.approx(1 + 2 + 2 + 1 + 1 + 2)
    assert out["combine"] == pytest.approx(2.0)
    assert out["all_reduce"] == pytest.approx(2 * 4 + 3.0)  # (f - 1) x 3 / 2, before and after
    assert total(out, tail) == pytest.approx(2 * total(st, 0.0))


def test_no_collective_or_no_oversubscription():
    st = layer(router=1.0, experts=2.0, shared=3.0, **{"experts.gemm1": 2.0})
    out, tail = time_sliced(st, 1.0, 4.0, 2.5, {"dispatch", "combine"})  # both 0 here
    assert out == {s: 4 * v for s, v in st.items()} and tail == 4.0
    assert time_sliced(st, 1.0, 1.0, 2.5, {"all_reduce"}) == (st, 1.0)


@pytest.mark.parametrize("seed", range(20))
def test_the_layer_still_costs_f_times_its_time_alone(seed):
    """Wherever the time-slicing lands, every rank's compute still passes through the core."""
    rng = random.Random(seed)
    st = layer(**{s: rng.choice((0.0, rng.uniform(0.1, 9.0))) for s in TOP + KIDS})
    st["experts"] = sum(st[k] for k in KIDS) + rng.uniform(0, 2)
    f, q, tail = rng.uniform(1.0, 8.0), rng.uniform(0.5, 6.0), rng.uniform(0, 2)
    blocking = set(rng.sample(["dispatch", "combine", "all_reduce"], rng.randint(0, 3)))
    out, t = time_sliced(st, tail, f, q, blocking)
    assert total(out, t) == pytest.approx(f * total(st, tail))
    assert all(out[s] >= st[s] - 1e-9 for s in st)  # nothing runs faster than alone
    rest = st["experts"] - sum(st[k] for k in KIDS)  # its own time beyond its kernels
    assert out["experts"] - sum(out[k] for k in KIDS) >= rest - 1e-9


def test_linux_default_slice():
    assert [base_slice_us(c) for c in (1, 2, 4, 8, 64)] == [750, 1500, 2250, 3000, 3000]


def _affinity() -> bool:
    try:
        os.sched_setaffinity(0, os.sched_getaffinity(0))
        return True
    except (AttributeError, OSError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _affinity(),
                    reason="needs Linux CPU affinity")
def test_the_slice_is_measured_here():
    """Two busy processes on one CPU preempt each other: a slice between 0.1 ms and 1 s."""
    from epmoe.bench.sched_slice import measure_slice_us

    assert 100.0 < measure_slice_us(0.3) < 1e6
