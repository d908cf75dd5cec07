"""The symmetric arena: one byte allocation per rank, identical layout on every rank, and the
int64 byte distance from this rank's base to every peer's base.

Kernels address a peer as `arena_ptr + peer_delta_W[d] + region offset`, the same code for the
three places an arena lives:

| arena            | where the W bases are                        | peer_delta_W[d]               |
|------------------|----------------------------------------------|-------------------------------|
| `LoopbackWorld`  | rows of one [W, bytes] tensor, one process   | (d - r) * bytes               |
|                  | (CPU under TRITON_INTERPRET=1, or one GPU)   |                               |
| `NvshmemArena`   | one nvshmem4py symmetric uint8 tensor / rank | peer view ptr - own ptr       |
|                  | (peer views via get_peer_tensor, NVLink)     | (get_peer_tensor, taken once) |

The region layout (`ArenaLayout`) is computed from the run's worst case; the control block at
offset 0 is common to every layout (`CTRL_*` word indices below).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Operations that own control words (one set per op).
HT_DISPATCH, HT_COMBINE, LL_DISPATCH, LL_COMBINE = 0, 1, 2, 3
NUM_OPS = 4
OP_NAMES = ("ht-dispatch", "ht-combine", "ll-dispatch", "ll-combine")
# Control block, int32 words: seq[op] (calls completed on this rank), done_send[op] /
# done_recv[op] (CTA arrivals of the running kernel), err[8] (first timeout: flag, phase, peer,
# seen, expected), send_seq[op] (calls whose send half completed: symm-ht's dispatch send
# counts its own, as its receive may finish first), role[op] (CTAs of a running pipelined
# kernel that took their role), then ready[op][W] (epoch the source published to me) and
# ack[op][W] (epoch the peer has consumed from me, i.e. the buffer I may refill).
CTRL_SEQ, CTRL_DONE_SEND, CTRL_DONE_RECV, CTRL_ERR = 0, 4, 8, 12
ERR_WORDS = 8
CTRL_SEQ_SEND, CTRL_ROLE = 20, 24
# symm-ht combine: what every done word holds before a call (the sum of the calls' column
# chunks so far), and the whole kernel's arrivals (its last CTA advances the sum)
CTRL_CDONE_SUM, CTRL_CDONE_ARRIVE = 28, 29
CTRL_READY = 32  # + op * W + src


def ctrl_ack(world: int) -> int:
    return CTRL_READY + NUM_OPS * world  # + op * W + peer


def ctrl_words(world: int) -> int:
    return ctrl_ack(world) + NUM_OPS * world


# Phase codes of the error record: 2 * op + (0: waiting for a peer to release its buffer,
# 1: waiting for a peer's data); LOCAL_PHASE + op: waiting for another role of the same kernel.
LOCAL_PHASE = 100


def phase_name(code: int) -> str:
    if int(code) >= LOCAL_PHASE and int(code) - LOCAL_PHASE < NUM_OPS:
        return (OP_NAMES[int(code) - LOCAL_PHASE] + " send, waiting for this rank's own "
                "reduction (a fault of this rank's kernel, not of a peer)")
    op, what = divmod(int(code), 2)
    if not 0 <= op < NUM_OPS:
        return f"phase code {code}"
    return OP_NAMES[op] + (" send, waiting for the peer to release its receive buffer"
                           if what == 0 else " receive, waiting for the peer's data")


class SymmTimeoutError(RuntimeError):
    """A bounded spin ran out: the peer never published (or never released) in time."""


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class ArenaLayout:
    """Byte offsets of the regions of one arena (identical on every rank).

    regions: name -> (offset, nbytes), every offset 128-byte aligned; nbytes: the total.
    """

    regions: tuple[tuple[str, int, int], ...]
    nbytes: int
    world: int

    @classmethod
    def build(cls, world: int, sizes: list[tuple[str, int]]) -> "ArenaLayout":
        off, regions = 0, []
        for name, n in [("ctrl", ctrl_words(world) * 4), *sizes]:
            regions.append((name, off, int(n)))
            off = _align(off + int(n), 128)
        return cls(tuple(regions), max(off, 128), world)

    def offset(self, name: str) -> int:
        for n, off, _ in self.regions:
            if n == name:
                return off
        raise KeyError(f"arena region {name!r} not in this layout "
                       f"({[n for n, _, _ in self.regions]})")

    def size(self, name: str) -> int:
        return next(n for r, _, n in self.regions if r == name) if self.has(name) else 0

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.regions)


@dataclass(frozen=True)
class RankArena:
    """One rank's view of a symmetric arena.

    base         uint8 [nbytes], this rank's allocation (kernels get it as `arena_ptr`)
    peer_delta_W int64 [W], byte distance from base to each rank's base (0 for this rank)
    loopback     every rank's arena lives in this process (`LoopbackWorld`): its driver runs
                 the ranks one after another, so no kernel may wait for a later launch
    """

    base: torch.Tensor
    peer_delta_W: torch.Tensor
    rank: int
    layout: ArenaLayout
    loopback: bool = False

    @property
    def world(self) -> int:
        return self.layout.world

    def words(self, name: str, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """A region of this rank's arena as a flat tensor of `dtype` (a view)."""
        off, n = self.layout.offset(name), self.layout.size(name)
        return self.base[off:off + n].view(dtype)

    def ctrl(self) -> torch.Tensor:
        return self.words("ctrl")

    def error(self) -> tuple[int, int, int, int] | None:
        """(phase, peer, seen, expected) of the first timeout recorded, or None. Syncs."""
        rec = self.ctrl()[CTRL_ERR:CTRL_ERR + ERR_WORDS].tolist()
        return None if rec[0] == 0 else (rec[1], rec[2], rec[3], rec[4])

    def raise_if_error(self) -> None:
        """Raise `SymmTimeoutError` naming rank, peer and phase if a spin timed out."""
        err = self.error()
        if err is not None:
            phase, peer, seen, want = err
            raise SymmTimeoutError(
                f"symm comm: rank {self.rank} timed out on peer {peer} in {phase_name(phase)} "
                f"(flag {seen}, expected >= {want}); the peer never reached this call "
                f"(it failed, hung, or called a different sequence of dispatch/combine): fix "
                f"the peer, or raise SymmOptions.timeout_s if it is only slow")


