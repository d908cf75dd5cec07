"""Time and bytes of dispatch, combine and the collectives, per comm backend.

Mechanisms (each a term below, each constant from the profile, which says where it came from):
- link classes: bytes are split into NVLink (same node) and RDMA (other nodes); a transfer
  takes max over classes of (alpha + bytes / bandwidth) (the classes run concurrently);
- fan-out: HT backends send a token once per destination rank (dedup) or, across nodes,
  once per destination node and forward over NVLink (DeepEP's two hops); LL backends send
  once per (token, expert); NCCL all_to_all sends once per destination rank, directly; the
  combine comes back per (token, expert) from deepep-ll, per (token, rank) from the others
  (`PRE_REDUCED`: the expert rank sums a token's rows first);
- the hottest rank: the receiving side uses the most loaded rank (population skew from the
  routing statistics plus the finite-batch maximum over ranks), the sending side the mean;
- fixed per-call latency: alpha per transfer and per collective call (symm: plus a cost per
  peer, its flags), the count exchange (plus a host sync where the backend waits for counts
  on the host), op launches;
- SMs given to comm: an SM-driven transfer also takes the rows its SMs move (every row the
  rank sends or receives, its own rows included: they are copied by the same SMs) over SMs x
  the per-SM rate; across nodes DeepEP's warps work by role (`internode`: one row per
  (token, node) for some, one per (token, rank) for others), and the slowest role bounds;
  the transfer takes the longer of that and its slowest link class.
- DeepEP V2's normal kernels (`deepep-v2`, modelled, not run: epmoe runs V1): V2 computes
  its SM and QP counts to saturate the links (its README: "analytical SM & QP count
  calculation"), so they take V1's link fits (alpha, the SM-driven NVLink efficiency, the
  RDMA line rate, the two-hop fan-out) without the SM term.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from epmoe.config import MoEConfig, QuantConfig
from epmoe.eplb.decision import NVLINK_GBPS, MigrationLinks
from epmoe.plan import internode
from epmoe.plan.figures import HOST_PREFIX
from epmoe.plan.profile import HardwareProfile
from epmoe.plan.routing import RoutingStats, finite_max
from epmoe.plan.topology import Topology
from epmoe.plan.traffic import (LL_HEADER_BYTES, act_row_bytes, local_combine_bytes,
                                local_dispatch_bytes, quantize_bytes)

HT = ("deepep-ht", "symm-ht")
LL = ("deepep-ll", "symm-ll")
MODELLED_ONLY = ("deepep-v2",)  # predicted (epmoe.sim), never planned: epmoe does not run it
HT_KERNELS = HT + MODELLED_ONLY
FITS_OF = {"deepep-v2": "deepep-ht"}  # a modelled-only backend: whose profile fits it takes
# Combines whose expert rank reduces a token's rows first and sends one row per (token, rank)
# back (the others send one per (token, expert)).
PRE_REDUCED = HT_KERNELS + ("symm-ll",)
NCCL = ("all2all", "allgather")
BACKENDS = ("local", "allgather", "all2all", "deepep-ht", "deepep-ll", "symm-ht", "symm-ll")
# Host syncs per call: DeepEP HT waits on the host for the received counts (notify_dispatch);
# all2all's split sizes go to the host (.tolist()); allgather reads the max row count.
HOST_SYNCS = {"deepep-ht": 1, "deepep-v2": 1, "all2all": 1, "allgather": 1}
# Torch ops launched around the transfers (counted in epmoe/comm/*.py and layer.py).
DISPATCH_OPS = {"local": 7, "allgather": 12, "all2all": 20, "deepep-ht": 6, "deepep-ll": 3,
                "symm-ht": 3, "symm-ll": 3, "deepep-v2": 6}
COMBINE_OPS = {"local": 2, "allgather": 4, "all2all": 6, "deepep-ht": 2, "deepep-ll": 2,
               "symm-ht": 2, "symm-ll": 2, "deepep-v2": 2}
# NCCL data calls per dispatch: rows, ids, weights (+ scales for quantized recipes); the
# count/size exchange before them is one more call plus a host sync (_count_us).
NCCL_CALLS = {"all2all": 3, "allgather": 3}
NCCL_COUNT_CALL = {"all2all": "all_to_all", "allgather": "all_gather"}
META_BYTES_PER_K = 8  # int32 expert id + fp32 weight per top-k slot travel with each row


@dataclass(frozen=True)
class CommCase:
    """Everything a comm estimate reads. tokens: this rank's T; max_tokens: the LL buffers'
    capacity per rank; sms: SMs given to SM-driven comm (None: the backend's default)."""

    cfg: MoEConfig
    quant: QuantConfig
    topo: Topology
    prof: HardwareProfile
    stats: RoutingStats
    tokens: int
    max_tokens: int
    sms: int | None = None
    reuse_layout: bool = False
    experts: str = ""  # the experts backend (its quantizer's scale layout): a fit per backend
    ll_nvlink: bool = True  # DeepEP LL's allow_nvlink_for_low_latency_mode: off, every peer
    # (same node too) is reached over RDMA, as its kernels did before 2025-06


@dataclass(frozen=True)
class CommCost:
    """us: the stage as the runtime times it; quantize_us: its dispatch.quantize part;
    kernel_us: the data movement alone (alpha + bytes / bandwidth; what DeepEP's benchmarks
    time); link_bytes: bytes this rank sends per link class."""

    us: float
    quantize_us: float = 0.0
    link_bytes: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)
    kernel_us: float = 0.0


