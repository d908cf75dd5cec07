"""Which rank failed, where, and which ranks were only waiting for it.

The driver collects one `RankState` per rank of a stage that went wrong (its outcome, the error
it raised, its last heartbeat) and `attribute()` turns them into a `Failure`:
1. a rank whose process died is blamed first (actor death beats a peer's collective error:
   the peers of a dead rank fail with "connection reset" or wait forever);
2. else a rank that raised an error of its own (not a collective's error);
3. else (a deadline passed, or only collective errors) the rank(s) that stopped: a rank that
   does not answer its heartbeat, else one that is not blocked in a collective while others
   are, else the one(s) behind the others (fewest stages entered; of as many, the one
   still inside the stage the others have left). A rank that stopped while
   its peers gave up waiting for it (their collective or symm-* timeouts) is "stopped", with
   the first peer's error as the detail.
Every other rank that had not finished is "waiting".
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

# Text of errors that mean "a peer went away / did not come", not "this rank broke".
_COLLECTIVE_HINTS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe",
                     "timed out", "timeout", "socket", "peer", "distbackenderror",
                     "distnetworkerror", "diststoreerror", "process group")


def is_collective_error(e: BaseException) -> bool:
    """True for errors a rank gets when a peer dies or stalls inside a collective."""
    try:
        import torch.distributed as dist

        if isinstance(e, getattr(dist, "DistError", ())):
            return True
    except ImportError:  # pragma: no cover
        pass
    text = f"{type(e).__name__}: {e}".lower()
    return any(h in text for h in _COLLECTIVE_HINTS)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Fault|Exit|Interrupt)\b.*: ")


def death_detail(message: str) -> str:
    """One line out of Ray's multi-line "actor died" message: the error of a failed
    constructor, else the process id and Ray's exit detail."""
    message = _ANSI.sub("", message)
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if "creation task" in message:
        for ln in reversed(lines):  # the constructor's exception, as Ray quotes it
            if _EXC_LINE.match(ln):
                return f"its constructor raised {ln[:200]}"
    pid = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("pid:")), "?")
    detail = ""
    if "Worker exit detail:" in message:
        detail = message.split("Worker exit detail:", 1)[1].strip().split(". ")[0]
    return f"its process (pid {pid}) died" + (f" ({detail})" if detail else "")


_NODE_MEMORY = re.compile(r"Memory on the node \(IP: ([^,]+), ID: [^)]*\) was ([0-9.]+GB) used "
                          r"/ ([0-9.]+GB) limit")


def oom_detail(message: str) -> str:
    """One line out of Ray's page-long OutOfMemoryError: the rank's process was killed by
    Ray's memory monitor, and the node's memory then."""
    m = _NODE_MEMORY.search(_ANSI.sub("", message))
    node = f" (node {m.group(1)}: {m.group(2)} used of {m.group(3)})" if m else ""
    return (f"its process was killed by Ray's out-of-memory monitor{node}: the rank's "
            f"memory (weights, activations, buffers) did not fit; lower --layers or --tokens, "
            f"or spread the experts over more ranks")


class RankFailure(RuntimeError):
    """What a rank raises when a call fails: its rank, where it was, whether the error came
    from a collective, and the error's first line (pickles through Ray)."""

    def __init__(self, rank: int, where: str, collective: bool, error: str):
        super().__init__(rank, where, collective, error)
        self.rank, self.where, self.collective, self.error = rank, where, collective, error

    def __str__(self) -> str:
        return f"rank {self.rank} at {self.where}: {self.error}"


# worker calls as the report names them
# the stages bounded by --start-timeout (driver.py), the rest by --timeout
START_STAGES = ("start", "init_process_group")
CALL_LABELS = {"window_balancedness": "measure", "eplb_status": "eplb status"}


@dataclass(frozen=True)
class Heartbeat:
    """A rank's answer to `progress()`: the call it runs (or last ran), the runtime stage it
    is in, how many calls and stages it has entered (the same sequence on every rank), and
    whether it waits for peers (`in_collective`: blocked in a torch.distributed call or in
    `epmoe.peers.wait_works`, or its call ended with a collective's error, i.e. it gave up
    waiting)."""

    rank: int
    call: str
    step: int | None
    stage: str | None
    calls: int
    entered: int
    busy: bool
    in_collective: bool
    seconds_in_stage: float
    depth: int = 0  # stages open (0: between stages)

    @property
    def key(self) -> tuple[int, int, int]:
        """Progress: calls, stages entered, then stages left of those entered (a rank that
        finished the stage another is still in is ahead of it)."""
        return (self.calls, self.entered, -self.depth)

    @property
    def where(self) -> str:
        call = CALL_LABELS.get(self.call, self.call)
        if self.call == "step" and self.step is not None:
            call = f"step {self.step}"
        return f"{call} at stage {self.stage}" if self.stage else call


