"""Compile kernels for sm_90 on a machine without a GPU and report what ptxas says.

    python tools/sm90_kernel_check.py [--set symm|w4a8|layer] [--hidden 7168] [--warps 16]
                                      [--json] [--jobs N]

--set symm (default): each kernel of `epmoe/comm/symm` at DeepSeek-V3 shapes and the backends'
default tiles; --set w4a8: the W4A8 grouped GEMM (`epmoe/kernels/gemm_w4a8.py`) at each BLOCK_M
`w4a8_block_m` picks and each of its autotune configs (their own warps and stages); --set
layer: the layer's kernels in each of their variants (`tools/sm90_layer_kernels.py`: grouped
GEMMs per recipe, layout and gathered rows, permute, gather, act + quant, router). Reported:
registers per thread, spilled bytes, and how many 16-byte (v4) global loads / stores the PTX
holds next to narrower ones. A quick way to see, before spending device time, whether a change
made a kernel spill or lose its wide memory accesses. Pointer arguments (and integer ones
typed "i32:16") are compiled as multiples of 16, as the launches' specialization makes them
for these (aligned) tensors. Needs the triton wheel's bundled ptxas; no CUDA driver.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile for real, before epmoe reads it
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sm90_layer_kernels

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
ARENA = dict(arena_ptr="*u8", delta_ptr="*i64")


def compile_sm90(fn, sig: dict, consts: dict, num_warps: int, fusion: bool = True,
                 num_stages: int | None = None) -> dict:
    """-> {registers, spill_bytes, v4_loads, v4_stores, narrow_loads, narrow_stores}."""
    unbound = unbound_args(fn, sig, consts)
    if unbound:
        raise ValueError(f"{fn.__name__}: {unbound}: the tool's list is out of step with "
                         f"the kernel")
    src = ASTSource(fn=fn, signature={**{k: t.split(":")[0] for k, t in sig.items()},
                                      **{k: "constexpr" for k in consts}},
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]]
                           for k, t in sig.items() if t.startswith("*") or t.endswith(":16")})
    opts = dict(num_warps=num_warps, enable_fp_fusion=fusion)
    if num_stages is not None:
        opts["num_stages"] = num_stages
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return dict(registers=int(regs.group(1)) if regs else None,
                spill_bytes=int(spill.group(1)) if spill else 0,
                v4_loads=len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)),
                v4_stores=len(re.findall(r"st\.global(\.\w+)*\.v4", ptx)),
                narrow_loads=len(re.findall(r"ld\.global(\.nc)?\.b(16|8)\b", ptx)),
                narrow_stores=len(re.findall(r"st\.global\.b(16|8)\b", ptx)))


def unbound_args(fn, sig: dict, consts: dict) -> str:
    """'' when sig and consts name exactly the kernel's arguments, else what differs."""
    missing = [a for a in fn.arg_names if a not in sig and a not in consts]
    extra = [a for a in [*sig, *consts] if a not in fn.arg_names]
    return "; ".join(f"{what} {names}" for what, names in (("no value for", missing),
                                                          ("not an argument:", extra)) if names)