def launch_us(prof: HardwareProfile, ops: int) -> float:
    return ops * prof.fig("launch_us")


def issue_us(prof: HardwareProfile, backend: str, direction: str) -> float:
    """The host's time to issue one call of `backend`: measured where the profile has it
    (kernels["comm"]["host.<backend>.<direction>"], epmoe.bench.symm_host: a Triton
    kernel's Python launcher costs many eager torch ops), else the torch ops it launches."""
    fit = prof.most_specific("comm", f"{HOST_PREFIX}{backend}.{direction}")
    if fit is not None:
        return fit.alpha_us
    return launch_us(prof, (DISPATCH_OPS if direction == "dispatch" else COMBINE_OPS)[backend])


def quantize_us(c: CommCase, n_tokens: float) -> float:
    """dispatch.quantize: the recipe's activation quantization of n tokens (0 for bf16): the
    experts backend's own fit for the recipe (its kernel and scale layout; on an idle GPU
    the shared MLP's kernels beside it), else the backend's, else the pooled one."""
    nbytes = quantize_bytes(n_tokens, c.cfg.hidden, c.quant)
    if nbytes == 0:
        return 0.0
    fit = c.prof.most_specific("comm", f"quantize.{c.experts}.{c.quant.recipe}",
                               f"quantize.{c.experts}", "quantize")
    if fit is None:
        raise KeyError(f"profile {c.prof.name!r} has no 'quantize' kernel fit for 'comm'")
    return fit.time_us(nbytes)


def _mean(x) -> float:
    return sum(x) / len(x)


def _classes(c: CommCase, per_token, two_hop: bool,
             nvlink: bool = True) -> dict[str, tuple[float, float]]:
    """class -> (rows sent by a mean rank, rows received by the hottest rank) per transfer.
    per_token: per-rank hit probability (dedup rows) or pairs (LL messages). nvlink False:
    direct only, every peer over RDMA (the NIC carries the same node's rows too)."""
    t, topo = c.tokens, c.topo
    g, nn, world = topo.gpus_per_node, topo.num_nodes, topo.world
    x_mean, hot = _mean(per_token), _hot_rows(c, per_token)
    if not nvlink:
        if two_hop:
            raise ValueError("a two-hop transfer forwards over NVLink: it cannot go without it")
        return {"rdma": ((world - 1) * t * x_mean, (world - 1) / world * hot)}
    out = {}
    if g > 1:
        if two_hop:  # every row for this node's GPUs crosses NVLink once (except 1/g)
            out[topo.intra] = ((g - 1) / g * world * t * x_mean, (g - 1) / g * hot)
        else:  # direct: only same-node sources use NVLink
            out[topo.intra] = ((g - 1) * t * x_mean, (g - 1) / world * hot)
    if nn > 1:
        if two_hop:  # node-dedup over the rail: one row per (token, destination node)
            hn = c.stats.hit_node
            hot_n = finite_max(nn * t * max(hn), nn * t * max(hn), nn)
            out["rdma"] = ((nn - 1) * t * _mean(hn), (nn - 1) / nn * hot_n)
        else:
            out["rdma"] = ((world - g) * t * x_mean, (nn - 1) / nn * hot)
    return out


