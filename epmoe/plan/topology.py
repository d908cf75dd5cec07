"""Where the ranks sit: nodes x GPUs per node, and the link classes between them.

A `Topology` is data: `num_nodes` nodes of `gpus_per_node` GPUs each, the GPU kind (a profile
name), and one `Link` per class:

| class  | joins                                   | typical                                   |
|--------|-----------------------------------------|-------------------------------------------|
| nvlink | GPUs of one node (one NVLink domain)    | NVSwitch: H100/H200 450 GB/s per direction |
| rdma   | GPUs of different nodes (one NIC each)  | ConnectX-7 400 Gb/s: 50 GB/s per direction |
| pcie   | GPUs of one node without NVLink         | Gen5 x16: 64 GB/s per direction            |
| tcp    | CPU ranks (gloo over loopback/Ethernet) | measured by calibrate                      |

Bandwidths are per GPU and per direction (what one rank can send while it also receives).
Ranks are numbered node-major unless built from per-rank node ids (`from_node_ids`, what the
Ray driver knows), which keeps the rank -> node map as given.

Constructors: `Topology.parse("2x8", gpu="h200")`, `Topology.from_json(path)`,
`Topology.from_node_ids(["a", "a", "b", "b"], gpu="h200")`. Link figures default to the GPU
kind's spec (`LINK_SPECS`); pass `links=` to override one class.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Mapping, Sequence

from epmoe.docfile import is_int, is_number, read_doc

LinkKind = Literal["nvlink", "rdma", "pcie", "tcp"]
LINK_KINDS = ("nvlink", "rdma", "pcie", "tcp")


@dataclass(frozen=True)
class Link:
    """One link class. GBps: per GPU, per direction (1e9 bytes/s); latency_us: one way."""

    kind: LinkKind
    GBps: float
    latency_us: float
    source: str = "spec"

    def __post_init__(self):
        if self.kind not in LINK_KINDS:
            raise ValueError(f"link kind ({self.kind!r}) must be one of {LINK_KINDS}")
        if not self.GBps > 0:
            raise ValueError(f"{self.kind} bandwidth ({self.GBps} GB/s) must be > 0")
        if not self.latency_us >= 0:
            raise ValueError(f"{self.kind} latency ({self.latency_us} us) must be >= 0")


def _spec(nvlink, rdma, pcie, src):
    return {"nvlink": Link("nvlink", nvlink, 1.0, src), "rdma": Link("rdma", rdma, 3.0, src),
            "pcie": Link("pcie", pcie, 1.5, src)}


# Per-direction nominal figures from the vendors' data sheets. NVLink: the SXM module's total
# (bidirectional) NVLink bandwidth / 2. RDMA: one ConnectX-7 400 Gb/s NIC per GPU (the HGX
# reference design and DeepEP's H800 test bed). Latencies: order-of-magnitude spec figures
# (NVSwitch hop ~1 us, IB RDMA write ~3 us end to end incl. PCIe); the cost model's per-call
# constants come from the profile, these only add a hop per message round.
LINK_SPECS: dict[str, dict[str, Link]] = {
    # H100 SXM5 data sheet: NVLink 900 GB/s, PCIe Gen5 128 GB/s (bidirectional).
    "h100": _spec(450.0, 50.0, 64.0, "spec: NVIDIA H100 SXM data sheet; CX7 400 Gb/s"),
    # H800 SXM5: NVLink 400 GB/s bidirectional (8 links); DeepEP README: "~160 GB/s" usable.
    "h800": _spec(200.0, 50.0, 64.0, "spec: NVIDIA H800 SXM (NVLink 400 GB/s); CX7 400 Gb/s"),
    # H200 SXM data sheet: NVLink 900 GB/s; measured here: NV18, copy engine 386-392 GB/s.
    "h200": _spec(450.0, 50.0, 64.0, "spec: NVIDIA H200 SXM data sheet; CX7 400 Gb/s"),
    # HGX B200: NVLink 5 1.8 TB/s bidirectional per GPU, PCIe Gen6 256 GB/s bidirectional.
    "b200": _spec(900.0, 50.0, 128.0, "spec: NVIDIA HGX B200 data sheet; CX7 400 Gb/s"),
    # GB200 NVL72: one NVLink domain of 72 GPUs, 1.8 TB/s bidirectional per GPU.
    "gb200": _spec(900.0, 50.0, 128.0, "spec: NVIDIA GB200 NVL72 data sheet; CX7 400 Gb/s"),
    # H20 (China-market Hopper): NVLink 900 GB/s bidirectional as the H100; CX7 400 Gb/s.
    "h20": _spec(450.0, 50.0, 64.0, "spec: NVIDIA H20 product brief; CX7 400 Gb/s"),
    # CPU ranks: gloo over loopback TCP; a placeholder until calibrate measures it.
    "cpu": {"tcp": Link("tcp", 2.0, 30.0, "spec: loopback TCP, order of magnitude"),
            "rdma": Link("rdma", 1.25, 50.0, "spec: 10 GbE between CPU nodes")},
}


def gpu_kind_of(device_name: str) -> str | None:
    """The GPU kind (a key of LINK_SPECS) a device name names as a whole word, e.g. "NVIDIA
    H20" -> h20, "NVIDIA H200" -> h200 (never h20), "NVIDIA GB200" -> gb200; None if none."""
    name = device_name.lower()
    for kind in sorted(LINK_SPECS, key=lambda k: (-len(k), k)):
        if kind != "cpu" and re.search(rf"(?<![a-z0-9]){kind}(?![0-9])", name):
            return kind
    return None


