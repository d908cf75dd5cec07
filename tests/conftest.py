import os

# Set by the test configuration itself (CI sets nothing): Triton's CPU interpreter. Must happen
# before anything imports triton. Ray runs with its real defaults: a local run makes its own
# private cluster with token auth; clusters the tests start for --address use tokens too.
import torch  # noqa: E402  (plain `import torch` defines no Triton kernel)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import atexit  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

# A shell that starts the suite in the background (`make test &` in a script) passes SIGINT
# on as ignored, and Python then never turns it into KeyboardInterrupt, here or in the launches
# the tests start; the tests of Ctrl-C need it, so the suite restores it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


INTERPRETER_SKIP = ("Triton kernels on CPU tensors need Triton's interpreter, which is off "
                    "where CUDA is (the GPU tests run these kernels compiled); run these with "
                    "CUDA hidden: CUDA_VISIBLE_DEVICES= pytest -m interpreter")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    n = torch.cuda.device_count() if has_cuda else 0
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if "interpreter" in item.keywords and not interpreting:
            item.add_marker(pytest.mark.skip(reason=INTERPRETER_SKIP))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ CUDA devices"))


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls: OpenMP threads cost more in synchronization than they save (measured 40x
    slower with 2 threads on a loaded 2-core machine). Spawned ranks set their own."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def seed():
    """A fresh seed per test run (a failure's traceback shows it); EPMOE_TEST_SEED=N replays
    one."""
    import random

    fixed = os.environ.get("EPMOE_TEST_SEED")
    s = int(fixed) if fixed else random.randrange(1 << 30)
    torch.manual_seed(s)
    return s


# The launch tests drive Ray in this process (ray.init / ray.shutdown, many times). Ray leaves
# its native threads behind after shutdown (gcs_client_io_service, worker.io, gRPC's event
# engines and timers: /proc/self/task after one launch), and tearing the interpreter down
# under them can crash: CI once saw SIGSEGV after "1841 passed", which turned a green suite
# red (make: Segmentation fault, exit 2). The suite's verdict is settled by then, so once every
# Python-level exit step has run (pytest's cleanups, then Ray's and everyone's atexit hooks,
# registered after this one and so run before it), the process leaves with that verdict
# without the C-level teardown. Only the process that ran the session does this.
_SESSION: list = []


def pytest_sessionfinish(session):
    _SESSION[:] = [session, os.getpid()]


def _leave_with_the_verdict():
    if not _SESSION or _SESSION[1] != os.getpid():
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(int(_SESSION[0].exitstatus))


atexit.register(_leave_with_the_verdict)
