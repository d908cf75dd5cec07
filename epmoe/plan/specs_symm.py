"""The h200 profile's symm-ht / symm-ll fits (epmoe.plan.specs): alpha and the per-SM rate
fitted to our kernels' loopback measurements, the per-peer cost to the 2 / 4 / 8-rank ones."""

from __future__ import annotations

from epmoe.config import QuantConfig
from epmoe.plan.profile import LinkFit, Provenance as P


# symm-ht / symm-ll in the loopback world (2 ranks' kernels on one H200, rank by rank: every
# row a local copy, so the time is the kernels' own cost without a link), at their default
# CTAs, DeepSeek-V3 shapes, uniform routing: (recipe, tokens/rank, dispatch us, combine us,
# us of the dispatch that is symm-ht's separate quantize kernel: the model's
# dispatch.quantize term, so left out of the fit; symm-ll quantizes inside its send).
SYMM_SRC = ("lent H200, BENCHMARKS.md section 7, fourth and seventh sessions (2026-12-02): "
            "python -m epmoe.bench.comm --only ht|ll --iters 20|30 --breakdown --check, "
            "loopback 2 ranks, device time (symm-ht: the dispatch's roles as two launches, "
            "the combine's reduce and push in one kernel)")
SYMM_LOOPBACK = {  # backend: (CTAs the send halves take, points)
    "symm-ht": (24, [("bf16", 512, 65.0, 56.3, 0), ("bf16", 4096, 285.5, 286.3, 0),
                     ("bf16", 8192, 518.3, 510.9, 0), ("fp8_block", 512, 59.7, 57.1, 6.1),
                     ("fp8_block", 4096, 222.2, 272.1, 26.4),
                     ("fp8_block", 8192, 417.1, 512.8, 49.8)]),
    "symm-ll": (132, [("bf16", 1, 9.9, 14.9, 0), ("bf16", 8, 10.6, 16.2, 0),
                      ("bf16", 32, 11.2, 16.9, 0), ("bf16", 128, 13.6, 21.4, 0),
                      ("bf16", 256, 18.9, 29.1, 0), ("fp8_block", 1, 13.1, 14.9, 0),
                      ("fp8_block", 8, 13.0, 15.5, 0), ("fp8_block", 32, 13.6, 16.5, 0),
                      ("fp8_block", 128, 15.1, 20.7, 0), ("fp8_block", 256, 21.0, 28.9, 0)]),
}


# symm-ll at 1 token per rank in the loopback world of 2, 4 and 8 ranks (rows too few to
# matter, so what grows is the fixed cost per peer): {direction: {recipe: [us at 2, 4, 8
# ranks]}}. Since the vector publishes and acquires (BENCHMARKS 24) nothing grows: the
# slope is <= 0. Measured on a lent H100 (no H200 was lent); the tree before that change, in
# the same call, gave section 21's H200 figures within 1.6 us (the kernels' fixed cost is
# latency, not HBM).
SYMM_PEERS_SRC = ("lent H100, BENCHMARKS.md section 25 (2026-12-05): python -m "
                  "epmoe.bench.comm --world 2|4|8 --only ll --ll-tokens 1,128, loopback, mean "
                  "of two runs")
SYMM_PEERS = {"dispatch": {"fp8_block": [12.65, 11.9, 11.72], "bf16": [10.08, 9.71, 9.44]},
              "combine": {"fp8_block": [14.92, 13.9, 14.07], "bf16": [15.4, 14.54, 14.41]}}
PEER_WORLDS = (2, 4, 8)


def peer_us(direction: str) -> float:
    """The per-peer slope of symm-ll's fixed cost: least squares over the worlds, each recipe
    its own intercept; 0 where the cost does not grow (a slope <= 0)."""
    xs = [w - 2 for w in PEER_WORLDS]
    mx = sum(xs) / len(xs)
    num = den = 0.0
    for ys in SYMM_PEERS[direction].values():
        my = sum(ys) / len(ys)
        num += sum((x - mx) * (y - my) for x, y in zip(xs, ys))
        den += sum((x - mx) ** 2 for x in xs)
    return max(0.0, num / den)


def fit_line(xs, ys) -> tuple[float, float]:
    """Least squares y = a + b x -> (a, b); a < 0 (no fixed cost visible): a = 0, b refitted
    through the origin."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    if a < 0:
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return a, b


def symm_comm(comm: dict) -> dict:
    """symm-ht / symm-ll: alpha (the fixed cost) and the per-SM rate fitted by least squares
    to the loopback sweep above, against the bytes the model says their SMs move
    (`comm_cost.sm_bytes`, both recipes together: symm-ll's fp8 send, which quantizes, costs
    more per byte than its bf16 one, so its dispatch fits within ~25%, not exactly); `sms` =
    the CTAs of the halves that write to peers (symm-ht 24 with every SM for its local
    receives, symm-ll every SM), so the rate is per such CTA. The link's efficiency is assumed
    DeepEP's (a 2-GPU run calibrates it)."""
    from epmoe.config import get_preset
    from epmoe.plan.comm_cost import CommCase, sm_bytes
    from epmoe.plan.routing import RoutingSpec, routing_stats
    from epmoe.plan.topology import Topology

    cfg = get_preset("deepseek-v3").replace(n_group=1, topk_group=1)
    topo = Topology.parse("1x2")
    stats = routing_stats(cfg, RoutingSpec(), 2, 2)
    out = {}
    for ours, (sms, points) in SYMM_LOOPBACK.items():
        theirs = comm["deepep-" + ours.split("-")[1]]["nvlink"]
        fits = {}
        for i, k in enumerate(("dispatch", "combine")):
            xs = [sm_bytes(ours, k, CommCase(cfg, QuantConfig(p[0]), topo, None, stats, p[1],
                                             p[1])) / (sms * 1e3) for p in points]
            ys = [p[2] - p[4] if k == "dispatch" else p[3] for p in points]
            alpha, inv = fit_line(xs, ys)
            f = theirs[k]
            peer = peer_us(k) if ours == "symm-ll" else 0.0
            flat = "" if peer else ", the slope over 2, 4, 8 ranks <= 0"
            per = (f"; + {peer:.2f} us per peer beyond one ({SYMM_PEERS_SRC}{flat})"
                   if ours == "symm-ll" else "; per-peer cost not measured (0)")
            prov = P("derived", f"{SYMM_SRC}: {ours} {k} at {len(points)} points (bf16, fp8) -> "
                                f"alpha {alpha:.1f} us, {1 / inv:.1f} GB/s per CTA ({sms} "
                                f"CTAs) over the rows the SMs move; link efficiency assumed "
                                f"DeepEP's{per}")
            fits[k] = LinkFit(alpha, f.beta_GBps, f.link_GBps, prov, 1 / inv, sms, 0.0, peer)
        out[ours] = {"nvlink": fits}
    return out
