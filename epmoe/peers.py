"""Where a rank's Python code blocks on other ranks, so a heartbeat can tell "waiting for a
peer" from "stopped": inside a torch.distributed call, or inside `wait_works` (the one place
epmoe waits on the Work objects of asynchronous point-to-point ops, outside torch.distributed).
"""

from __future__ import annotations

import os

_DIST = f"torch{os.sep}distributed"


def wait_works(works) -> None:
    """Wait for every Work of an async torch.distributed op (e.g. `batch_isend_irecv`)."""
    for w in works:
        w.wait()


def waiting_on_peers(frame) -> bool:
    """Whether a thread whose innermost Python frame is `frame` is blocked on peers."""
    while frame is not None:
        code = frame.f_code
        if code is wait_works.__code__ or _DIST in code.co_filename:
            return True
        frame = frame.f_back
    return False
