"""The per-rank worker: a plain class that Ray wraps as an actor (one per rank).

It joins the process group, builds a `Runtime`, and forwards `call(method, *args)` to it. Every
call runs on the actor's one default thread; `progress()` runs on a second thread (Ray
concurrency group "probe") so the driver can ask a busy rank where it is (a heartbeat). A call
that fails raises `RankFailure` (rank, where, whether a collective failed, the error).
EPMOE_FAULT (tests only) injects a failure: see epmoe.launch.faults.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
from datetime import timedelta

from epmoe.env import fault_spec
from epmoe.launch.blame import Heartbeat, RankFailure, is_collective_error
from epmoe.launch.faults import Fault, FaultPoint
from epmoe.peers import waiting_on_peers
from epmoe.plan.topology import local_cores

PROBE_GROUP = "probe"  # the concurrency group of progress()


class Worker:
    def __init__(self, rank: int, world: int, env: dict[str, str] | None = None):
        os.environ.update(env or {})
        self.rank, self.world = rank, world
        self.runtime = None
        self.group = None
        self._listen: socket.socket | None = None
        self._call, self._step, self._calls, self._busy = "start", None, 1, True
        self._gave_up = False  # the last call ended with a collective's error (a peer's fault)
        self._thread = threading.get_ident()
        self._faults = FaultPoint(Fault.parse(fault_spec()), rank)
        self._faults.hit("start")
        import torch

        if not torch.cuda.is_available():
            torch.set_num_threads(1)  # many ranks share few cores on CPU
        self._busy = False

    # ------------------------------------------------------------------ heartbeat
    def progress(self) -> Heartbeat:
        """Where this rank is now; answered while a call runs (the probe thread)."""
        pos = self.runtime.timer.where() if self.runtime is not None else None
        frame = sys._current_frames().get(self._thread) if self._busy else None
        # a rank whose wait for a peer timed out is still a waiting rank, even when its error
        # has not reached the driver yet (its timeout and the driver's deadline race)
        waiting = waiting_on_peers(frame) or self._gave_up
        return Heartbeat(rank=self.rank, call=self._call, step=self._step,
                         stage=pos.stage if pos else None, calls=self._calls,
                         entered=pos.entered if pos else 0, busy=self._busy,
                         in_collective=waiting,
                         seconds_in_stage=pos.seconds_in_stage if pos else 0.0,
                         depth=pos.depth if pos else 0)

    def _run(self, call: str, fn, *args, step: int | None = None):
        """Run one driver call: track it for heartbeats, fire an armed fault, and turn an
        error into a RankFailure that says where."""
        self._call, self._step = call, step
        self._calls += 1
        self._thread = threading.get_ident()
        self._busy, self._gave_up = True, False
        if self.runtime is not None:
            self.runtime.timer.failed_in = None
        try:
            self._faults.hit(call)
            return fn(*args)
        except Exception as e:
            self._gave_up = is_collective_error(e)
            hb = self.progress()
            failed_in = self.runtime.timer.failed_in if self.runtime is not None else None
            where = dataclasses.replace(hb, stage=failed_in or hb.stage).where
            first = (str(e).strip().splitlines() or [""])[0]
            raise RankFailure(self.rank, where, self._gave_up,
                              f"{type(e).__name__}: {first}".rstrip(": ")) from None
        finally:
            self._busy = False

    # ------------------------------------------------------------------ setup
    def where(self) -> dict:
        import torch

        dev = "cpu"
        if torch.cuda.is_available():
            ids = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            dev = f"cuda ({torch.cuda.get_device_name(0)}, visible {ids})"
        try:
            import ray

            node = ray.get_runtime_context().get_node_id()
        except Exception:  # pragma: no cover
            node = "local"
        return dict(rank=self.rank, host=socket.gethostname(), node_id=node, device=dev,
                    pid=os.getpid(), cpus=local_cores())

    def open_store(self) -> tuple[str, int]:
        """Rank 0: a listening socket for the rendezvous store, bound to this node's address
        (the one the other ranks use; loopback on a local run), kept open for init_group."""
        try:
            import ray

            ip = ray.util.get_node_ip_address()
        except Exception:  # pragma: no cover
            ip = "127.0.0.1"
        s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        s.bind((ip, 0))
        s.listen(max(128, self.world))
        self._listen = s
        return ip, s.getsockname()[1]

    def init_group(self, addr: str, port: int, timeout_s: float, backend: str) -> str:
        return self._run("init_process_group", self._init_group, addr, port, timeout_s, backend)

    def _init_group(self, addr: str, port: int, timeout_s: float, backend: str) -> str:
        """backend: nccl (one rank per GPU) or gloo (CPU ranks, or ranks sharing a GPU)."""
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray gives each actor one GPU, visible as device 0
        timeout = timedelta(seconds=timeout_s)
        if self.rank == 0:
            store = dist.TCPStore(addr, port, self.world, True, timeout=timeout,
                                  wait_for_workers=False, master_listen_fd=self._listen.fileno())
        else:
            store = dist.TCPStore(addr, port, self.world, False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world,
                                timeout=timeout)
        self.group = dist.group.WORLD
        return backend

    def build(self, run) -> dict:
        return self._run("build", self._build, run)

    def _build(self, run) -> dict:
        from epmoe.runtime import Runtime

        self.runtime = Runtime(run, rank=self.rank, group=self.group if self.world > 1 else None)
        self.runtime.timer.on_enter = self._faults.hit
        from epmoe.launch.metrics import RankMetrics

        self._metrics = RankMetrics(self.rank, run.model)
        return dict(backend=self.runtime.backend, backend_reason=self.runtime.backend_reason,
                    experts_reason=self.runtime.experts_reason)

    # ------------------------------------------------------------------ running
    def call(self, method: str, *args, **kwargs):
        step = args[0] if method == "step" and args else None
        return self._run(method, self._forward, method, args, kwargs, step=step)

    def _forward(self, method: str, args: tuple, kwargs: dict):
        out = self.runtime.call(method, *args, **kwargs)
        if method == "step":
            self._metrics.step(out)
        return out

    def check(self, job):
        """One layer's float64 check (`oracle.solve`) on this rank's device; None: no job."""
        return self._run("oracle", self._check, job)

    def _check(self, job):
        if job is None:
            return None
        from epmoe.launch.oracle import solve

        return solve(self.runtime.run, job, self.runtime.device)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.runtime is not None:
            self.runtime.close()  # collective: frees comm buffers on every rank

        if dist.is_initialized():
            dist.destroy_process_group()
        if self._listen is not None:
            self._listen.close()
