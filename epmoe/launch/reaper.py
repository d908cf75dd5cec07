"""The private cluster's reaper: whatever way the launcher ends, even `kill -9` or the OOM
killer, nothing of its private Ray cluster outlives it.

The launcher starts this file as a script (`python reaper.py FD TAG DIR`: standard library
only, nothing of epmoe imported) in its own session before Ray starts, and keeps the write end
of a pipe whose read end is FD. The processes Ray starts inherit EPMOE_CLUSTER_TAG=TAG (set
only while ray.init starts its daemons; the rank actors come from those). When the pipe reads
end-of-file (the launcher closed it after its own clean shutdown, or died), the reaper sends
SIGTERM to every process of this user whose environment carries the tag or which holds a file
open under DIR (Ray's logs), and to their descendants, SIGKILL to those still there after a
grace period, and removes DIR (the run's temp dir: Ray's sockets and the token file).
Linux finds the processes in /proc; elsewhere only DIR is removed.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

TAG_VAR = "EPMOE_CLUSTER_TAG"
GRACE_S = 3.0


def fd_targets(pid: int | str) -> list[str]:
    """What a process's open file descriptors point at ([] if it is gone or not ours)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for fd in fds:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def _holds_file_under(pid: str, dirs: tuple[str, ...]) -> bool:
    return any(t.startswith(dirs) for t in fd_targets(pid))


def ancestors(pid: int) -> set[int]:
    """pid and the processes above it (up to init)."""
    out = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except OSError:
            break
    return out


def members(tag: str, tmp: str, spare: frozenset[int] = frozenset()) -> list[int]:
    """This user's live processes (not zombies, not this one) of the cluster: those whose
    environment has TAG_VAR=tag or which hold a file open under `tmp` (Ray's processes log
    there; its agents rename themselves over their environment block, and outlive their
    parent raylet when the launcher is killed), and their descendants; never one in `spare`
    (the launcher and what runs it: its Ray driver logs there too, and on a clean exit it is
    waiting for this sweep)."""
    want = f"{TAG_VAR}={tag}".encode()
    dirs = tuple({os.path.join(tmp, ""), os.path.join(os.path.realpath(tmp), "")})
    parent, found = {}, set()
    try:
        names = [d for d in os.listdir("/proc")
                 if d.isdigit() and int(d) != os.getpid() and int(d) not in spare]
    except OSError:
        return []
    for d in names:
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
        except OSError:  # gone, or another user's
            continue
        if fields[0] == b"Z":
            continue
        parent[int(d)] = int(fields[1])
        if want in env.split(b"\0") or _holds_file_under(d, dirs):
            found.add(int(d))
    grew = True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return sorted(found)


def sweep(tag: str, tmp: str, spare: frozenset[int] = frozenset(),
          grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM the cluster's processes, SIGKILL what is left after grace_s; -> those found."""
    found = members(tag, tmp, spare)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        for pid in members(tag, tmp, spare):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while wait and members(tag, tmp, spare) and time.monotonic() < deadline:
            time.sleep(0.1)
    return found


def main(argv: list[str]) -> int:
    fd, tag, tmp = int(argv[0]), argv[1], argv[2]
    spare = frozenset(ancestors(os.getppid()))  # the launcher (alive until it closes the pipe)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # outlive the launcher's Ctrl-C / hangup
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while True:  # blocks until every write end is closed
        try:
            if not os.read(fd, 4096):
                break
        except InterruptedError:  # pragma: no cover (PEP 475 retries)
            continue
        except OSError:
            break
    sweep(tag, tmp, spare)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
