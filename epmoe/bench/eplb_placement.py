"""Replica placement, same mode against same mode: ours against DeepSeek EPLB's hierarchical
policy, and ours against DeepSeek's global policy; quality, traffic and speed.

    python -m epmoe.bench.eplb_placement [--json FILE]

One line per case and mode: balancedness (mean/max GPU load, averaged over layers) of ours and
of DeepSeek's same-mode placement, our max GPU load / DeepSeek's (mean and worst layer; never
above 1 by construction), the expected nodes a token reaches (DeepSeek-V3 routing: top 8 of 256
experts within 4 of 8 groups, sampled from the loads) and CPU time (median of `--reps` runs,
1 thread) with DeepSeek's (our vectorized reimplementation of its algorithm). The drift case
also times `rebalance_incremental` from the previous step's placement and counts moved slots.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from epmoe.argtypes import at_least
from epmoe.eplb import (MODES, deepseek_rebalance, make_routing, rebalance,
                        rebalance_incremental)
from epmoe.eplb.traffic import routing_from_loads, traffic_from_routing
from epmoe.outputs import dump_json, run_main, writable_file

NUM_LAYERS, NUM_EXPERTS, TOP_K, NUM_GROUPS, TOPK_GROUP = 61, 256, 8, 8, 4  # DeepSeek-V3-like
TOKEN_BYTES = 7168 * 3  # fp8 dispatch row + bf16 combine row
TOKENS_PER_GPU = 4096


def zipf_weight(L, E, s, seed, scale=1e5):
    g = torch.Generator().manual_seed(seed)
    pop = torch.arange(1, E + 1, dtype=torch.float64) ** -s
    return torch.poisson(torch.stack([pop[torch.randperm(E, generator=g)] for _ in range(L)])
                         * scale, generator=g)


def routed_weight(spec, step, num_tokens=4096, seed=0):
    ids = make_routing(spec, NUM_LAYERS, NUM_EXPERTS, TOP_K, num_tokens, step, seed)
    w = torch.zeros(NUM_LAYERS, NUM_EXPERTS, dtype=torch.float64)
    return w.scatter_add_(1, ids.flatten(1), torch.ones(ids.flatten(1).shape, dtype=w.dtype))


def median_ms(fn, reps):
    """Median milliseconds of `reps` calls: (wall, this thread's CPU time; the latter is the
    honest figure on a shared machine)."""
    fn()
    ts, cs = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        ts.append(time.perf_counter() - t)
        cs.append(time.thread_time() - c)
    return statistics.median(ts) * 1e3, statistics.median(cs) * 1e3


def run_case(name, w, num_replicas, num_nodes, num_gpus, mode, reps, old=None):
    args = (w, num_replicas, NUM_GROUPS, num_nodes, num_gpus, mode)
    ours, ds = rebalance(*args), deepseek_rebalance(*args)
    (_, c_ours), (_, c_ds) = median_ms(lambda: rebalance(*args), reps), \
        median_ms(lambda: deepseek_rebalance(*args), reps)
    ratio = ours.max_load(w) / ds.max_load(w)
    ids = routing_from_loads(w, TOP_K, NUM_GROUPS, TOPK_GROUP, num_tokens=512, seed=1)
    kw = dict(token_bytes=TOKEN_BYTES, tokens_per_step=TOKENS_PER_GPU * num_gpus)
    t_ours, t_ds = (traffic_from_routing(p, ids, num_nodes, **kw).summary() for p in (ours, ds))
    row = dict(case=name, mode=mode, layers=w.shape[0], experts=w.shape[1],
               replicas=num_replicas, gpus=num_gpus, nodes=num_nodes,
               bal_ours=ours.balancedness(w).mean().item(),
               bal_deepseek=ds.balancedness(w).mean().item(),
               max_load_ratio_mean=ratio.mean().item(), max_load_ratio_worst=ratio.max().item(),
               traffic_ours=t_ours, traffic_deepseek=t_ds, cpu_ms_ours=c_ours,
               cpu_ms_deepseek=c_ds)
    line = (f"{name:<10} {num_replicas}/{num_gpus} n{num_nodes} {mode[:4]}: bal "
            f"{row['bal_ours']:.3f} vs {row['bal_deepseek']:.3f}, max/DS "
            f"{row['max_load_ratio_mean']:.3f} (<= {row['max_load_ratio_worst']:.3f}), nodes/tok "
            f"{t_ours['nodes_per_token']:.2f}, {c_ours:.0f}/{c_ds:.0f} ms")
    if old is not None:
        inc, moves = rebalance_incremental(w, old, NUM_GROUPS, num_nodes, num_gpus, mode)
        _, c_inc = median_ms(lambda: rebalance_incremental(w, old, NUM_GROUPS, num_nodes,
                                                            num_gpus, mode), reps)
        row.update(bal_incremental=inc.balancedness(w).mean().item(), moves=moves,
                   cpu_ms_incremental=c_inc)
        line += (f"\n{'':<10} incremental: bal {row['bal_incremental']:.3f}, {moves} of "
                 f"{w.shape[0] * num_replicas} slots moved, {c_inc:.0f} ms")
    print(line, flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m epmoe.bench.eplb_placement",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=writable_file, help="also write the rows as JSON to this file")
    ap.add_argument("--threads", type=at_least(1), default=1)
    ap.add_argument("--reps", type=at_least(1), default=10, help="timed runs per placement")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    L, E = NUM_LAYERS, NUM_EXPERTS
    zipf = zipf_weight(L, E, 1.2, seed=0)
    cases = [("zipf1.2", zipf, 288, 4, 32), ("zipf1.2", zipf, 320, 8, 64),
             ("zipf1.2", zipf, 384, 8, 64), ("zipf0.6", zipf_weight(L, E, 0.6, seed=1), 320, 8, 64),
             ("uniform", routed_weight("uniform", 0), 320, 8, 64),
             ("routed1.2", routed_weight("zipf:1.2", 0), 288, 4, 32)]
    rows = []
    for mode in MODES:
        for name, w, R, nodes, G in cases:
            rows.append(run_case(name, w, R, nodes, G, mode, a.reps))
        prev = rebalance(routed_weight("drift:1.2:1", 0), 288, NUM_GROUPS, 4, 32, mode)
        rows.append(run_case("drift1", routed_weight("drift:1.2:1", 1), 288, 4, 32, mode,
                             a.reps, old=prev))
    if a.json:
        with open(a.json, "w") as f:
            dump_json(rows, f, indent=1)


if __name__ == "__main__":
    run_main(main)