def _hot_rows(c: CommCase, per_token) -> float:
    """Rows aimed at the hottest rank (its own included): population skew plus the
    finite-batch maximum over ranks."""
    n = c.topo.world * c.tokens * max(per_token)
    return finite_max(n, n, c.topo.world)


def _sm_rows(c: CommCase, per_token, direction: str, two_hop: bool = False) -> float:
    """Rows the SMs of the busiest rank move, at the per-SM rate: max(sent by a mean rank,
    received by the hottest), own rows included. Over two hops across nodes DeepEP's kernels
    split a channel's warps by role, some on one row per (token, node), some on one per
    (token, rank): the slowest role's rows over its share of the warps (`internode`)."""
    rows = max(c.tokens * sum(per_token), _hot_rows(c, per_token))
    if two_hop and c.topo.num_nodes > 1:
        node_rows = c.tokens * sum(c.stats.hit_node)
        rows = internode.sm_rows(direction, c.topo.num_nodes, rows, node_rows)
    return rows


def _sm_shape(backend: str, direction: str, c: CommCase) -> tuple[list, float, bool]:
    """An SM-driven backend's transfer: (rows per token and rank: dedup hits or (token,
    expert) pairs, bytes per row, whether it goes over two hops across nodes)."""
    d, k = c.cfg.hidden, c.cfg.top_k
    if direction == "dispatch":
        if backend in LL:  # quantized inside the kernel, one row per (token, expert)
            return c.stats.pairs_rank, act_row_bytes(d, c.quant) + LL_HEADER_BYTES, False
        return c.stats.hit_rank, act_row_bytes(d, c.quant) + k * META_BYTES_PER_K, True
    per = c.stats.hit_rank if backend in PRE_REDUCED else c.stats.pairs_rank
    return per, 2.0 * d, backend in HT_KERNELS  # bf16 rows back


def sm_bytes(backend: str, direction: str, c: CommCase) -> float:
    """Bytes the SMs of the busiest rank move in one call of an SM-driven backend (what a
    profile's per_sm_GBps is a rate over)."""
    per, row, _ = _sm_shape(backend, direction, c)
    return _sm_rows(c, per, direction) * row


def _link_fit(c: CommCase, backend: str, cls: str, direction: str):
    """The profile's fit of a backend on a link class; deepep-v2: V1's without the SM term."""
    f = c.prof.comm_fit(FITS_OF.get(backend, backend), cls, direction)
    return replace(f, per_sm_GBps=None, sms=None) if backend in MODELLED_ONLY else f


def _transfer(c: CommCase, backend: str, direction: str, rows: dict, row_bytes: float,
              sms: int | None, sm_rows: float = 0.0) -> tuple[float, dict, dict]:
    """max over link classes of alpha + max(link time, SM time): link time = max(sent,
    received hot) bytes / the class's bandwidth; SM time = sm_rows bytes / what the SMs copy
    (SM-driven fits only)."""
    worst, link_bytes, notes = 0.0, {}, {}
    for cls, (sent, recv) in rows.items():
        fit = _link_fit(c, backend, cls, direction)
        bw = fit.bandwidth_GBps(c.topo.link(cls).GBps)
        us = max(sent, recv) * row_bytes / (bw * 1e3)
        sm_bw = fit.sm_GBps(sms)
        if sm_bw is not None and sm_rows:
            notes[f"{direction}.sm_GBps"] = sm_bw
            notes[f"{direction}.sm_bytes"] = sm_rows * row_bytes
            us = max(us, sm_rows * row_bytes / (sm_bw * 1e3))
        worst = max(worst, fit.alpha_at(c.topo.world) + us)
        link_bytes[cls] = sent * row_bytes
        notes[f"{direction}.{cls}_GBps"] = bw
        notes[f"{direction}.{cls}_bytes"] = max(sent, recv) * row_bytes
    return worst, link_bytes, notes


def _sm_transfer(c: CommCase, backend: str, direction: str) -> tuple[float, dict, dict]:
    """An SM-driven backend's transfer (DeepEP's and ours): its rows per link class and the
    rows its SMs move (`_sm_shape`)."""
    per, row, two_hop = _sm_shape(backend, direction, c)
    nvlink = c.ll_nvlink or backend != "deepep-ll"
    return _transfer(c, backend, direction, _classes(c, per, two_hop, nvlink), row, c.sms,
                     _sm_rows(c, per, direction, two_hop))


