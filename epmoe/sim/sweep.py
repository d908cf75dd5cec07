"""A scaling sweep: a file (JSON or TOML) -> rows of predicted step time, comm share and bytes.

    model = "deepseek-v3"            # preset, or a Hugging Face config.json (beside this file)
    quant = "fp8_block"              # default: the first of fp8_block, mxfp8, bf16 that fits
    gpus = ["h800", "h200", "b200"]  # shipped profiles (or profile JSON files)
    ep = [8, 16, 32, 64, 128, 256]   # ranks
    gpus_per_node = 8                # or a table per GPU: {gb200 = 72, default = 8}
    tokens = [128, 4096]             # per rank: the LL (decode) and HT (prefill) regimes
    routing = ["uniform", "zipf:1.0"]  # or a load vector, or a run's recorded load (FILE.json)
    redundant_per_rank = [0, 1]      # EPLB: extra slots per rank, placed by epmoe.eplb
    placed_for = "uniform"           # optional: the load those slots were placed for (a
                                     # routing entry; default each row's own routing)
    candidates = []                  # extra fixed "form/backend/experts" rows besides the pick
    scope = "model"                  # model: every mechanism; runtime: what epmoe runs today
    cores_per_node = 0               # cpu rows: cores a node's ranks share (0: this machine's)

Each point runs the planner's ranking for one layer (the MoE layers of a preset are alike;
a recorded file's layers each at their own load, sim/layers.py) and reports the pick; a step is
the stack's layers in sequence (with a measured profile's queued figures, the later layers as
they run behind the first: sim/layers.stack_layers_us). EPLB's replicas are placed for the
load a row is priced at (a placement that knows its load) unless `placed_for` names another
(a stale placement: last window's recorded load priced at this window's; a blind one: placed
for uniform, priced at a skew). A node holds
gpus_per_node GPUs, or the largest divisor of ep below it (GB200: one NVLink domain of 72).
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field

from epmoe.config import PRESETS, QuantConfig, default_scale_fmt, fitting_recipe, get_preset
from epmoe.docfile import is_int, read_doc
from epmoe.plan.cost import Candidate, Workload
from epmoe.plan.planner import candidates, rank_layer, rejections
from epmoe.plan.profile import load_profile
from epmoe.plan.recorded import is_recorded
from epmoe.plan.routing import SlotMap, routing_stats
from epmoe.plan.topology import Topology, local_cores
from epmoe.sim.layers import layer_pairs, stack_layers_us, stack_pick, stack_routing

KEYS = {"name", "model", "quant", "scale_fmt", "gpus", "ep", "gpus_per_node", "tokens",
        "routing", "redundant_per_rank", "placed_for", "candidates", "scope", "layers",
        "cores_per_node"}


@dataclass(frozen=True)
class Sweep:
    name: str = "sweep"
    model: str = "deepseek-v3"
    quant: str | None = None  # None: the first recipe whose groups tile the model (recipe())
    scale_fmt: str | None = None
    gpus: tuple = ("h800", "h200", "b200")
    ep: tuple = (8, 16, 32, 64, 128, 256)
    gpus_per_node: dict = field(default_factory=lambda: {"default": 8, "gb200": 72})
    tokens: tuple = (128, 4096)
    routing: tuple = ("uniform",)
    redundant_per_rank: tuple = (0,)
    placed_for: str | tuple | None = None  # a routing entry; None: each row's own routing
    candidates: tuple = ()
    scope: str = "model"
    layers: int | None = None
    cores_per_node: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> "Sweep":
        extra = set(d) - KEYS
        if extra:
            raise ValueError(f"sweep has unknown keys {sorted(extra)}; allowed: {sorted(KEYS)}")
        kw = dict(d)
        for k in ("gpus", "ep", "tokens", "routing", "redundant_per_rank", "candidates"):
            if k in kw:
                v = kw[k]
                kw[k] = tuple(v) if isinstance(v, (list, tuple)) else (v,)
        if isinstance(kw.get("placed_for"), list):  # a load vector
            kw["placed_for"] = tuple(kw["placed_for"])
        g = kw.get("gpus_per_node")
        if g is not None and not isinstance(g, dict):
            kw["gpus_per_node"] = {"default": g}
        s = cls(**kw)
        s.check()
        return s

    @classmethod
    def load(cls, path) -> "Sweep":
        """A relative config.json path as `model`, or a recorded routing file, is read beside
        the sweep file."""
        d = read_doc(path, "sweep file")
        here = os.path.dirname(os.path.abspath(path))

        def beside(name):
            if not isinstance(name, str) or os.path.isabs(name):
                return name
            full = os.path.join(here, name)
            return full if os.path.exists(full) else name

        if isinstance(d.get("model"), str) and d["model"] not in PRESETS:
            d = dict(d, model=beside(d.get("model")))
        r = d.get("routing")
        if isinstance(r, list):
            d = dict(d, routing=[_recorded_beside(x, beside) for x in r])
        if "placed_for" in d:
            d = dict(d, placed_for=_recorded_beside(d["placed_for"], beside))
        return cls.from_dict(d)

    def check(self) -> None:
        for key in ("name", "model"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(f"sweep {key} ({getattr(self, key)!r}) must be a string")
        if self.layers is not None and (not is_int(self.layers) or self.layers < 1):
            raise ValueError(f"sweep layers ({self.layers!r}) must be an int >= 1 (the MoE "
                             f"layers of the stack; default: the model's)")
        cfg = self.stack_cfg()  # (an unknown model fails here, before the rest)
        if not self.gpus or any(not isinstance(g, str) or not g for g in self.gpus):
            raise ValueError(f"sweep gpus ({list(self.gpus)}) must be profile names (h200, "
                             f"b200, ...), at least one")
        for key, low in (("ep", 1), ("tokens", 1), ("redundant_per_rank", 0)):
            v = getattr(self, key)
            if not v or any(not is_int(x) or x < low for x in v):
                raise ValueError(f"sweep {key} ({list(v)}) must be ints >= {low}, at least one")
        bad = {g: n for g, n in self.gpus_per_node.items() if not is_int(n) or n < 1}
        if bad:
            raise ValueError(f"sweep gpus_per_node ({bad}) must be ints >= 1 (an int, or a "
                             f"table of GPU name -> GPUs per node with an optional default)")
        for r in self.routing:
            stack_routing(r, cfg)
        if self.placed_for is not None:
            stack_routing(self.placed_for, cfg, "placed_for")
            if not any(self.redundant_per_rank):
                raise ValueError(f"sweep placed_for ({self.placed_for!r}) places EPLB's "
                                 f"replicas, and redundant_per_rank "
                                 f"({list(self.redundant_per_rank)}) adds none")
        for c in self.candidates:
            parse_candidate(c)
        if self.scope not in ("model", "runtime"):
            raise ValueError(f"sweep scope ({self.scope!r}) must be model or runtime")
        if not isinstance(self.cores_per_node, int) or self.cores_per_node < 0:
            raise ValueError(f"sweep cores_per_node ({self.cores_per_node!r}) must be an int "
                             f">= 0 (0: this machine's cores)")

    def stack_cfg(self):
        """The model with the sweep's MoE layer count."""
        base = get_preset(self.model)
        return base if self.layers is None else base.replace(num_moe_layers=self.layers)

    def recipe(self) -> tuple[str, str | None]:
        """The recipe the rows are planned with, and why it is not fp8_block when the file
        left it to the model (epmoe.config.fitting_recipe)."""
        return (self.quant, None) if self.quant else fitting_recipe(get_preset(self.model))

    def node_size(self, gpu: str, ep: int) -> int:
        cap = int(self.gpus_per_node.get(gpu, self.gpus_per_node.get("default", 8)))
        return max(d for d in range(1, min(cap, ep) + 1) if ep % d == 0)