class LoopbackWorld:
    """W ranks' arenas in one process: rows of one zeroed [W, nbytes] tensor on `device`.

    The same kernels run on them as on real ranks; tests and the one-GPU benchmark run the
    ranks "rank by rank" per phase (every rank's send, then every rank's receive).
    """

    def __init__(self, layout: ArenaLayout, device="cpu"):
        self.layout = layout
        w = layout.world
        self.storage = torch.zeros((w, layout.nbytes), dtype=torch.uint8, device=device)
        stride = self.storage.stride(0)
        self._deltas = [torch.tensor([(d - r) * stride for d in range(w)], dtype=torch.int64,
                                     device=device) for r in range(w)]

    @property
    def world(self) -> int:
        return self.layout.world

    def rank(self, r: int) -> RankArena:
        return RankArena(self.storage[r], self._deltas[r], r, self.layout, loopback=True)


class ArenaResource:
    """A rank's arena as a `CommContext` resource: the view the kernels use, the host-side
    order check (each op alternates send and receive on every rank: the device epochs count
    on it), and `close()` (collective for NVSHMEM arenas)."""

    def __init__(self, view: RankArena, closer=None):
        self.view = view
        self._closer = closer
        self._sent = [False] * NUM_OPS
        self._done = [0] * NUM_OPS  # calls of each op completed on this rank

    def begin(self, op: int) -> bool:
        """Start a send; -> True on the op's first call on this arena."""
        if self._sent[op]:
            raise RuntimeError(f"{OP_NAMES[op]}: send called twice without the receive in "
                               f"between on rank {self.view.rank}; every send must be followed "
                               f"by its receive (dispatch_recv / combine_recv) before the next")
        self._sent[op] = True
        return self._done[op] == 0

    def end(self, op: int) -> bool:
        """Start the receive that ends the call; -> True if it ends the op's first call."""
        if not self._sent[op]:
            raise RuntimeError(f"{OP_NAMES[op]}: receive called without a send on rank "
                               f"{self.view.rank}; call the send half first")
        self._sent[op] = False
        self._done[op] += 1
        return self._done[op] == 1

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None


def acquire_arena(ctx, key: str, layout: ArenaLayout) -> ArenaResource:
    """The context's arena `key` (made on first use: NVSHMEM, initialized once per process);
    every layer of a run needs the same layout."""
    res = ctx.resource(key, lambda: _nvshmem_arena(ctx, layout))
    if res.view.layout != layout:
        have = res.view.layout.nbytes
        raise ValueError(f"arena {key!r} of this rank was built for another shape ({have} "
                         f"bytes, this layer needs {layout.nbytes}); every layer of a run must "
                         f"share hidden, top-k, experts per rank, recipe and max tokens")
    return res


