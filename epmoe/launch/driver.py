"""Drive N ranks: in-process for one rank, Ray actors in a placement group otherwise.

Every wait on the ranks has the run's deadline (`--timeout`). While it waits the driver asks
every rank where it is (a heartbeat, answered by a second actor thread). When a stage goes
wrong it collects every rank's outcome for a moment, asks the survivors where they are, and
blames the rank that failed first (see epmoe.launch.blame): a LaunchError naming the rank, the
stage and the ranks that were only waiting. All workers are then torn down (actors killed,
placement group removed, the private cluster stopped).
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from epmoe.env import SAFETY_ENV, forwarded_env, logger
from epmoe.launch.blame import Heartbeat, RankFailure, RankState, attribute
from epmoe.launch.blame import death_detail, is_collective_error, oom_detail
from epmoe.launch.cluster import ClusterAddress, RayCluster
from epmoe.launch.console import Phases
from epmoe.launch.errors import ClusterTooSmall, InputError, LaunchError  # noqa: F401
from epmoe.launch.inprocess import InProcessDriver, first_line, run_steps
from epmoe.launch.oracle import LayerCheck, LayerVerdict, check_deadline_s
from epmoe.launch.worker import PROBE_GROUP
from epmoe.plan.run import RunConfig

HEARTBEAT_S = 1.0  # how often a waiting driver asks every rank where it is
GRACE_S = 2.0  # after a first failure, how long to collect the other ranks' outcomes
PROBE_S = 3.0  # how long a rank has to answer the heartbeat that decides the blame
# the process group's own timeout is the run's plus this: the driver's deadline decides the
# verdict; a rank's collective gives up by itself only when the driver is gone or late
GROUP_MARGIN_S = 30.0


def rank_resources(gpu: bool, ranks_per_gpu: int = 1) -> tuple[dict, str]:
    """-> (the Ray resources of one rank, its process group backend): a GPU rank takes
    1 / ranks_per_gpu of a GPU and joins NCCL, unless ranks share GPUs (NCCL refuses two ranks
    on one device: gloo then, as for CPU ranks)."""
    if not gpu:
        return {"CPU": 1}, "gloo"
    return {"GPU": 1 / ranks_per_gpu, "CPU": 1}, "nccl" if ranks_per_gpu == 1 else "gloo"


class RayDriver:
    """world ranks as Ray actors (one GPU each on CUDA clusters, one CPU otherwise)."""

    on_ray = True
    CALLS = {"where": "start", "init_group": "init_process_group"}  # actor method -> its call

    def __init__(self, run: RunConfig, address: ClusterAddress | None = None,
                 use_gpu: bool | None = None, phases: Phases | None = None,
                 num_cpus: int | None = None, precheck: Callable[[str], None] | None = None,
                 on_where: Callable[[list[dict]], RunConfig] | None = None):
        self.run, self.address, self.use_gpu = run, address, use_gpu
        self.on_where = on_where  # where -> the RunConfig to build (planning.PlannedLaunch)
        self.phases = phases or Phases(quiet=True)
        self.num_cpus, self.precheck = num_cpus, precheck
        self.actors, self.pg, self.cluster = [], None, None
        self._last_beat: dict[int, Heartbeat] = {}
        self._beat_refs: dict[int, object] = {}
        self._next_beat = 0.0
        self.seconds: dict[str, float] = {}  # wall time of each stage of the launch

    # ------------------------------------------------------------------ cluster
    def _connect(self):
        import ray
        import torch

        env = dict(SAFETY_ENV, PYTHONUNBUFFERED="1")
        kw = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        if self.address is None:
            self.phases("starting a private Ray cluster (loopback only, token auth)")
            gpus = torch.cuda.device_count() if self.use_gpu is not False else 0
            cpus = self.num_cpus or max(self.run.world, os.cpu_count() or 1)
            self.cluster = RayCluster(None, self.run.timeout_s, num_cpus=cpus, num_gpus=gpus)
        else:
            self.phases(f"joining the Ray cluster at {self.address.for_ray}")
            self.cluster = RayCluster(self.address, self.run.timeout_s)
        self.cluster.connect(kw)
        logger.info("connected: %s", self.cluster.describe())
        self.env = dict(env, **forwarded_env())  # after connect: loopback settings included
        return ray

    def _check_capacity(self, ray, per_rank: dict):
        total = ray.cluster_resources()
        for res, amount in per_rank.items():
            have = total.get(res, 0)
            if have < amount * self.run.world - 1e-6:  # fractions of a GPU: float sums
                raise ClusterTooSmall(
                    f"the cluster has {have:g} {res}, but {self.run.world} ranks need "
                    f"{amount * self.run.world:g} ({amount:g} each): lower --ep/--tp or add nodes")

    # ------------------------------------------------------------------ waiting
    def _poll_heartbeats(self, force: bool = False) -> None:
        """Without blocking: keep one heartbeat query in flight per rank, store answers."""
        import ray

        now = time.monotonic()
        if not force and now < self._next_beat:
            return
        self._next_beat = now + HEARTBEAT_S
        if self._beat_refs:
            refs = {ref: r for r, ref in self._beat_refs.items()}
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            for ref in ready:
                r = refs[ref]
                del self._beat_refs[r]
                try:
                    self._last_beat[r] = ray.get(ref)
                except Exception:  # a dead rank: its last heartbeat stays
                    pass
        for r, a in enumerate(self.actors):
            if r not in self._beat_refs:
                self._beat_refs[r] = a.progress.options(concurrency_group=PROBE_GROUP).remote()

    def _probe(self, ranks: list[int]) -> dict[int, Heartbeat | str | None]:
        """Fresh heartbeats: rank -> Heartbeat, "dead", or None (no answer within PROBE_S)."""
        import ray
        from ray.exceptions import RayActorError

        refs = {self.actors[r].progress.options(concurrency_group=PROBE_GROUP).remote(): r
                for r in ranks}
        out: dict[int, Heartbeat | str | None] = {r: None for r in ranks}
        if not refs:
            return out
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_S)
        for ref in ready:
            try:
                out[refs[ref]] = ray.get(ref)
            except RayActorError:
                out[refs[ref]] = "dead"
            except Exception:  # pragma: no cover
                pass
        return out

    def _outcome(self, r: int, ref, order: int) -> tuple[object, RankState | None]:
        import ray
        from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

        try:
            return ray.get(ref), None
        except RayActorError as e:
            return None, RankState(r, "died", error=death_detail(str(e)), order=order)
        except OutOfMemoryError as e:  # (not a RayActorError: Ray's monitor killed it)
            return None, RankState(r, "died", error=oom_detail(str(e)), order=order)
        except RayTaskError as e:
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, RankFailure):
                return None, RankState(r, "error", error=cause.error, collective=cause.collective,
                                       order=order, where=cause.where)
            return None, RankState(r, "error", error=f"{type(cause).__name__}: "
                                   f"{first_line(cause)}", collective=is_collective_error(cause),
                                   order=order)

    def _wait(self, stage: str, method: str, refs: list, timeout: float | None = None):
        """One result per rank, or a LaunchError that blames the right rank."""
        import ray

        timeout = self.run.timeout_s if timeout is None else timeout
        t0 = time.monotonic()
        deadline = t0 + timeout
        pending = {ref: r for r, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        failed: dict[int, RankState] = {}
        stop = deadline
        while pending:
            left = stop - time.monotonic()
            if left <= 0:
                break
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, HEARTBEAT_S))
            for ref in ready:
                r = pending.pop(ref)
                results[r], state = self._outcome(r, ref, len(failed))
                if state is not None:
                    failed[r] = state
            if failed and stop == deadline:  # first failure: collect the others for a moment
                stop = min(deadline, time.monotonic() + GRACE_S)
            self._poll_heartbeats()
        if not failed and not pending:
            return results
        raise self._blame(stage, method, timeout, failed, sorted(pending.values()), t0)

    def _blame(self, stage, method, timeout, failed, pending, t0) -> LaunchError:
        beats = self._probe([r for r in range(len(self.actors))
                             if failed.get(r) is None or failed[r].outcome != "died"])
        order = len(failed)
        states = []
        for r in range(len(self.actors)):
            answer = beats.get(r)
            last = self._last_beat.get(r)  # from the polls while waiting (this call's only)
            last = last if last is not None and last.call == method else None
            beat = answer if isinstance(answer, Heartbeat) else last
            if r in failed:
                states.append(dataclasses.replace(failed[r], heartbeat=beat))
            elif answer == "dead":
                states.append(RankState(r, "died", error="its process died", order=order,
                                        heartbeat=last))
                order += 1
            elif r in pending:
                states.append(RankState(r, "pending", heartbeat=beat, answered=answer is not None))
            else:
                states.append(RankState(r, "ok", heartbeat=beat))
        failure = attribute(stage, states, timeout, round(time.monotonic() - t0, 2))
        return LaunchError(failure.message(), failure)

    def call_all(self, stage: str, method: str, *args) -> list:
        """runtime.method(*args) on every rank, with the run's deadline."""
        return self._all(stage, "call", method, *args)

    def _all(self, stage: str, method: str, *args, timeout=None):
        t0 = time.monotonic()
        call = args[0] if method == "call" else self.CALLS.get(method, method)
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        out = self._wait(stage, call, refs, timeout)
        self.seconds[stage] = round(time.monotonic() - t0, 3)
        logger.info("stage %s: %.2f s", stage, self.seconds[stage])
        return out

    # ------------------------------------------------------------------ run
    def execute(self) -> tuple[list[dict], list[dict]]:
        return run_steps(self)

    def solve_checks(self, checks: list[LayerCheck]) -> Iterator[LayerVerdict]:
        """The float64 check of each layer on the ranks, one layer per rank at a time, each on
        its rank's device; a round waits --timeout plus its weights' regeneration at the
        slowest rate (`oracle.check_deadline_s`) and blames a rank that overruns it."""
        n = len(self.actors)
        for i in range(0, len(checks), n):
            batch = checks[i:i + n]
            refs = [a.check.remote(batch[r] if r < len(batch) else None)
                    for r, a in enumerate(self.actors)]
            out = self._wait("oracle", "oracle", refs, check_deadline_s(self.run, batch))
            yield from (v for v in out if v is not None)

    def start(self) -> list[dict]:
        t0 = time.monotonic()
        ray = self._connect()
        self.seconds["connect"] = round(time.monotonic() - t0, 3)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from epmoe.launch.worker import Worker

        if self.use_gpu is not None:
            gpu = self.use_gpu
        else:
            gpu = ray.cluster_resources().get("GPU", 0) > 0
        if self.precheck is not None:
            self.precheck("cuda" if gpu else "cpu")
        per_rank, group = rank_resources(gpu, self.run.ranks_per_gpu)
        self._check_capacity(ray, per_rank)
        n = self.run.world
        self.phases(f"starting {n} ranks as Ray actors")
        self.pg = placement_group([dict(per_rank) for _ in range(n)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=self.run.start_timeout_s)
        except Exception:
            raise LaunchError(f"placement group of {n} x {per_rank} not ready within "
                              f"{self.run.start_timeout_s:g} s: the cluster lacks resources "
                              f"(check `ray status`)") from None
        actor_cls = ray.remote(concurrency_groups={PROBE_GROUP: 1})(Worker)
        # CPU ranks see no GPU, whatever the node has: their tensors, gloo group and Triton
        # interpreter must agree (Ray leaves a GPU-less actor's visible devices alone)
        env = self.env if gpu else dict(self.env, CUDA_VISIBLE_DEVICES="")
        for r in range(n):
            opts = dict(num_cpus=1, num_gpus=per_rank.get("GPU", 0),
                        runtime_env={"env_vars": env},
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self.pg, placement_group_bundle_index=r))
            self.actors.append(actor_cls.options(**opts).remote(r, n, env))
        start = self.run.start_timeout_s
        where = self._all("start", "where", timeout=start)
        if self.on_where is not None:  # the planner may re-plan for where the ranks landed
            self.run = self.on_where(where)
        self.phases(f"connecting the ranks ({group} process group)")
        addr, port = self._wait("start", "open_store", [self.actors[0].open_store.remote()],
                                start)[0]
        # the group's own timeout bounds its collectives in every later stage: past the run's
        self._all("init_process_group", "init_group", addr, port,
                  self.run.timeout_s + GROUP_MARGIN_S, group, timeout=start)
        self.phases("building the layers (weights, comm, experts)")
        self._all("build", "build", self.run)
        return where

    def close(self):
        import ray

        if ray.is_initialized():
            for a in self.actors:
                try:
                    ray.kill(a)
                except Exception:  # pragma: no cover
                    pass
            if self.pg is not None:
                try:
                    from ray.util.placement_group import remove_placement_group

                    remove_placement_group(self.pg)
                except Exception:  # pragma: no cover
                    pass
        self.actors, self.pg = [], None
        if self.cluster is not None:
            self.cluster.close()  # stops a private cluster, else only disconnects
            self.cluster = None
        logger.debug("ray driver closed")


@contextmanager
def driver_for(run: RunConfig, address: ClusterAddress | None = None,
               phases: Phases | None = None, use_gpu: bool | None = None,
               num_cpus: int | None = None, precheck: Callable[[str], None] | None = None,
               on_where: Callable[[list[dict]], RunConfig] | None = None):
    """on_where(where) -> RunConfig: called with the ranks' places before they build (Ray)."""
    phases = phases or Phases(quiet=True)
    if run.world == 1 and address is None:
        d = InProcessDriver(run, phases, device="cpu" if use_gpu is False else None)
    else:
        d = RayDriver(run, address, use_gpu=use_gpu, phases=phases, num_cpus=num_cpus,
                      precheck=precheck, on_where=on_where)
    try:
        yield d
    finally:
        d.close()