def kernels(hidden: int, world: int = 2, top_k: int = 8, local_experts: int = 128,
            tokens: int = 4096) -> list[tuple]:
    """(name, jit fn, signature, constexprs, fp fusion) at the backends' default tiles."""
    from epmoe.comm.symm import (ht_combine, ht_dispatch, ll_combine, ll_dispatch, ll_send,
                                  sum_back)
    from epmoe.comm.symm.arena import LL_COMBINE
    from epmoe.comm.symm.sync import USE_TIMER
    from epmoe.comm.symm.tiles import CHUNK_COLS, next_pow2, row_cols, rows_per_step

    dw = hidden * 2 // 4  # bf16 rows as int32 words
    ck = min(row_cols(hidden), CHUNK_COLS)
    hc = dict(COMB=4096, CSUM=2048, SB=max(4, 32 // world), TMAX=tokens, W=world, D=hidden,
              CK=ck, PRE_ROUND=False, USE_TIMER=USE_TIMER,
              NB=(tokens + max(4, 32 // world) - 1) // max(4, 32 // world))
    ht = dict(ROWS=4096, META=8192, CNT=16384, TMAX=tokens, W=world, WP=next_pow2(world),
              K=top_k, KP=next_pow2(top_k), E_L=local_experts, EP=next_pow2(local_experts),
              DW=dw, SW=0, CH=row_cols(dw), BSW=1, ROW_W=dw, MW=28, CW=132,
              USE_TIMER=USE_TIMER)
    ll = dict(SLOTS=4096, DATA=8192, SCALE=16384, META=32768, C=256, MSG=65536, MW=20,
              STAGE=131072, SSTAGE=262144, NTOK=4224, TMAX=128, W=world,
              WP=next_pow2(world), K=top_k, KP=next_pow2(top_k), E_L=local_experts,
              EP=next_pow2(local_experts), D=hidden,
              CH=row_cols(hidden), NG=hidden // 128, NGP=next_pow2(row_cols(hidden) // 128),
              FP8=True, USE_TIMER=USE_TIMER)
    return [
        *[(f"ht dispatch ({name})", ht_dispatch._dispatch_kernel,
           dict(**ARENA, x_ptr="*i32", s_ptr="*i32", ids_ptr="*i32", w_ptr="*fp32",
                pos_ptr="*i32", tok_ptr="*i32", total_ptr="*i32", TS="i32", xo_ptr="*i32",
                so_ptr="*i32", row_expert_ptr="*i32", inv_ptr="*i32", wo_ptr="*fp32",
                src_tok_ptr="*i32", info_ptr="*i32", arow_ptr="*i32", align="i32", me="i32",
                limit="i64", G_SEND="i32", G_RECV="i32"),
           dict(**ht, PROG=32768, GMAX=1024, M_MAX=world * tokens * top_k, CK=16,
                BT_S=rows_per_step(row_cols(dw)), BT_R=ht_dispatch.RECV_ROWS, BR=2048,
                MODE=mode, GATHER=gather), True)
          for name, mode, gather in (("send", ht_dispatch.SPLIT_SEND, False),
                                     ("recv", ht_dispatch.SPLIT_RECV, False),
                                     ("recv, gather", ht_dispatch.SPLIT_RECV, True),
                                     ("pipelined", ht_dispatch.PIPELINED, False))],
        *[(f"ht combine ({name})", ht_combine._combine_kernel,
           dict(**ARENA, y_ptr="*bf16", inv_ptr="*i32", w_ptr="*fp32", src_tok_ptr="*i32",
                info_ptr="*i32", part_ptr="*bf16", out_ptr="*bf16", msg_ptr="*i32", T="i32",
                me="i32", limit="i64", G_RED="i32", G_PUSH="i32", G_SUM="i32"),
           dict(**hc, DONE=8192, K=top_k, CH=row_cols(hidden), BTR=16,
                BT=rows_per_step(row_cols(hidden), 2), NWORDS=world * tokens, BR=1024,
                MODE=mode), False)
          for name, mode in (("split", ht_combine.SPLIT),
                             ("pipelined", ht_combine.PIPELINED))],
        ("ht combine sum", ht_combine._sum_kernel,
         dict(**ARENA, out_ptr="*bf16", msg_ptr="*i32", T="i32", me="i32", limit="i64"),
         hc, False),
        ("ll combine_send", ll_combine._combine_send_kernel,
         dict(**ARENA, y_ptr="*bf16", me="i32", limit="i64"),
         dict(SLOTS=4096, MSG=8192, MW=20, NTOK=12288, COMB=16384, TMAX=128, W=world,
              WP=next_pow2(world), K=top_k,
              E_L=local_experts, EP=next_pow2(local_experts), D=hidden, CK=ck, BT=16,
              PRE_ROUND=False, USE_TIMER=USE_TIMER), False),
        *[(f"ll dispatch_send ({name})", ll_send._dispatch_send_kernel,
           dict(**ARENA, x_ptr="*bf16", ids_ptr="*i32", w_ptr="*fp32", dest_ptr="*i64",
                msg_ptr="*i32", counts_ptr="*i32", T="i32", me="i32", limit="i64"),
           dict(ll, STAGED=staged, POW2=False, PRE_ROUND=False, BT=1, SA=16), True)
          for name, staged in (("direct", False), ("staged", True))],
        *[(f"ll dispatch_recv ({name})", ll_dispatch._dispatch_recv_kernel,
           dict(arena_ptr="*u8", counts_ptr="*i32", limit="i64"),
           dict(ll, STAGED=staged, AROW=524288, GATHER=gather, BT=2), True)
          for name, staged, gather in (("direct", False, False), ("staged", True, False),
                                       ("staged, gather", True, True))],
        ("ll sum_back", sum_back._sum_back_kernel,
         dict(**ARENA, out_ptr="*bf16", msg_ptr="*i32", T="i32", me="i32", limit="i64"),
         dict(OP=LL_COMBINE, COMB=4096, TMAX=128, W=world, D=hidden, CK=ck,
              BT=max(2, 32 // world), PRE_ROUND=False, USE_TIMER=USE_TIMER), False),
    ]


def w4a8_kernels() -> list[tuple]:
    """(name, jit fn, signature, constexprs, fp fusion, warps, stages): the contiguous W4A8
    GEMM at BLOCK_M 16 / 64 / 128 under each autotune config."""
    from epmoe.kernels import gemm_w4a8 as g

    sig = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", b_ptr="*u8", bs_ptr="*i32", c_ptr="*bf16",
               row_expert_ptr="*i32", counts_ptr="*i32", bias_ptr="*fp32", arow_ptr="*i32",
               M="i32", N="i32",
               K="i32", GRID_M="i32", stride_am="i32:16", stride_as_m="i32",
               stride_as_g="i32", stride_be="i32:16", stride_bn="i32:16", stride_bs_e="i32",
               stride_bs_n="i32", stride_bs_k="i32", stride_cm="i32:16", stride_b="i32")
    return [(f"w4a8 bm{bm} bn{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}",
             g._w4a8_kernel.fn, sig,
             dict(MASKED=False, HAS_BIAS=False, A_GATHER=False, INTERP=False, BLOCK_M=bm,
                  BLOCK_N=c.kwargs["BLOCK_N"], GROUP_M=8), True, c.num_warps, c.num_stages)
            for bm in (16, 64, 128) for c in g._CONFIGS]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=("symm", "w4a8", "layer"), default="symm",
                   help="the symm comm kernels, the W4A8 grouped GEMM's configs, or the "
                   "layer's kernels in their variants")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--warps", type=int, default=16, help="warps per CTA (the GPU default)")
    p.add_argument("--only", default="", help="comma-separated kernel names (substrings)")
    p.add_argument("--json", action="store_true", help="one JSON object per kernel")
    p.add_argument("--jobs", type=int, default=1,
                   help="kernels compiled at once, each in a forked process (output in order)")
    a = p.parse_args(argv)
    if a.hidden % 128 or a.hidden < 128:
        p.error(f"--hidden ({a.hidden}) must be a positive multiple of 128")
    if a.jobs < 1:
        p.error(f"--jobs ({a.jobs}) must be >= 1")
    if not os.path.exists(PTXAS):
        print(f"no ptxas at {PTXAS} (the triton wheel bundles it)", file=sys.stderr)
        return 2
    want = [w for w in a.only.split(",") if w]
    if a.set == "layer":
        from sm90_layer_kernels import layer_kernels
        todo = layer_kernels()
    else:
        todo = ([(*k, a.warps, None) for k in kernels(a.hidden)] if a.set == "symm"
                else w4a8_kernels())
    todo = [t for t in todo if not want or any(w in t[0] for w in want)]
    width = max([34, *(len(t[0]) for t in todo)])
    if not a.json:
        print(f"{'kernel':<{width}} {'regs':>5} {'spill B':>8} {'v4 ld':>6} {'v4 st':>6} "
              f"{'narrow ld/st':>13}")
    for (name, *_, warps, _), r in zip(todo, _compiled(todo, a.jobs), strict=True):
        if a.json:
            print(json.dumps(dict(kernel=name, warps=warps, **r)))
        else:
            print(f"{name:<{width}} {r['registers']:>5} {r['spill_bytes']:>8} {r['v4_loads']:>6} "
                  f"{r['v4_stores']:>6} {r['narrow_loads']:>6}/{r['narrow_stores']:<6}")
    return 0


def _compile_one(job) -> dict:
    _, fn, sig, consts, fusion, warps, stages = job
    return compile_sm90(fn, sig, consts, warps, fusion, stages)


def _compiled(todo: list[tuple], jobs: int):
    """Each kernel's ptxas report, in `todo`'s order; jobs > 1: forked workers, which inherit
    the jit functions (they do not pickle) and get each job as its index."""
    if jobs == 1 or len(todo) < 2:
        yield from map(_compile_one, todo)
        return
    with multiprocessing.get_context("fork").Pool(min(jobs, len(todo)),
                                                  initializer=_hold, initargs=(todo,)) as pool:
        yield from pool.imap(_compile_at, range(len(todo)))


_HELD: list = []  # a forked worker's copy of the jobs (set by the pool's initializer)


def _hold(todo: list[tuple]) -> None:
    _HELD[:] = todo


def _compile_at(i: int) -> dict:
    return _compile_one(_HELD[i])


if __name__ == "__main__":
    sys.exit(main())
