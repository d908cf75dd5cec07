"""`python -m epmoe.bench.gather_gemm`: what reading the grouped GEMM's rows through an index
costs at prefill sizes (one GPU); `--apply 128,32`: the Triton experts' whole apply with its
rows copied into the layout or read in place, per recipe (`measure_apply`).

The contiguous layout's GEMM1 (N = 2 x intermediate, K = hidden; the TMA kernel for bf16 /
fp8_block, the pointer and W4A8 kernels for mxfp8 / w4a8_mxfp4), two ways over the same
tokens and routing: the rows permuted into the layout first (`triton_permute`, then A by TMA
where the kernel has it: the copy symm-ht's receive does for it) and the tokens read in place
through the layout's row -> token index (`rows_M`, A by pointer loads: no copy). Times:
CUDA events, median of `--iters` after warm-up; the ratio is gathered / (permute + GEMM).
DeepSeek-V3 dims by default: hidden 7168, intermediate 2048, 128 local experts (256 at ep 2),
top-8, `--tokens` received tokens.
"""

from __future__ import annotations

import argparse

import torch

from epmoe.argtypes import at_least, int_list, name_list
from epmoe.bench.timers import event_median_us as _median_us
from epmoe.config import RECIPES


def measure(recipe: str, tokens: int, iters: int, experts: int = 128, top_k: int = 8,
            hidden: int = 7168, inter: int = 2048) -> dict:
    from epmoe.config import QuantConfig
    from epmoe.kernels.grouped_gemm import triton_m_grouped_gemm_nt_contiguous
    from epmoe.bench.gather_ways import random_weight
    from epmoe.kernels.permute import triton_permute
    from epmoe.layout import contiguous_rows_upper_bound
    from epmoe.quant import quantize_act

    quant, dev = QuantConfig(recipe), "cuda"
    w = random_weight(quant, experts, 2 * inter, hidden, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.rand(tokens, experts, generator=g, device=dev).topk(top_k // 2).indices
    ids = ids.to(torch.int32)  # ~half a token's 8 experts are on this rank at ep 2
    x = quantize_act(torch.randn(tokens, hidden, generator=g, device=dev), quant)
    bound = contiguous_rows_upper_bound(tokens * ids.shape[1], experts, 128)
    xp, lay = triton_permute(x, ids, experts, 128, num_rows=bound)  # no host sync
    rows = torch.full((lay.num_rows,), -1, dtype=torch.int32, device=dev)
    inv = lay.inv_perm_NK.long()
    tok = torch.arange(tokens, device=dev)[:, None].expand_as(inv)
    rows[inv[inv >= 0]] = tok[inv >= 0].to(torch.int32)
    permute = _median_us(lambda: triton_permute(x, ids, experts, 128, num_rows=bound), iters)
    gemm = _median_us(lambda: triton_m_grouped_gemm_nt_contiguous(xp, w, lay), iters)
    gathered = _median_us(lambda: triton_m_grouped_gemm_nt_contiguous(x, w, lay, rows_M=rows),
                          iters)
    y_p = triton_m_grouped_gemm_nt_contiguous(xp, w, lay)
    y_g = triton_m_grouped_gemm_nt_contiguous(x, w, lay, rows_M=rows)
    valid = lay.row_expert_M >= 0
    return dict(recipe=recipe, tokens=tokens, rows=int(valid.sum()), permute_us=permute,
                gemm_us=gemm, gathered_us=gathered, ratio=gathered / (permute + gemm),
                equal=bool(torch.equal(y_p[valid], y_g[valid])))


def measure_apply(recipe: str, tokens: int, iters: int, experts: int) -> dict:
    """The Triton experts' whole `apply` (permute, GEMM1, act, GEMM2, gather), both ways in one
    process: the rows copied into the layout (`gather_tokens` off) and read in place through
    the layout's index (`gather_tokens` on). DeepSeek-V3 dims, a rank
    of `experts` local experts (ep = 256 / experts) that received `tokens` tokens: of each
    token's 8 slots, 8 x experts / 256 (at least 1) are its experts, the rest -1."""
    from epmoe.bench.gather_ways import random_experts
    from epmoe.config import QuantConfig, get_preset

    cfg, quant, dev = get_preset("deepseek-v3"), QuantConfig(recipe), "cuda"
    ex = random_experts(cfg, quant, experts, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    local = max(1, cfg.top_k * experts // cfg.num_experts)
    ids = torch.full((tokens, cfg.top_k), -1, dtype=torch.int32, device=dev)
    ids[:, :local] = torch.rand(tokens, experts, generator=g, device=dev).topk(local).indices
    w = torch.rand(tokens, cfg.top_k, generator=g, device=dev)
    x = ex.quantize_input(torch.randn(tokens, cfg.hidden, generator=g, device=dev))
    us, ys = {}, {}
    for way in (False, True):
        ex.gather_tokens = way
        us[way] = _median_us(lambda: ex.apply(x, ids, w), iters)
        ys[way] = ex.apply(x, ids, w).clone()
    return dict(recipe=recipe, tokens=tokens, experts=experts, rows=tokens * local,
                copied_us=us[False],
                gathered_us=us[True], ratio=us[True] / us[False],
                equal=bool(torch.equal(ys[False], ys[True])))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.gather_gemm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int_list(1), default=(8192,),
                   help="tokens received (ep 2 at 4096 a rank: 8192)")
    p.add_argument("--recipes", type=name_list(RECIPES), default=("fp8_block", "bf16"),
                   help="comma-separated")
    p.add_argument("--iters", type=at_least(1), default=10)
    p.add_argument("--apply", type=int_list(1), default=(), metavar="EXPERTS",
                   help="instead: the Triton experts' whole apply, copied vs in place, at "
                   "these local expert counts (e.g. 128,32: ep 2 and 8)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if a.apply:
        print(f"{'recipe':10} {'experts':>7} {'tokens':>6} {'rows':>7} {'copied':>9} "
              f"{'in place':>9} {'ratio':>6} equal")
        for r in a.recipes:
            for e in a.apply:
                for t in a.tokens:
                    m = measure_apply(r, t, a.iters, e)
                    print(f"{r:10} {e:>7} {t:>6} {m['rows']:>7} {m['copied_us']:>9.1f} "
                          f"{m['gathered_us']:>9.1f} {m['ratio']:>6.3f} {m['equal']}",
                          flush=True)
        return 0
    print(f"{'recipe':10} {'tokens':>6} {'rows':>7} {'permute':>8} {'gemm':>8} "
          f"{'gathered':>9} {'ratio':>6} equal")
    for r in a.recipes:
        for t in a.tokens:
            m = measure(r, t, a.iters)
            print(f"{r:10} {t:>6} {m['rows']:>7} {m['permute_us']:>8.1f} {m['gemm_us']:>8.1f} "
                  f"{m['gathered_us']:>9.1f} {m['ratio']:>6.3f} {m['equal']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