@dataclass(frozen=True)
class RankState:
    """One rank at the end of a failed stage. outcome: ok | died | error | pending."""

    rank: int
    outcome: str
    error: str = ""
    collective: bool = False
    order: int = 0  # arrival order of failures (0 = first)
    heartbeat: Heartbeat | None = None
    answered: bool = True  # answered the last heartbeat query
    where: str = ""  # where the rank said it failed (RankFailure), else ""


@dataclass(frozen=True)
class Failure:
    """kind: died | failed | hung | stopped (pending while its peers' waits for it failed).
    `ranks`: the blamed ranks, first to fail first."""

    stage: str
    kind: str
    ranks: tuple[int, ...]
    waiting: tuple[int, ...]
    finished: tuple[int, ...]
    detail: str
    where: dict  # rank -> where it was ("step 0 at stage experts")
    timeout_s: float | None = None
    stage_seconds: float | None = None  # from the stage's start to this verdict

    def message(self) -> str:
        def ranks(rs):
            return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"

        head = ranks(self.ranks)
        seen = self.where.get(self.ranks[0])
        at = seen or self.stage
        if self.kind == "died":
            text = f"{head} died during {self.stage}"
            text += f" (last seen in {seen}): " if seen else ": "
            text += self.detail
        elif self.kind == "failed":
            text = f"{head} failed in {at}: {self.detail}"
        elif self.kind == "stopped":
            text = f"{head} stopped in {at} ({self.detail})"
        else:
            text = (f"{head} stopped in {at} and did not finish {self.stage} within "
                    f"{self.timeout_s:g} s")
            if self.detail:
                text += f" ({self.detail})"
        if self.waiting:
            places = sorted({self.where.get(r, "") for r in self.waiting} - {""})
            one = len(self.waiting) == 1
            verb = ("is" if one else "are") if self.kind == "hung" else ("was" if one else "were")
            text += f"; {ranks(self.waiting)} {verb} waiting"
            if places:
                text += f" in {', '.join(places)}"
        if self.finished:
            text += f"; {ranks(self.finished)} finished {self.stage}"
        if self.kind == "hung":
            flag = "--start-timeout" if self.stage in START_STAGES else "--timeout"
            text += f" (hung, or too slow: raise {flag} if the job is just slow)"
        return text

    def to_json(self) -> dict:
        d = asdict(self)
        d["where"] = {str(k): v for k, v in self.where.items()}
        d["message"] = self.message()
        return d


def _behind(states: list[RankState]) -> list[RankState]:
    """The ranks that stopped, among ranks that have not finished (see the module doc)."""
    silent = [s for s in states if not s.answered]
    if silent:
        return silent
    beats = [s for s in states if s.heartbeat is not None]
    if not beats:
        return states
    waiting = [s for s in beats if s.heartbeat.in_collective]
    if waiting and len(waiting) < len(beats):
        return [s for s in beats if not s.heartbeat.in_collective]
    low = min(s.heartbeat.key for s in beats)
    return [s for s in beats if s.heartbeat.key == low]


def attribute(stage: str, states: list[RankState], timeout_s: float | None = None,
              stage_seconds: float | None = None) -> Failure:
    by_order = sorted(states, key=lambda s: (s.order, s.rank))
    died = [s for s in by_order if s.outcome == "died"]
    own = [s for s in by_order if s.outcome == "error" and not s.collective]
    unfinished = [s for s in by_order if s.outcome in ("pending", "error")]
    if died:
        kind, blamed = "died", died
    elif own:
        kind, blamed = "failed", own
    elif any(s.outcome == "error" for s in by_order):
        blamed = _behind(unfinished)
        kind = "stopped" if all(s.outcome == "pending" for s in blamed) else "failed"
    else:
        kind, blamed = "hung", _behind(unfinished)
    blamed_ranks = tuple(s.rank for s in blamed)
    where = {}
    for s in states:
        w = s.where or (s.heartbeat.where if s.heartbeat is not None else "")
        if w:
            where[s.rank] = w
    first = blamed[0]
    detail = first.error
    if kind == "hung" and not first.answered:
        detail = "it does not answer heartbeats"
    if kind == "stopped":
        waiter = next(s for s in by_order if s.outcome == "error")
        detail = f"rank {waiter.rank} gave up waiting: {waiter.error}"
    return Failure(
        stage=stage, kind=kind, ranks=blamed_ranks,
        waiting=tuple(sorted(s.rank for s in states
                             if s.outcome in ("pending", "error") and s.rank not in blamed_ranks)),
        finished=tuple(sorted(s.rank for s in states if s.outcome == "ok")),
        detail=detail, where=where, timeout_s=timeout_s, stage_seconds=stage_seconds)