def _count_us(c: CommCase, backend: str) -> float:
    """The count/layout exchange before the rows move (none when the layout is reused)."""
    if c.reuse_layout:
        return 0.0
    sync = HOST_SYNCS.get(backend, 0) * c.prof.fig("sync_us")
    if backend in NCCL_COUNT_CALL:
        return _nccl_alpha(c, NCCL_COUNT_CALL[backend]) + sync
    cls = "rdma" if c.topo.num_nodes > 1 else c.topo.intra
    return _link_fit(c, backend, cls, "dispatch").count_us + sync


def dispatch_cost(backend: str, c: CommCase) -> CommCost:
    d, k = c.cfg.hidden, c.cfg.top_k
    if backend == "local":  # quantize, then the id mapping (comm/local.py), one timed stage
        q = quantize_us(c, c.tokens)
        fit = c.prof.most_specific("local", f"dispatch.{c.quant.recipe}", "dispatch")
        if fit is not None:  # the recipe's own (bf16: with its empty quantize stage)
            rest = fit.time_us(local_dispatch_bytes(c.tokens, k))
        else:  # host-bound: the mapping's torch ops are issued after the quantize
            rest = launch_us(c.prof, DISPATCH_OPS["local"])
        return CommCost(q + rest, q)
    if backend in LL:
        if c.tokens > c.max_tokens:
            raise ValueError(f"tokens per rank ({c.tokens}) exceed the low-latency capacity "
                             f"({c.max_tokens})")
        us, lb, notes = _sm_transfer(c, backend, "dispatch")
        return CommCost(us + _count_us(c, backend) + issue_us(c.prof, backend, "dispatch"),
                        0.0, lb, notes, us)
    q = quantize_us(c, c.tokens)
    row = act_row_bytes(d, c.quant) + k * META_BYTES_PER_K
    if backend in HT_KERNELS:
        us, lb, notes = _sm_transfer(c, backend, "dispatch")
        total = q + _count_us(c, backend) + us + issue_us(c.prof, backend, "dispatch")
        return CommCost(total, q, lb, notes, us)
    if backend == "all2all":
        rows = _classes(c, c.stats.hit_rank, two_hop=False)
        us, lb, notes = _nccl_transfer(c, rows, row)
        calls = NCCL_CALLS["all2all"] + (1 if c.quant.recipe != "bf16" else 0)
        extra = _extra(c, "all2all", "dispatch")
        pack = 2 * c.tokens * c.stats.ranks_per_token * row / (c.prof.fig("hbm_GBps") * 1e3)
        total = (q + _count_us(c, backend) + us + (calls - 1) * _nccl_alpha(c, "all_to_all")
                 + pack + extra + launch_us(c.prof, DISPATCH_OPS["all2all"]))
        return CommCost(total, q, lb, notes, us)
    if backend == "allgather":
        us, lb = collective_us(c, "all_gather", c.tokens * row)
        calls = NCCL_CALLS["allgather"] + (1 if c.quant.recipe != "bf16" else 0)
        total = (q + _count_us(c, backend) + us + (calls - 1) * _nccl_alpha(c, "all_gather")
                 + _extra(c, "allgather", "dispatch")
                 + launch_us(c.prof, DISPATCH_OPS["allgather"]))
        return CommCost(total, q, lb, {}, us)
    raise ValueError(f"comm backend {backend!r} is not modelled; choose one of {BACKENDS}")


