"""InProcessDriver.close hands the runtime back (a sweep builds one model per candidate in one
process: the previous model must not stay referenced)."""

import weakref

from epmoe.launch.console import Phases
from epmoe.launch.inprocess import InProcessDriver
from epmoe.plan.run import RunConfig


def test_close_drops_the_runtime():
    run = RunConfig(model="deepseek-v3-tiny", tokens=8, layers=1, steps=1, check=False)
    d = InProcessDriver(run, Phases(quiet=True), device="cpu")
    d.start()
    ref = weakref.ref(d.rt)
    d.close()
    assert d.rt is None
    assert ref() is None, "the runtime is still referenced after close()"
    d.close()  # idempotent
