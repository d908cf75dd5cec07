"""Drive N ranks: in-process for one rank, Ray actors in a placement group otherwise.

Every wait has a deadline. A rank that dies or hangs becomes a `LaunchError` naming the rank
and the stage; all workers are then torn down (actors killed, placement group removed, the
Ray cluster stopped if we started it).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

from epmoe.env import RAY_TMPDIR, SAFETY_ENV, logger
from epmoe.plan.run import RunConfig
from epmoe.runtime import Runtime


class LaunchError(RuntimeError):
    """A run failed: which rank, which stage, why."""


class ClusterTooSmall(LaunchError):
    """The cluster cannot hold the requested ranks: found before any worker starts (exit 2)."""


def _progress(total: int, quiet: bool):
    if quiet:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(TextColumn("[bold]steps"), BarColumn(), MofNCompleteColumn(),
                 TimeElapsedColumn(), transient=True)
    p.start()
    p.add_task("steps", total=total)
    return p


class InProcessDriver:
    """One rank, no Ray, no process group."""

    def __init__(self, run: RunConfig, quiet: bool = False):
        self.run, self.quiet = run, quiet

    def start(self) -> list[dict]:
        self.rt = Runtime(self.run)
        return [dict(rank=0, host=os.uname().nodename, node_id="local", device=str(self.rt.device),
                     pid=os.getpid())]

    def call_all(self, stage: str, method: str, *args) -> list:
        return [self.rt.call(method, *args)]

    def execute(self) -> tuple[list[dict], list[dict]]:
        return run_steps(self)

    def close(self):
        if getattr(self, "rt", None) is not None:
            self.rt.close()


class RayDriver:
    """world ranks as Ray actors (one GPU each on CUDA machines, fractional CPUs otherwise)."""

    def __init__(self, run: RunConfig, address: str | None = None, use_gpu: bool | None = None,
                 quiet: bool = False, num_cpus: int | None = None, on_where=None):
        self.run, self.address, self.quiet = run, address, quiet
        self.on_where = on_where  # where -> the RunConfig to build (planning.PlannedLaunch)
        self.num_cpus = num_cpus
        self.use_gpu = use_gpu
        self.actors, self.pg, self.connected = [], None, False

    # ------------------------------------------------------------------ cluster
    def _connect(self):
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        env = dict(SAFETY_ENV, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
        for k, v in os.environ.items():
            if k.startswith("EPMOE_") or k in ("TRITON_INTERPRET", "PYTHONPATH", "LD_LIBRARY_PATH",
                                               "NVSHMEM_REMOTE_TRANSPORT",
                                               "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"):
                env[k] = v
        self.env = env
        kw = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                  runtime_env={"env_vars": env})
        if ray.is_initialized():
            return ray
        if self.address:
            ray.init(address=self.address, **kw)
            self.connected = True  # disconnect on close; the cluster is not ours to stop
        else:
            import torch

            gpus = torch.cuda.device_count() if self.use_gpu is not False else 0
            cpus = self.num_cpus or max(self.run.world, os.cpu_count() or 1)
            ray.init(num_cpus=cpus, num_gpus=gpus, _temp_dir=RAY_TMPDIR, **kw)
            self.connected = True
        return ray

    def _check_capacity(self, ray, per_rank: dict):
        total = ray.cluster_resources()
        for res, amount in per_rank.items():
            have = total.get(res, 0)
            if have < amount * self.run.world:
                raise ClusterTooSmall(
                    f"the cluster has {have:g} {res}, but {self.run.world} ranks need "
                    f"{amount * self.run.world:g} ({amount:g} each): lower --ep/--tp or add nodes")

    # ------------------------------------------------------------------ waiting
    def _wait(self, stage: str, refs: list, timeout: float | None = None):
        """ray.get on one ref per rank with a deadline; failures name the rank and stage."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        timeout = self.run.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pending = {ref: r for r, ref in enumerate(refs)}
        results = [None] * len(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(pending.values())
                raise LaunchError(f"rank(s) {ranks} did not finish stage '{stage}' within "
                                  f"{timeout:g} s (hung or too slow; raise --timeout if the "
                                  f"job is just slow)")
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 1.0))
            for ref in ready:
                r = pending.pop(ref)
                try:
                    results[r] = ray.get(ref)
                except RayActorError as e:
                    raise LaunchError(f"rank {r} died during stage '{stage}': "
                                      f"{str(e).splitlines()[0]}") from None
                except RayTaskError as e:
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    raise LaunchError(f"rank {r} failed in stage '{stage}': "
                                      f"{type(cause).__name__}: {cause}") from None
                except GetTimeoutError:  # pragma: no cover
                    pending[ref] = r
        return results

    def call_all(self, stage: str, method: str, *args) -> list:
        """runtime.method(*args) on every rank, with the run's deadline."""
        return self._all(stage, "call", method, *args)

    def _all(self, stage: str, method: str, *args, timeout=None):
        t0 = time.monotonic()
        out = self._wait(stage, [getattr(a, method).remote(*args) for a in self.actors], timeout)
        logger.info("stage %s: %.2f s", stage, time.monotonic() - t0)
        return out

    # ------------------------------------------------------------------ run
    def execute(self) -> tuple[list[dict], list[dict]]:
        return run_steps(self)

    def start(self) -> list[dict]:
        ray = self._connect()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from epmoe.launch.worker import Worker

        import torch

        gpu = self.use_gpu if self.use_gpu is not None else torch.cuda.is_available()
        per_rank = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self._check_capacity(ray, per_rank)
        self.pg = placement_group([dict(per_rank) for _ in range(self.run.world)],
                                  strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=self.run.timeout_s)
        except Exception:
            raise LaunchError(f"placement group of {self.run.world} x {per_rank} not ready "
                              f"within {self.run.timeout_s:g} s: the cluster lacks resources "
                              f"(check `ray status`)") from None
        actor_cls = ray.remote(Worker)
        for r in range(self.run.world):
            opts = dict(num_cpus=1, num_gpus=1 if gpu else 0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self.pg, placement_group_bundle_index=r))
            self.actors.append(actor_cls.options(**opts).remote(r, self.run.world, self.env))
        where = self._all("start", "where")
        if self.on_where is not None:
            self.run = self.on_where(where)
        addr, port = ray.get(self.actors[0].free_port.remote(), timeout=self.run.timeout_s)
        self._all("init_process_group", "init_group", addr, port, self.run.timeout_s)
        self._all("build", "build", self.run)
        return where

    def close(self):
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # pragma: no cover
                pass
        self.actors = []
        if self.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
            except Exception:  # pragma: no cover
                pass
            self.pg = None
        if self.connected and ray.is_initialized():
            ray.shutdown()  # stops the cluster if we started it, else only disconnects
        logger.debug("ray driver closed")


def run_steps(d, on_step=None) -> tuple[list[dict], list[dict]]:
    """Start the ranks, run every step (calling on_step(step) after each), collect reports."""
    where = d.start()
    bar = _progress(d.run.steps, d.quiet)
    try:
        for s in range(d.run.steps):
            d.call_all(f"step {s}", "step", s)
            if on_step is not None:
                on_step(s)
            if bar:
                bar.advance(bar.task_ids[0])
    finally:
        if bar:
            bar.stop()
    return d.call_all("report", "report"), where


@contextmanager
def driver_for(run: RunConfig, address: str | None = None, quiet: bool = False,
               use_gpu: bool | None = None, num_cpus: int | None = None, on_where=None):
    """on_where(where) -> RunConfig: called with the ranks' places before they build (Ray)."""
    d = (InProcessDriver(run, quiet) if run.world == 1 and address is None
         else RayDriver(run, address, use_gpu=use_gpu, quiet=quiet, num_cpus=num_cpus,
                        on_where=on_where))
    try:
        yield d
    finally:
        d.close()