def _nvshmem_arena(ctx, layout: ArenaLayout) -> ArenaResource:
    if ctx.device.type != "cuda":
        raise ValueError(f"symm arenas live in NVSHMEM on CUDA devices; device {ctx.device} is "
                         f"not one (on CPU only the loopback world runs them: "
                         f"epmoe.comm.symm.loopback)")
    if ctx.has("deepep-ll"):
        raise RuntimeError("DeepEP low-latency already initialized NVSHMEM in this process; "
                           "symm-* cannot initialize it a second time: run symm-* and "
                           "deepep-ll in separate processes (separate runs)")
    ctx.resource("symm-nvshmem", lambda: NvshmemSession(ctx.group, ctx.rank, ctx.world,
                                                        ctx.device))
    arena = NvshmemArena(layout, ctx.rank, ctx.device, ctx.group)
    return ArenaResource(arena.view, arena.close)


class NvshmemArena:
    """This rank's arena on the NVSHMEM symmetric heap (nvshmem4py), for real ranks of one node.

    `init_nvshmem(group, rank, world, device)` must have run in this process (see
    `NvshmemSession`); the Runtime owns both through `CommContext.resource`. Peer views are taken
    once, on the base allocation (get_peer_tensor works on base allocations only).
    """

    def __init__(self, layout: ArenaLayout, rank: int, device: torch.device, group=None):
        import torch.distributed as dist  # noqa: PLC0415

        import nvshmem.core as nvshmem  # noqa: PLC0415  (lazy: GPU-only dependency)

        self._nvshmem = nvshmem
        self.tensor = nvshmem.tensor((layout.nbytes,), dtype=torch.uint8)
        self.tensor.zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's zeroed control block before any peer writes
        base = self.tensor.data_ptr()
        deltas = []
        for d in range(layout.world):
            peer = nvshmem.get_peer_tensor(self.tensor, d)  # d == rank: a view of itself
            if peer is None:
                raise RuntimeError(f"rank {d} is not reachable by load/store from rank {rank} "
                                   f"(nvshmem_ptr is null: not the same node / no NVLink P2P); "
                                   f"symm-ht/symm-ll run within one NVLink domain only: use "
                                   f"all2all or deepep across nodes")
            deltas.append(peer.data_ptr() - base)
        self.view = RankArena(self.tensor, torch.tensor(deltas, dtype=torch.int64, device=device),
                              rank, layout)

    def close(self) -> None:
        """Collective: every rank frees its arena in the same order."""
        if self.tensor is not None:
            torch.cuda.synchronize()
            self._nvshmem.free_tensor(self.tensor)
            self.tensor = None


class NvshmemSession:
    """One NVSHMEM initialization per process (UID bootstrap over the torch process group).

    The owner of NVSHMEM in this process: DeepEP's low-latency mode initializes NVSHMEM itself,
    so symm-* and deepep-ll cannot share a process (`check_no_deepep_nvshmem` says so).
    """

    def __init__(self, group, rank: int, world: int, device: torch.device):
        import torch.distributed as dist  # noqa: PLC0415

        import nvshmem.core as nvshmem  # noqa: PLC0415

        try:  # cuda-core >= 0.4 / 1.x
            from cuda.core import Device  # noqa: PLC0415
        except ImportError:
            from cuda.core.experimental import Device  # noqa: PLC0415

        self._nvshmem = nvshmem
        uid = nvshmem.get_unique_id(empty=rank != 0)
        raw = uid._data.view("uint8")
        buf = torch.from_numpy(raw.copy())
        if dist.get_backend(group) == "nccl":
            buf = buf.to(device)
        dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group is not None else 0,
                       group=group)
        raw[:] = buf.cpu().numpy()
        dev = Device(torch.device(device).index or 0)
        dev.set_current()
        nvshmem.init(device=dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")
        self.alive = True

    def close(self) -> None:
        if self.alive:
            self._nvshmem.finalize()
            self.alive = False


__all__ = ["ArenaResource", "acquire_arena", "ArenaLayout", "RankArena", "LoopbackWorld",
           "NvshmemArena", "NvshmemSession", "SymmTimeoutError", "HT_DISPATCH", "HT_COMBINE",
           "LL_DISPATCH", "LL_COMBINE"]