def local_cores() -> int:
    """Cores this process may run on (its affinity mask; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_SHAPE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*$")


@dataclass(frozen=True)
class Topology:
    """num_nodes x gpus_per_node ranks of one GPU kind.

    links        link class -> Link (intra-node class: `intra`, inter-node: "rdma")
    intra        the class joining GPUs of one node: nvlink, pcie or tcp
    node_of_rank node index of each rank (node-major by default)
    cores_per_node  CPU ranks: the cores the node's ranks share (0: a device per rank, or
                 not known); more ranks than cores time-slice them (`oversubscription`)
    """

    num_nodes: int
    gpus_per_node: int
    gpu: str = "h200"
    intra: LinkKind = "nvlink"
    links: Mapping[str, Link] = field(default_factory=dict)
    node_of_rank: tuple[int, ...] = ()
    cores_per_node: int = 0

    def __post_init__(self):
        for f in ("num_nodes", "gpus_per_node"):
            v = getattr(self, f)
            if not is_int(v) or v < 1:
                raise ValueError(f"topology {f} ({v!r}) must be a positive int")
        c = self.cores_per_node
        if not is_int(c) or c < 0:
            raise ValueError(f"topology cores_per_node ({c!r}) must be an int >= 0 (0: a "
                             f"device per rank)")
        gpu = self.gpu.lower()
        object.__setattr__(self, "gpu", gpu)
        base = dict(LINK_SPECS.get(gpu, {}))
        base.update(self.links)
        object.__setattr__(self, "links", base)
        if self.intra not in ("nvlink", "pcie", "tcp"):
            raise ValueError(f"intra-node link ({self.intra!r}) must be nvlink, pcie or tcp")
        need = [self.intra] + (["rdma"] if self.num_nodes > 1 else [])
        for k in need:
            if k not in base:
                raise ValueError(f"topology of GPU kind {gpu!r} has no {k} link figures: pass "
                                 f"links={{'{k}': Link(...)}} or a GPU kind in "
                                 f"{sorted(LINK_SPECS)}")
        if not self.node_of_rank:
            object.__setattr__(self, "node_of_rank",
                               tuple(r // self.gpus_per_node for r in range(self.world)))
        nodes = self.node_of_rank
        if len(nodes) != self.world:
            raise ValueError(f"node_of_rank has {len(nodes)} entries but the topology has "
                             f"{self.world} ranks ({self.num_nodes}x{self.gpus_per_node})")
        for n in range(self.num_nodes):
            c = nodes.count(n)
            if c != self.gpus_per_node:
                raise ValueError(f"node {n} holds {c} ranks but every node must hold "
                                 f"gpus_per_node={self.gpus_per_node}")

    # ----------------------------------------------------------------- constructors
    @classmethod
    def parse(cls, text: str, gpu: str = "h200", **kw) -> "Topology":
        """"NxG" (nodes x GPUs per node), e.g. "2x8"; a bare "G" means one node."""
        s = str(text).strip()
        m = _SHAPE.match(s)
        if m is None and s.isdigit():
            m = _SHAPE.match(f"1x{s}")
        if m is None:
            raise ValueError(f"topology {text!r} is not NODESxGPUS (e.g. '2x8' = 2 nodes of 8 "
                             f"GPUs) or a GPU count")
        intra = kw.pop("intra", "tcp" if gpu.lower() == "cpu" else "nvlink")
        return cls(int(m.group(1)), int(m.group(2)), gpu, intra, **kw)

    @classmethod
    def from_node_ids(cls, node_ids: Sequence, gpu: str = "h200", **kw) -> "Topology":
        """One node id per rank (any hashable: Ray node ids, host names); every node must hold
        the same number of ranks. Node indices follow first appearance."""
        ids = list(node_ids)
        if not ids:
            raise ValueError("node_ids is empty: give one node id per rank")
        order: dict = {}
        for n in ids:
            order.setdefault(n, len(order))
        counts = {n: ids.count(n) for n in order}
        if len(set(counts.values())) != 1:
            raise ValueError(f"ranks per node differ ({counts}); the planner needs the same GPU "
                             f"count on every node: launch an equal number of ranks per node")
        intra = kw.pop("intra", "tcp" if gpu.lower() == "cpu" else "nvlink")
        return cls(len(order), len(ids) // len(order), gpu, intra,
                   node_of_rank=tuple(order[n] for n in ids), **kw)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Topology":
        known = {"num_nodes", "gpus_per_node", "gpu", "intra", "links", "node_of_rank",
                 "cores_per_node"}
        if not isinstance(d, Mapping):
            raise ValueError(f"a topology is an object with {sorted(known)}, got "
                             f"{type(d).__name__}")
        extra = set(d) - known
        if extra:
            raise ValueError(f"topology has unknown keys {sorted(extra)}; allowed: "
                             f"{sorted(known)}")
        for k in ("num_nodes", "gpus_per_node"):
            if k not in d:
                raise ValueError(f"topology needs {k!r} (e.g. {{'num_nodes': 2, "
                                 f"'gpus_per_node': 8, 'gpu': 'h200'}})")
        links = {}
        for k, v in dict(d.get("links", {})).items():
            if not isinstance(v, Mapping) or "GBps" not in v:
                raise ValueError(f"topology link {k!r} must be an object with 'GBps' and "
                                 f"'latency_us', got {v!r}")
            nums = [v["GBps"], v.get("latency_us", 0.0)]
            if not all(map(is_number, nums)):
                raise ValueError(f"topology link {k!r}: GBps and latency_us must be numbers, "
                                 f"got {nums}")
            links[k] = Link(k, float(nums[0]), float(nums[1]), str(v.get("source", "given")))
        gpu = str(d.get("gpu", "h200"))
        ranks = tuple(d.get("node_of_rank", ()))
        if not all(map(is_int, ranks)):
            raise ValueError(f"topology node_of_rank ({list(ranks)}) must be node indices")
        # the counts as given: __post_init__ refuses what is not a positive int (1.5, true)
        return cls(d["num_nodes"], d["gpus_per_node"], gpu,
                   d.get("intra", "tcp" if gpu.lower() == "cpu" else "nvlink"), links, ranks,
                   d.get("cores_per_node", 0))

    @classmethod
    def from_json(cls, path) -> "Topology":
        return cls.from_dict(read_doc(path, "topology file"))

    @classmethod
    def resolve(cls, spec, gpu: str = "h200") -> "Topology":
        """A Topology, a dict, "NxG", or a path to a JSON file."""
        if isinstance(spec, Topology):
            return spec
        if isinstance(spec, Mapping):
            return cls.from_dict({"gpu": gpu, **spec})
        s = str(spec)
        if s.endswith(".json") or Path(s).is_file():
            return cls.from_json(s)
        return cls.parse(s, gpu)

    def to_dict(self) -> dict:
        return {"num_nodes": self.num_nodes, "gpus_per_node": self.gpus_per_node,
                "gpu": self.gpu, "intra": self.intra,
                "links": {k: {"GBps": v.GBps, "latency_us": v.latency_us, "source": v.source}
                          for k, v in self.links.items()},
                "node_of_rank": list(self.node_of_rank), "cores_per_node": self.cores_per_node}

    # ----------------------------------------------------------------- queries
    @property
    def world(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def link(self, kind: str) -> Link:
        if kind not in self.links:
            raise ValueError(f"topology has no {kind!r} link (has {sorted(self.links)})")
        return self.links[kind]

    @property
    def oversubscription(self) -> float:
        """Ranks per core of a node (>= 1): CPU ranks that outnumber the node's cores share
        them, and a layer takes this factor times as long (plan/timeslice.py: which stages show
        it); 1 for a device per rank."""
        return max(1.0, self.gpus_per_node / self.cores_per_node) if self.cores_per_node else 1.0

    @property
    def intra_link(self) -> Link:
        return self.links[self.intra]

    def with_link(self, kind: str, **changes) -> "Topology":
        """A copy with one link class changed (e.g. with_link('nvlink', GBps=900))."""
        links = dict(self.links)
        links[kind] = replace(self.link(kind), **changes)
        return replace(self, links=links)

    def describe(self) -> str:
        s = f"{self.num_nodes}x{self.gpus_per_node} {self.gpu}"
        s += f" ({self.intra} {self.intra_link.GBps:g} GB/s"
        if self.num_nodes > 1:
            s += f", rdma {self.links['rdma'].GBps:g} GB/s"
        if self.cores_per_node:
            s += f", {self.cores_per_node} cores/node"
        return s + ")"
