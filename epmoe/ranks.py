"""Run one function on `world` spawned ranks of this machine (pplx-kernels style), for tests and
benchmarks.

    results = run_ranks(fn, 4, arg1, arg2, timeout=60.0)   # [fn(0, 4, group, ...), ...]
    results = run_ranks(fn, 2, job, backend="nccl")        # one GPU per rank (cuda:rank)

Each rank is a fresh `spawn` process with one thread, a gloo (or NCCL: rank r on cuda:r) process
group on 127.0.0.1 (a free port) whose collectives time out after `pg_timeout` seconds. `fn` must be a module-level
function; its return value must be picklable (tensors are fine: results travel as plain pickle
bytes, never through shared memory, so a rank may exit before the parent reads them).

Never hangs: a rank that raises surfaces as `RankError` with its rank and traceback (the other
ranks, maybe blocked in a collective, are killed); ranks still running after `timeout` seconds
are killed and a `RankTimeout` names them.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.multiprocessing as mp

R = TypeVar("R")
RankFn = Callable[..., R]

ERROR_GRACE_S = 1.0  # after a first error, how long to wait for other ranks' errors


class RankError(RuntimeError):
    """One or more ranks raised; `failures` maps rank -> formatted traceback."""

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in self.failures.items()]
        super().__init__(f"rank(s) {sorted(self.failures)} failed:\n" + "\n".join(parts))


class RankTimeout(TimeoutError):
    """Ranks did not finish within the timeout; `pending` lists them."""

    def __init__(self, pending: list[int], timeout: float):
        self.pending = pending
        super().__init__(f"rank(s) {pending} did not finish within {timeout:.0f} s; all ranks "
                         f"were killed (a mismatched or missing collective?)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank: int, world: int, port: int, pg_timeout: float, args: tuple,
            results, backend: str = "gloo") -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        kw = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=pg_timeout), **kw)
        payload = ("ok", pickle.dumps(fn(rank, world, dist.group.WORLD, *args)))
    except BaseException:  # noqa: BLE001  (report everything, including KeyboardInterrupt)
        payload = ("err", traceback.format_exc())
    # Report before tearing down: a group wedged by a failed collective may block
    # destroy_process_group, and the parent kills whatever is left once every rank reported.
    results.put((rank, *payload))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (never initialized, or torn down by a failure)
        pass


def run_ranks(fn: RankFn, world: int, *args: Any, timeout: float = 60.0,
              pg_timeout: float | None = None, backend: str = "gloo") -> list[R]:
    """Run fn(rank, world, group, *args) on `world` ranks; -> each rank's result, by rank.

    timeout     seconds for the whole run (spawn included) before every rank is killed
    pg_timeout  the process group's collective timeout (default: timeout)
    backend     gloo (CPU), or nccl (rank r on cuda:r: needs world GPUs)
    """
    __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not this loop
    if world < 1:
        raise ValueError(f"world ({world}) must be >= 1")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"process group backend ({backend!r}) must be gloo or nccl")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    pg_timeout = timeout if pg_timeout is None else pg_timeout
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, pg_timeout, args, results,
                                               backend), daemon=True, name=f"rank{r}")
             for r in range(world)]
    done: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        first_error_at = None
        while len(done) + len(failures) < world:
            now = time.monotonic()
            if first_error_at is not None and now > first_error_at + ERROR_GRACE_S:
                break
            if now > deadline:
                break
            try:
                rank, status, payload = results.get(timeout=0.1)
            except queue_mod.Empty:
                # a rank that died without reporting (segfault, os._exit, OOM kill)
                for r, p in enumerate(procs):
                    if (r not in done and r not in failures and p.exitcode is not None
                            and results.empty()):
                        time.sleep(0.2)  # let a last message arrive
                        if results.empty():
                            failures[r] = f"exited with code {p.exitcode} without a result"
                            first_error_at = first_error_at or time.monotonic()
                continue
            if status == "ok":
                done[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                first_error_at = first_error_at or time.monotonic()
        if failures:
            raise RankError(failures)
        if len(done) < world:
            raise RankTimeout(sorted(set(range(world)) - set(done)), timeout)
        return [done[r] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
        results.cancel_join_thread()