def _recorded_beside(entry, beside):
    """A routing entry with a recorded file's path read beside the sweep file."""
    if isinstance(entry, str) and is_recorded(entry):
        return beside(entry.removeprefix("trace:"))
    return entry


def parse_candidate(text: str) -> Candidate:
    parts = str(text).split("/")
    if len(parts) != 3:
        raise ValueError(f"candidate {text!r} must be form/backend/experts, e.g. "
                         f"ep_dp/deepep-ll/deepgemm")
    return Candidate(*parts)


def _eplb_slots(cfg, spec, world: int, nodes: int, extra: int,
                draws: dict | None = None) -> SlotMap:
    """A placement of E + extra slots for the routing's expected per-expert load, by EPLB's
    public `rebalance(weight_LE, num_replicas, num_groups, num_nodes, num_gpus, mode)` in the
    default mode for the model and node count (any result
    with `phy2log` [layers][slots] works: the minimal protocol of epmoe.plan.routing)."""
    import torch

    from epmoe.eplb import choose_mode, rebalance

    q = routing_stats(cfg, spec, world, world // nodes, draws=draws).pairs_slot
    groups = cfg.n_group if cfg.num_experts % cfg.n_group == 0 else 1
    p = rebalance(torch.tensor([q], dtype=torch.float64), cfg.num_experts + extra, groups,
                  nodes, world, choose_mode(cfg.n_group, cfg.topk_group, nodes).mode)
    return SlotMap.from_placement(p, 0)


def run(sweep: Sweep, progress=None) -> list[dict]:
    """One row per (gpu, ep, tokens, routing, redundancy) and pick (plus fixed candidates).
    progress: called (points done, points in all) after each point (a long sweep says how
    far it is: epmoe.launch.console.Phases.counter)."""
    cfg = sweep.stack_cfg()
    routings = [stack_routing(r, cfg) for r in sweep.routing]
    placed_for = None if sweep.placed_for is None else \
        stack_routing(sweep.placed_for, cfg, "placed_for")
    rows, draws = [], {}  # the routings' Monte Carlo draws, made once for every placement
    done, total = 0, len(sweep.gpus) * len(sweep.ep) * len(sweep.routing) * \
        len(sweep.redundant_per_rank) * len(sweep.tokens)
    recipe = sweep.recipe()[0]
    for gpu in sweep.gpus:
        prof = load_profile(gpu)
        quant = QuantConfig(recipe, sweep.scale_fmt or default_scale_fmt(recipe,
                                                                         prof.fig("sm_arch")))
        for ep in sweep.ep:
            g = sweep.node_size(prof.gpu, ep)
            cores = {"cores_per_node": sweep.cores_per_node or local_cores()} \
                if prof.gpu == "cpu" else {}  # cpu: tcp within a node, ranks share its cores
            topo = Topology.parse(f"{ep // g}x{g}", gpu=prof.gpu, **cores)
            for routing in routings:
                for rpr in sweep.redundant_per_rank:
                    place = (placed_for or routing) if rpr else None
                    pairs, index = layer_pairs(routing, placed_for if rpr else None,
                                               cfg.num_moe_layers)
                    placed = [_placed(cfg, spec, ep, g, topo.num_nodes, rpr, to, draws)
                              for spec, to in pairs]
                    for tokens in sweep.tokens:
                        works = [Workload(cfg, quant, tokens, spec, slots)
                                 for (spec, _), (slots, _) in zip(pairs, placed, strict=True)]
                        point = dict(gpu=gpu, ep=ep, nodes=topo.num_nodes, tokens=tokens,
                                     routing=routing.label, redundant=rpr * ep,
                                     redundant_per_rank=rpr,
                                     placed_for=place.label if place else None)
                        for kind, cands in [("pick", candidates(ep))] + [
                                ("fixed", [parse_candidate(c)]) for c in sweep.candidates]:
                            # said, not dropped: e.g. it does not fit, or the experts do not
                            # split over the ranks
                            ranked = [rank_layer(w, topo, prof, cands, cfg.num_moe_layers,
                                                 sweep.scope, stats=st)
                                      for w, (_, st) in zip(works, placed, strict=True)]
                            preds = stack_pick(ranked, index)
                            if preds is None:
                                rejected = next((r.rejected for r in ranked if not r.preds),
                                                ranked[0].rejected)
                                rows.append(_infeasible(point, rejected, kind))
                                continue
                            each = [(p, works[i], placed[i][1])
                                    for p, i in zip(preds, index, strict=True)]
                            if len(each) == 1:  # one routing for every layer
                                each = each * cfg.num_moe_layers
                            rows.append(_row(point, kind, preds,
                                             stack_layers_us(each, topo, prof)))
                        done += 1
                        if progress is not None:
                            progress(done, total)
    return rows


def _placed(cfg, spec, ep: int, g: int, nodes: int, rpr: int, placed_for, draws: dict):
    """(slots placed for routing `placed_for`, the routing stats of `spec` on them) of a
    point; (None, None) when its experts do not split over the ranks (the candidates then say
    so, one by one: tp still runs)."""
    try:
        slots = _eplb_slots(cfg, placed_for, ep, nodes, rpr * ep, draws) if rpr else None
        return slots, routing_stats(cfg, spec, ep, g, slots, draws=draws)
    except ValueError:
        return None, None


def _row(point: dict, kind: str, preds: list, step_us: float) -> dict:
    """preds: the choice's prediction per distinct layer of the stack, one per layer
    (or one for every layer): per-layer figures are their means."""
    n = len(preds)

    def mean(f):
        return sum(f(p) for p in preds) / n

    stages = {k: mean(lambda p, k=k: p.stages_us.get(k, 0.0))
              for k in dict.fromkeys(k for p in preds for k in p.stages_us)}
    layer = mean(lambda p: p.total_us)
    return {**point, "kind": kind, "choice": preds[0].candidate.label, "layer_us": layer,
            "step_ms": step_us / 1e3, "comm_share": mean(lambda p: p.comm_us) / layer,
            "nvlink_MB": mean(lambda p: p.link_bytes.get("nvlink", 0.0)) / 1e6,
            "rdma_MB": mean(lambda p: p.link_bytes.get("rdma", 0.0)) / 1e6,
            "stages_us": {k: v for k, v in stages.items() if v},
            "imbalance": mean(lambda p: p.notes.get("imbalance", 1.0))}


def _infeasible(point: dict, rejected, kind: str = "pick") -> dict:
    """A point where no candidate is feasible (kind pick: each distinct reason), or a fixed
    candidate that is not: no time, the reason."""
    if kind == "pick":
        why = rejections(rejected, most=3) if rejected else "no candidate"
        reason = f"no feasible candidate ({len(rejected)} rejected: {why})"
    else:
        reason = f"fixed candidate {rejected[0][0]}: {rejected[0][1]}"
    return {**point, "kind": "infeasible", "choice": "-" if kind == "pick" else rejected[0][0],
            "layer_us": None, "step_ms": None, "comm_share": None, "nvlink_MB": None,
            "rdma_MB": None, "stages_us": {}, "imbalance": None, "reason": reason}


def table(rows: list[dict]) -> str:
    """80 columns: one line per row."""
    head = (f"{'gpu':<6}{'ep':>4} {'nod':>3} {'tok':>5} {'routing':<9}{'red':>3} "
            f"{'choice':<25}{'step ms':>8}{'comm':>5}{'rdma MB':>8}")
    out = [head, "-" * 80]
    for r in rows:  # (numbers too wide for their column push the line, never merge)
        lead = (f"{r['gpu'][:6]:<6}{r['ep']:>4} {r['nodes']:>3} {r['tokens']:>5} "
                f"{r['routing'][:9]:<9}{r['redundant']:>3} ")
        if r["kind"] == "infeasible":
            what = "infeasible: see below" if r["choice"] == "-" else "=" + r["choice"]
            out.append(f"{lead}{what[:25]:<25}{'-':>8}{'-':>5}{'-':>8}")
            continue
        ch = r["choice"] if r["kind"] == "pick" else "=" + r["choice"]
        out.append(f"{lead}{ch[:25]:<25}"
                   f"{r['step_ms']:>8.1f}{100 * r['comm_share']:>4.0f}%{r['rdma_MB']:>8.1f}")
    stale = sorted({(r["routing"], r["placed_for"]) for r in rows
                    if r.get("placed_for") not in (None, r["routing"])})
    for priced, placed in stale:
        out.append(textwrap.fill(f"{priced} rows with redundancy: EPLB's replicas placed for "
                                 f"{placed}", 80, subsequent_indent="  "))
    for r in rows:
        if r["kind"] == "infeasible":
            out.append(textwrap.fill(f"{r['gpu']} ep {r['ep']}, {r['tokens']} tokens: "
                                     f"{r['reason']}", 80, subsequent_indent="  "))
    return "\n".join(out)
