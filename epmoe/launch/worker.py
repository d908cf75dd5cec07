"""The per-rank worker: a plain class that Ray wraps as an actor (one per rank).

It joins the process group, builds a `Runtime`, and forwards `call(method, *args)` to it.
EPMOE_FAULT (debugging/tests only) injects a failure: "RANK:METHOD:exit|hang|raise".
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

from epmoe.env import FAULT


class Worker:
    def __init__(self, rank: int, world: int, env: dict[str, str] | None = None):
        os.environ.update(env or {})
        import torch

        self.rank, self.world = rank, world
        self.runtime = None
        self.group = None
        if not torch.cuda.is_available():
            torch.set_num_threads(1)  # many ranks share few cores on CPU

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
                    pid=os.getpid())

    def free_port(self) -> tuple[str, int]:
        try:
            import ray

            ip = ray.util.get_node_ip_address()
        except Exception:  # pragma: no cover
            ip = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def init_group(self, addr: str, port: int, timeout_s: float) -> str:
        import torch
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray gives each actor one GPU, visible as device 0
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=timeout_s))
        self.group = dist.group.WORLD
        return backend

    def build(self, run) -> dict:
        from epmoe.runtime import Runtime

        self._fault("build")
        self.runtime = Runtime(run, rank=self.rank, group=self.group if self.world > 1 else None)
        return dict(backend=self.runtime.backend, backend_reason=self.runtime.backend_reason,
                    experts_reason=self.runtime.experts_reason)

    def call(self, method: str, *args, **kwargs):
        self._fault(method)
        return self.runtime.call(method, *args, **kwargs)

    def _fault(self, method: str) -> None:
        if not FAULT:
            return
        rank, where, kind = FAULT.split(":")
        if int(rank) != self.rank or where != method:
            return
        if kind == "exit":
            os._exit(17)
        if kind == "hang":
            time.sleep(10**6)
        raise RuntimeError(f"injected fault on rank {self.rank} in {method}")

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.runtime is not None:
            self.runtime.close()  # collective: frees comm buffers on every rank

        if dist.is_initialized():
            dist.destroy_process_group()