def combine_cost(backend: str, c: CommCase) -> CommCost:
    d = c.cfg.hidden
    hbm = c.prof.fig("hbm_GBps") * 1e3
    if backend == "local":  # cast the replicated output once (where the experts give fp32)
        nbytes = local_combine_bytes(c.tokens, d)
        fit = c.prof.most_specific("local", f"combine.{c.experts}", "combine")
        if fit is not None:
            return CommCost(fit.time_us(nbytes))
        return CommCost(max(nbytes / hbm, launch_us(c.prof, COMBINE_OPS["local"])))
    if backend in LL or backend in HT_KERNELS:
        us, lb, notes = _sm_transfer(c, backend, "combine")
        return CommCost(us + issue_us(c.prof, backend, "combine"), 0.0, lb, notes, us)
    if backend == "all2all":
        rows = _classes(c, c.stats.hit_rank, two_hop=False)
        us, lb, notes = _nccl_transfer(c, rows, 2.0 * d)
        sent = c.tokens * c.stats.ranks_per_token
        reduce = (sent * 2.0 * d + 2 * c.tokens * 4.0 * d) / hbm  # index_add in fp32
        total = us + reduce + _extra(c, "all2all", "combine") + launch_us(
            c.prof, COMBINE_OPS["all2all"])
        return CommCost(total, 0.0, lb, notes, us)
    if backend == "allgather":  # reduce-scatter of the fp32 partial sums of every token
        us, lb = collective_us(c, "reduce_scatter", c.tokens * 4.0 * d)
        return CommCost(us + _extra(c, "allgather", "combine")
                        + launch_us(c.prof, COMBINE_OPS["allgather"]), 0.0, lb, {}, us)
    raise ValueError(f"comm backend {backend!r} is not modelled; choose one of {BACKENDS}")


def _extra(c: CommCase, backend: str, direction: str) -> float:
    """Fixed cost the backend adds beyond its collectives (host-side indexing), if fitted."""
    cls = "rdma" if c.topo.num_nodes > 1 else c.topo.intra
    try:
        return c.prof.comm_fit(backend, cls, direction).alpha_us
    except KeyError:
        return 0.0


def _nccl_alpha(c: CommCase, kind: str) -> float:
    cls = "rdma" if c.topo.num_nodes > 1 else c.topo.intra
    return c.prof.collective(kind, cls).alpha_us


def _nccl_transfer(c: CommCase, rows: dict, row_bytes: float):
    worst, lb, notes = 0.0, {}, {}
    for cls, (sent, recv) in rows.items():
        fit = c.prof.collective("all_to_all", cls)
        bw = fit.bandwidth_GBps(c.topo.link(cls).GBps)
        worst = max(worst, fit.alpha_us + max(sent, recv) * row_bytes / (bw * 1e3))
        lb[cls] = sent * row_bytes
        notes[f"all_to_all.{cls}_GBps"] = bw
    return worst, lb, notes


def collective_us(c: CommCase, kind: str, nbytes: float) -> tuple[float, dict]:
    """One NCCL collective, hierarchical over rails: bytes per GPU on NVLink and on RDMA,
    each at the class's bus bandwidth, the slower class setting the time.
    all_gather / reduce_scatter: nbytes = one rank's share (its input / its output);
    all_reduce: nbytes = the whole buffer (reduce-scatter + all-gather of nbytes / ranks)."""
    topo = c.topo
    g, nn, world = topo.gpus_per_node, topo.num_nodes, topo.world
    if world == 1:
        return 0.0, {}
    share, rounds = (nbytes / world, 2) if kind == "all_reduce" else (nbytes, 1)
    per_class = {}
    if g > 1:
        per_class[topo.intra] = rounds * (g - 1) * nn * share
    if nn > 1:
        per_class["rdma"] = rounds * (nn - 1) * share
    worst = 0.0
    for cls, b in per_class.items():
        fit = c.prof.collective(kind, cls)
        worst = max(worst, fit.alpha_us + b / (fit.bandwidth_GBps(topo.link(cls).GBps) * 1e3))
    return worst, per_class


def migration_links(prof: HardwareProfile, topo: Topology) -> MigrationLinks:
    """The bandwidth EPLB's weight moves get (batched point-to-point sends, NCCL or gloo): the
    profile's all_to_all fit on each link class of the topology; a class without a fit takes
    the topology's spec figure for it (RDMA between CPU nodes, say)."""
    got, said = {}, []
    for key, cls in (("intra", topo.intra), ("inter", "rdma")):
        try:
            fit = prof.collective("all_to_all", cls)
        except KeyError:
            fit = None
        try:
            link = topo.link(cls).GBps
        except ValueError:  # no such class on this topology
            continue
        got[key] = fit.bandwidth_GBps(link) if fit is not None else link
        said.append(f"{cls} {got[key]:.3g} GB/s" + (" (all_to_all fit)" if fit is not None
                                                       else " (spec)"))
    intra = got.get("intra", NVLINK_GBPS)
    return MigrationLinks(intra, got.get("inter", intra),
                          f"profile {prof.name} on {topo.describe()}: {', '.join(said)}")
