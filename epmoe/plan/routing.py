"""Routing as the cost model sees it: how many ranks and nodes a token fans out to, and how
the (token, expert) pairs spread over ranks (the hottest rank sets the pace).

`RoutingSpec`: `uniform`, `zipf:S` (the expert of popularity rank r is picked with weight
r**-S over a seeded permutation, as `epmoe.eplb.routing`), or a recorded per-expert load vector
(`RoutingSpec.from_load(load_E)`, e.g. one layer of EPLB's `load_LE`).
`SlotMap`: which logical expert each physical slot holds (one layer; slot s lives on rank
s // (slots / ranks)), from any object with `phy2log` (EPLB's `Placement`, a list per layer):
the minimal protocol this module depends on. Replicas split their expert's load evenly (the
runtime's ReplicaMap picks a replica by token index, round robin).

`routing_stats(cfg, spec, world, gpus_per_node, slots)`:
- uniform routing, no group limit: closed form. A rank holding E/G of E experts is hit by a
  token's top-k with probability 1 - C(E - E/G, k) / C(E, k) (DeepEP V2 sizes SMs with it);
- otherwise Monte Carlo with a fixed seed: Gumbel-top-k on log popularity (the law of sampling
  k experts without replacement by weight), DeepSeek group limiting (a group scores the sum of
  its top-2 perturbed experts; the topk_group best groups are kept), replicas picked uniformly.
Per-rank pair loads use exact marginals where known (uniform, recorded loads) and the Monte
Carlo frequencies otherwise. The draws depend on the routing alone, not on the ranks or the
slots: a caller that prices one routing on many placements (a sweep) passes one `draws` dict
to every call and the experts are drawn once (the results are the same as without it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from epmoe.config import MoEConfig

MC_TOKENS = 8192
MC_SEED = 12345


@dataclass(frozen=True)
class RoutingSpec:
    """kind: uniform | zipf | load. s: Zipf exponent. load: per logical expert (any scale)."""

    kind: str = "uniform"
    s: float = 0.0
    load: tuple[float, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("uniform", "zipf", "load"):
            raise ValueError(f"routing kind ({self.kind!r}) must be uniform, zipf or load")
        if self.kind == "zipf" and not self.s >= 0:
            raise ValueError(f"zipf exponent ({self.s}) must be >= 0")
        if self.kind == "load":
            if not self.load or min(self.load) < 0 or sum(self.load) <= 0:
                raise ValueError("a load routing needs a non-negative per-expert load vector "
                                 "with a positive sum")

    @classmethod
    def parse(cls, spec) -> "RoutingSpec":
        """"uniform", "zipf:S", a RoutingSpec, or a sequence of per-expert loads."""
        if isinstance(spec, RoutingSpec):
            return spec
        if not isinstance(spec, str):
            return cls.from_load(spec)
        kind, _, rest = spec.partition(":")
        if kind == "uniform" and not rest:
            return cls()
        if kind == "zipf":
            try:
                return cls("zipf", float(rest))
            except ValueError:
                pass
        raise ValueError(f"routing {spec!r} is not understood: use uniform, zipf:S (S >= 0) "
                         f"or a per-expert load vector")

    @classmethod
    def from_load(cls, load_E: Sequence[float]) -> "RoutingSpec":
        return cls("load", load=tuple(float(x) for x in np.asarray(load_E, dtype=float).ravel()))

    def label(self) -> str:
        return {"uniform": "uniform", "zipf": f"zipf:{self.s:g}", "load": "recorded"}[self.kind]

    def popularity(self, num_experts: int) -> np.ndarray:
        if self.kind == "uniform":
            return np.ones(num_experts)
        if self.kind == "load":
            if len(self.load) != num_experts:
                raise ValueError(f"load vector has {len(self.load)} entries but the model has "
                                 f"{num_experts} experts")
            return np.asarray(self.load, dtype=float)
        perm = np.random.default_rng(self.seed).permutation(num_experts)
        pop = np.empty(num_experts)
        pop[perm] = np.arange(1, num_experts + 1, dtype=float) ** -self.s
        return pop


@dataclass(frozen=True)
class SlotMap:
    """phy2log[s]: the logical expert held by physical slot s (one layer)."""

    phy2log: tuple[int, ...]

    @classmethod
    def identity(cls, num_experts: int) -> "SlotMap":
        return cls(tuple(range(num_experts)))

    @classmethod
    def from_placement(cls, placement, layer: int = 0) -> "SlotMap":
        """Anything with `phy2log` [layers][slots] (EPLB's Placement, a runtime's list) or a
        flat list of slots."""
        p = getattr(placement, "phy2log", placement)
        rows = np.asarray(p if not hasattr(p, "numpy") else p.numpy())
        row = rows[layer] if rows.ndim == 2 else rows
        return cls(tuple(int(x) for x in row))

    @property
    def num_slots(self) -> int:
        return len(self.phy2log)

    def counts(self, num_experts: int) -> np.ndarray:
        c = np.bincount(np.asarray(self.phy2log), minlength=num_experts)
        if len(c) != num_experts or c.min() < 1:
            raise ValueError(f"placement must hold every one of {num_experts} experts at least "
                             f"once (slots hold ids {sorted(set(self.phy2log))[:8]}...)")
        return c


@dataclass(frozen=True)
class RoutingStats:
    """Per token: expected distinct ranks / nodes, hit probability of each rank / node, and
    expected (token, expert) pairs on each rank / slot (pairs sum to top_k)."""

    ranks_per_token: float
    nodes_per_token: float
    hit_rank: tuple[float, ...]
    hit_node: tuple[float, ...]
    pairs_rank: tuple[float, ...]
    pairs_slot: tuple[float, ...]
    method: str

    @property
    def hot_rank(self) -> int:
        return int(np.argmax(self.pairs_rank))

    @property
    def imbalance(self) -> float:
        """max / mean pairs per rank (1.0 = balanced)."""
        return max(self.pairs_rank) / (sum(self.pairs_rank) / len(self.pairs_rank))

    def slots_of(self, rank: int) -> tuple[float, ...]:
        per = len(self.pairs_slot) // len(self.pairs_rank)
        return self.pairs_slot[rank * per:(rank + 1) * per]


def hit_probability_uniform(num_experts: int, held: int, top_k: int) -> float:
    """P(a token's top-k, uniform without replacement over num_experts, includes one of `held`
    experts) = 1 - C(E - held, k) / C(E, k)."""
    if held >= num_experts:
        return 1.0
    return 1.0 - math.comb(num_experts - held, top_k) / math.comb(num_experts, top_k)


def routing_stats(cfg: MoEConfig, spec: RoutingSpec, world: int, gpus_per_node: int,
                  slots: SlotMap | None = None, mc_tokens: int = MC_TOKENS,
                  draws: dict | None = None) -> RoutingStats:
    """draws: the caller's store of Monte Carlo draws, shared by calls on one routing (None:
    drawn here)."""
    e, k = cfg.num_experts, cfg.top_k
    slots = slots or SlotMap.identity(e)
    r = slots.num_slots
    if r % world:
        raise ValueError(f"physical slots ({r}) must be divisible by ranks ({world}); add or "
                         f"remove redundant experts")
    if world % gpus_per_node:
        raise ValueError(f"ranks ({world}) must be a multiple of gpus_per_node ({gpus_per_node})")
    cnt = slots.counts(e)
    grouped = cfg.n_group > 1 and cfg.topk_group < cfg.n_group
    identity = slots.phy2log == tuple(range(e))
    if spec.kind == "uniform" and not grouped and identity:
        return _uniform_closed(e, k, world, world // gpus_per_node)
    pop = spec.popularity(e)
    rng = np.random.default_rng(MC_SEED + spec.seed)
    groups = cfg.n_group if grouped else 1
    key = (pop.tobytes(), k, groups, cfg.topk_group, mc_tokens, spec.seed)
    if draws is not None and key in draws:  # the experts drawn, and the generator after them
        ids, rng.bit_generator.state = draws[key]
    else:
        ids = _sample_topk(pop, k, groups, cfg.topk_group, mc_tokens, rng)
        if draws is not None:
            draws[key] = ids, rng.bit_generator.state
    # replica of each pick: uniform over the expert's slots
    order = np.argsort(np.asarray(slots.phy2log), kind="stable")
    start = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    pick = rng.integers(0, 1 << 30, size=ids.shape) % cnt[ids]
    slot = order[start[ids] + pick]
    rank = slot // (r // world)
    node = rank // gpus_per_node
    n_nodes = world // gpus_per_node
    hit_r = _hits(rank, world)
    hit_n = _hits(node, n_nodes)
    if spec.kind == "uniform" and not grouped:
        q = np.full(e, k / e)
    elif spec.kind == "load":
        q = k * pop / pop.sum()
    else:
        q = np.bincount(ids.ravel(), minlength=e) / mc_tokens
    q_slot = q[np.asarray(slots.phy2log)] / cnt[np.asarray(slots.phy2log)]
    pairs_r = q_slot.reshape(world, -1).sum(1)
    return RoutingStats(float(hit_r.sum()), float(hit_n.sum()), tuple(hit_r), tuple(hit_n),
                        tuple(pairs_r), tuple(q_slot),
                        f"monte carlo ({mc_tokens} tokens, seed {MC_SEED + spec.seed})")


def _uniform_closed(e: int, k: int, world: int, n_nodes: int) -> RoutingStats:
    h = hit_probability_uniform(e, e // world, k)
    hn = hit_probability_uniform(e, e // n_nodes, k)
    return RoutingStats(world * h, n_nodes * hn, (h,) * world, (hn,) * n_nodes,
                        (k / world,) * world, (k / e,) * e, "closed form")


def _hits(unit_TK: np.ndarray, n_units: int) -> np.ndarray:
    """P(token hits unit u) for each u, from [T, K] unit ids."""
    t = unit_TK.shape[0]
    hit = np.zeros((t, n_units), dtype=bool)
    hit[np.arange(t)[:, None], unit_TK] = True
    return hit.mean(0)


def _sample_topk(pop: np.ndarray, k: int, n_group: int, topk_group: int, n: int,
                 rng: np.random.Generator) -> np.ndarray:
    """[n, k] expert ids: the k smallest of Exp(1) / popularity (= Gumbel-top-k on log
    popularity: sampling without replacement by weight), group-limited when n_group > 1 (a
    group's score is the sum of its two best log-scores, i.e. the product of its two
    smallest keys)."""
    e = pop.shape[0]
    with np.errstate(divide="ignore", invalid="ignore"):  # an Exp(1) draw of 0 x 1 / 0
        inv = (1.0 / pop).astype(np.float32)
        key = rng.standard_exponential(size=(n, e), dtype=np.float32) * inv[None, :]
    key[:, ~(pop > 0)] = np.inf  # never picked ahead of a loaded expert
    if n_group > 1:
        g = key.reshape(n, n_group, e // n_group)
        two = np.partition(g, min(1, g.shape[2] - 1), axis=2)[:, :, :2]
        gscore = two.prod(axis=2) if two.shape[2] == 2 else two[:, :, 0]
        keep = np.argpartition(gscore, topk_group - 1, axis=1)[:, :topk_group]
        drop = np.ones((n, n_group), dtype=bool)
        drop[np.arange(n)[:, None], keep] = False
        g[drop] = np.inf
    return np.argpartition(key, k - 1, axis=1)[:, :k]


def finite_max(mean: float, var: float, n: int) -> float:
    """Expected maximum of n draws around `mean` with variance `var` (normal approximation,
    E[max] ~ mean + sigma * sqrt(2 ln n)): the hottest of n equally loaded ranks in one step."""
    if n <= 1 or var <= 0:
        return mean
    return mean + math.sqrt(var) * math.sqrt(2.0 * math.log(n))
