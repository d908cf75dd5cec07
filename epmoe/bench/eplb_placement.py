"""Replica placement: ours ("auto") against DeepSeek EPLB, quality and speed.

    python -m epmoe.bench.eplb_placement [--json FILE]

One line per case: shape, balancedness (mean/max GPU load, averaged over layers) of ours and
DeepSeek's, ours/DeepSeek max GPU load, and time (median of 20 runs, 1 thread; wall and CPU)
with the ratio to DeepSeek's time (our vectorized reimplementation of its algorithm). The drift
case also times `rebalance_incremental` from the previous step's placement and counts moved slots.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from epmoe.eplb import deepseek_rebalance, make_routing, rebalance, rebalance_incremental

NUM_LAYERS, NUM_EXPERTS, TOP_K, NUM_GROUPS = 61, 256, 8, 8  # DeepSeek-V3-like


def zipf_weight(L, E, s, seed, scale=1e5):
    g = torch.Generator().manual_seed(seed)
    pop = torch.arange(1, E + 1, dtype=torch.float64) ** -s
    return torch.poisson(torch.stack([pop[torch.randperm(E, generator=g)] for _ in range(L)])
                         * scale, generator=g)


def routed_weight(spec, step, num_tokens=4096, seed=0):
    ids = make_routing(spec, NUM_LAYERS, NUM_EXPERTS, TOP_K, num_tokens, step, seed)
    w = torch.zeros(NUM_LAYERS, NUM_EXPERTS, dtype=torch.float64)
    return w.scatter_add_(1, ids.flatten(1), torch.ones(ids.flatten(1).shape, dtype=w.dtype))


def median_ms(fn, reps=20):
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


def run_case(name, w, num_replicas, num_nodes, num_gpus, old=None):
    args = (w, num_replicas, NUM_GROUPS, num_nodes, num_gpus)
    ours, ds = rebalance(*args), deepseek_rebalance(*args)
    (t_ours, c_ours), (t_ds, c_ds) = (median_ms(lambda: rebalance(*args)),
                                      median_ms(lambda: deepseek_rebalance(*args)))
    ratio = (ours.gpu_loads(w).max(1).values / ds.gpu_loads(w).max(1).values).mean().item()
    row = dict(case=name, layers=w.shape[0], experts=w.shape[1], replicas=num_replicas,
               gpus=num_gpus, nodes=num_nodes, bal_ours=ours.balancedness(w).mean().item(),
               bal_deepseek=ds.balancedness(w).mean().item(), max_load_ratio=ratio,
               ms_ours=t_ours, ms_deepseek=t_ds, cpu_ms_ours=c_ours, cpu_ms_deepseek=c_ds)
    line = (f"{name:<14} L={w.shape[0]} E={w.shape[1]} R={num_replicas} G={num_gpus} "
            f"nodes={num_nodes}: balancedness ours {row['bal_ours']:.4f} vs deepseek "
            f"{row['bal_deepseek']:.4f}, max load ours/ds {ratio:.3f}; "
            f"{t_ours:.1f} ms vs {t_ds:.1f} ms ({t_ours / t_ds:.2f}x), cpu {c_ours:.1f} vs "
            f"{c_ds:.1f} ms")
    if old is not None:
        inc, moves = rebalance_incremental(w, old, NUM_GROUPS, num_nodes, num_gpus)
        t_inc, _ = median_ms(lambda: rebalance_incremental(w, old, NUM_GROUPS, num_nodes,
                                                            num_gpus))
        row.update(bal_incremental=inc.balancedness(w).mean().item(), moves=moves, ms_inc=t_inc)
        line += (f"; incremental bal {row['bal_incremental']:.4f}, {moves} of "
                 f"{w.shape[0] * num_replicas} slots moved, {t_inc:.1f} ms")
    print(line, flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    L, E = NUM_LAYERS, NUM_EXPERTS
    rows = []
    zipf = zipf_weight(L, E, 1.2, seed=0)
    # 288 slots (32 redundant) need a GPU count dividing 288: 32 GPUs of 4 nodes
    rows.append(run_case("zipf1.2", zipf, 288, 4, 32))
    rows.append(run_case("zipf1.2", zipf, 320, 8, 64))
    rows.append(run_case("zipf1.2", zipf, 384, 8, 64))
    rows.append(run_case("zipf0.6", zipf_weight(L, E, 0.6, seed=1), 320, 8, 64))
    rows.append(run_case("uniform", routed_weight("uniform", 0), 320, 8, 64))
    rows.append(run_case("routed zipf1.2", routed_weight("zipf:1.2", 0), 288, 4, 32))
    prev = rebalance(routed_weight("drift:1.2:1", 0), 288, NUM_GROUPS, 4, 32)
    rows.append(run_case("drift1.2 step1", routed_weight("drift:1.2:1", 1), 288, 4, 32, old=prev))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
