"""Which node each rank runs on, learned once by an all-gather of a node id.

A rank's node id is its Ray node id inside a Ray worker (two raylets on one machine are two
nodes), else its hostname. Placements number GPUs node by node (GPU g on node g // (G / N));
`gpu_of_rank` maps the runtime's ranks onto that numbering when Ray did not give consecutive
ranks to a node.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """node_of_rank[r]: the node index of rank r (nodes numbered by their first rank)."""

    node_of_rank: tuple[int, ...]

    @classmethod
    def single_node(cls, world: int) -> Topology:
        return cls((0,) * world)

    @classmethod
    def from_node_ids(cls, ids) -> Topology:
        first: dict = {}
        return cls(tuple(first.setdefault(i, len(first)) for i in ids))

    @property
    def world(self) -> int:
        return len(self.node_of_rank)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of_rank))

    @property
    def ranks_per_node(self) -> int | None:
        """The common rank count of every node; None when nodes differ."""
        sizes = {self.node_of_rank.count(n) for n in range(self.num_nodes)}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def gpu_of_rank(self) -> tuple[int, ...]:
        """Placement GPU index of each rank: ranks ordered by (node, rank)."""
        order = sorted(range(self.world), key=lambda r: (self.node_of_rank[r], r))
        gpu = [0] * self.world
        for g, r in enumerate(order):
            gpu[r] = g
        return tuple(gpu)

    def to_gpu_order(self, phy2log_LR: torch.Tensor) -> torch.Tensor:
        """Slots in rank order (rank r holds block r) -> slots in placement GPU order."""
        L, R = phy2log_LR.shape
        by_rank = phy2log_LR.view(L, self.world, R // self.world)
        out = torch.empty_like(by_rank)
        out[:, list(self.gpu_of_rank)] = by_rank
        return out.view(L, R)

    def to_rank_order(self, phy2log_LR: torch.Tensor) -> torch.Tensor:
        L, R = phy2log_LR.shape
        return phy2log_LR.view(L, self.world, R // self.world)[:, list(self.gpu_of_rank)] \
            .reshape(L, R)

    def summary(self) -> dict:
        return dict(num_nodes=self.num_nodes, ranks_per_node=self.ranks_per_node,
                    node_of_rank=list(self.node_of_rank))


def local_node_id() -> str:
    """The Ray node id inside a Ray worker, else the hostname."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except (ImportError, AttributeError, RuntimeError):  # no Ray on this machine
        pass
    return socket.gethostname()


def discover(group, world: int, device) -> Topology:
    """All-gather every rank's node id (as a 63-bit hash) over `group`; collective."""
    if group is None or world == 1:
        return Topology.single_node(world)
    digest = hashlib.blake2b(local_node_id().encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little") >> 1], dtype=torch.int64,
                        device=device)
    ids = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(ids, mine, group=group)
    return Topology.from_node_ids([int(t) for t in ids])
