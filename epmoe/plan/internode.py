"""DeepEP V1's internode normal kernels as their warps divide the rows (the model's SM term
across nodes).

Both the intranode and the internode kernels run one channel on a pair of SMs, num_sms / 2
channels, and every copy is done by a warp that moves one row at a time. The intranode
kernels (`intranode.cu`: 768 threads) give each SM of a pair 24 warps that copy: the sender
SM's warps put every row the rank sends, the receiver SM's take every row it receives. The
profile's per-SM rate is measured on those kernels (`bench.calibrate`, intranode), so one
copying warp moves per_sm_GBps x 2 / 24.

The internode kernels (`internode.cu`) split a channel's warps by role, each role with its own
rows:
- dispatch (16 warps a SM): 7 RDMA senders put one row per (token, destination node), the own
  node's included, into the RDMA buffers; 8 forwarders, one per NVLink peer, take the rows a
  node receives out of the RDMA buffers and put one per (token, rank) on NVLink; 8 NVLink
  receivers, one per source peer, copy them into the output;
- combine: 8 NVLink senders send one row per (token, rank) back; the forwarders (24 // nodes
  warps per source node, at least one: 24 at 2, 4 or 8 nodes, 16 at 16) reduce them into one
  row per (token, node) for RDMA; the RDMA receivers (the forwarders less 8) reduce those.
The roles run at once, so a channel takes as long as its slowest role. The forwarders and
receivers copy with TMA, the intranode sender with the warp's own loads and stores: equal
rates per warp are the model's assumption, not a measurement (BENCHMARKS.md section 35:
where it lands against published internode tables). A local HBM copy does not support it (8
TMA warps move 2.5x what this gives them, BENCHMARKS.md 47), but giving them that rate puts
the two-node H200 rows at +105..135%: what binds across nodes is not the local copy rate.
"""

from __future__ import annotations

from dataclasses import dataclass

INTRANODE_WARPS = 24  # copying warps on each SM of an intranode channel (768 threads)
DISPATCH_RDMA_SENDERS = 7  # kNumDispatchRDMASenderWarps
NVL_PEERS = 8  # NUM_MAX_NVL_PEERS: one forwarder / receiver / sender warp per peer
COMBINE_FORWARDER_WARPS = 24  # kNumCombineForwarderWarps


@dataclass(frozen=True)
class Role:
    """warps: a channel's warps in the role; per: which rows it copies ("rank": one per
    (token, destination rank), "node": one per (token, destination node))."""

    name: str
    warps: int
    per: str


def roles(direction: str, num_nodes: int) -> tuple[Role, ...]:
    """The roles of a channel of DeepEP V1's internode kernel for one direction."""
    if direction == "dispatch":
        return (Role("rdma_sender", DISPATCH_RDMA_SENDERS, "node"),
                Role("forwarder", NVL_PEERS, "rank"),
                Role("nvl_receiver", NVL_PEERS, "rank"))
    forwarders = num_nodes * max(COMBINE_FORWARDER_WARPS // num_nodes, 1)
    return (Role("nvl_sender", NVL_PEERS, "rank"),
            Role("forwarder", forwarders, "rank"),
            Role("rdma_receiver", forwarders - NVL_PEERS, "node"))


def sm_rows(direction: str, num_nodes: int, rank_rows: float, node_rows: float) -> float:
    """Rows at the intranode kernels' per-SM rate that take as long as the slowest role: a
    role's rows over its share of the intranode warps."""
    rows = {"rank": rank_rows, "node": node_rows}
    return max(rows[r.per] * INTRANODE_WARPS / r.warps for r in roles(direction, num_nodes))
