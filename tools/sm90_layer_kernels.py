"""The layer's kernels for `tools/sm90_kernel_check.py --set layer`: the grouped GEMMs (the
pointer kernel in each recipe, the W4A8 and TMA kernels; masked / contiguous; rows read in
place through an index or not), the permute's count and scatter, the gather, the fused
act + quant and the router (constexprs from the presets, as its launch derives them).
Each entry: (name, kernel, argument types, constexprs, options); arguments not named take
`full_signature`'s defaults (pointers int32, scalars i32).
"""

from __future__ import annotations

I32, F32, BF16, FP8, U8 = "*i32", "*fp32", "*bf16", "*fp8e4nv", "*u8"
INDEX = {"row_expert_ptr": I32, "counts_ptr": I32, "offsets_ptr": I32, "arow_ptr": I32,
         "bias_ptr": F32}


def full_signature(fn, types: dict, consts: dict) -> dict:
    """Every runtime argument of `fn` typed: `types`, else the index defaults, else int32
    pointers and i32 scalars."""
    return {n: types.get(n) or INDEX.get(n) or (I32 if n.endswith("_ptr") else "i32")
            for n in fn.arg_names if n not in consts}


def _pointer_cases():
    from epmoe.kernels.grouped_gemm import _grouped_gemm_kernel as k
    # RECIPE: (a, a scales, w, w scales, K step); fp8_block packed: scales int32 words
    ops = {0: (BF16, BF16, BF16, BF16, 64), 1: (FP8, F32, FP8, F32, 128),
           2: (FP8, U8, FP8, U8, 128), 3: (FP8, F32, U8, U8, 64)}
    for recipe, (a, s, w, ws, bk) in ops.items():
        for packed in ((False, True) if recipe == 1 else (False,)):
            for masked in (False, True):
                for gather in (False, True):
                    yield (f"pointer recipe={recipe} packed={packed} masked={masked} "
                           f"gather={gather}", k,
                           dict(a_ptr=a, as_ptr=I32 if packed else s, b_ptr=w, bs_ptr=ws,
                                c_ptr=BF16),
                           dict(RECIPE=recipe, MASKED=masked, A_PACKED=packed, HAS_BIAS=True,
                                A_GATHER=gather, DOT_FP32=False, PRE_ROUND=False,
                                EVEN_K=True, BLOCK_M=64, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8),
                           dict(num_warps=8, num_stages=3))


def _w4a8_cases():
    from epmoe.kernels.gemm_w4a8 import _w4a8_kernel as k
    for bm in (16, 128):
        for masked in (False, True):
            for gather in (False, True):
                yield (f"w4a8 block_m={bm} masked={masked} gather={gather}", k,
                       dict(a_ptr=FP8, as_ptr=F32, b_ptr=U8, bs_ptr=I32, c_ptr=BF16),
                       dict(MASKED=masked, HAS_BIAS=True, A_GATHER=gather, INTERP=False,
                            BLOCK_M=bm, BLOCK_N=128, GROUP_M=8),
                       dict(num_warps=8, num_stages=3))


def _tma_cases():
    from epmoe.kernels.gemm_tma import _gemm_tma_kernel as k
    bm, bn = 128, 128
    for fp8 in (False, True):
        bk, dt = (128, "fp8e4nv") if fp8 else (64, "bf16")
        for gather in (False, True):
            types = dict(b_desc=f"tensordesc<{dt}[{bn},{bk}]>",
                         c_desc=f"tensordesc<bf16[{bm},{bn}]>", c_ptr=BF16, as_ptr=F32,
                         bs_ptr=F32, a_ptr=f"*{dt}")
            consts = dict(FP8=fp8, MASKED=False, A_PACKED=False, HAS_BIAS=True,
                          A_GATHER=gather, INTERP=False, TMA_STORE=True, WARP_SPEC=False,
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_N=1, GROUP_M=8)
            if gather:  # no descriptor for A: its rows are loaded by pointer
                consts["a_desc"] = None
            else:
                types["a_desc"] = f"tensordesc<{dt}[{bm},{bk}]>"
            yield (f"tma fp8={fp8} gather={gather}", k, types, consts,
                   dict(num_warps=8, num_stages=3))


def _layout_cases():
    """The permute's count and scatter (rows copied, or the tokens' index written) and the
    gather's weighted sum."""
    from epmoe.kernels.gather import _gather_reduce_kernel
    from epmoe.kernels.permute import _hist_kernel, _scatter_kernel

    for has_map in (False, True):
        yield (f"hist map={has_map}", _hist_kernel, dict(acc_ptr=I32, ticket_ptr=I32),
               dict(HAS_MAP=has_map, BLOCK=1024, BLOCK_E=256), dict(num_warps=4))
    words = dict(ids_ptr=I32, map_ptr=I32, cursor_ptr=I32, inv_ptr=I32, tok_ptr=I32,
                 x_ptr=I32, out_ptr=I32, s_ptr=I32, s_out_ptr=I32)
    for assign, copy, tokens, scale in ((True, True, False, True), (True, True, False, False),
                                        (True, False, True, False), (False, True, False, True)):
        yield (f"scatter assign={assign} copy={copy} tokens={tokens} scale={scale}",
               _scatter_kernel, words,
               dict(HAS_MAP=True, ASSIGN=assign, COPY=copy, TOKENS=tokens, HAS_SCALE=scale,
                    BLOCK_K=8, BLOCK_D=2048, BLOCK_G=64, BLOCK_R=16, BLOCK_E=256),
               dict(num_warps=4))
    for has_w in (False, True):
        yield (f"gather weights={has_w}", _gather_reduce_kernel,
               dict(y_ptr=BF16, rows_ptr=I32, w_ptr=F32, out_ptr=BF16),
               dict(HAS_W=has_w, PRE_ROUND=False, BLOCK_T=4, BLOCK_D=1024), dict(num_warps=4))


def _act_quant_cases():
    """The fused activation + quantization: each output format (bf16, fp8 with fp32 / pow2 /
    e8m0 / packed scales), both activations, and the row masks and bias of the layouts."""
    from epmoe.kernels.act_quant import _act_quant_kernel as k

    scale = {0: BF16, 1: F32, 2: F32, 3: U8, 4: I32}
    for quant, act, valid, bias in ((0, 1, 0, False), (1, 1, 1, False), (2, 2, 2, True),
                                    (3, 2, 1, True), (4, 1, 2, False), (1, 2, 0, True)):
        group = 256 if quant == 0 else 32 if quant == 3 else 128
        yield (f"act_quant quant={quant} act={act} valid={valid} bias={bias}", k,
               dict(h_ptr=BF16, q_ptr=BF16 if quant == 0 else FP8, s_ptr=scale[quant],
                    valid_ptr=I32, b_ptr=F32, limit="fp32", alpha="fp32", amax_min="fp32",
                    fp8_max="fp32"),
               dict(ACT=act, HAS_LIMIT=act == 2, QUANT=quant, PRE_ROUND=False, VALID=valid,
                    HAS_BIAS=bias, GROUP=group, GROUPS_PER_PROG=4 if quant == 4 else 1,
                    BLOCK_M=16),
               dict(num_warps=4))


def _router_cases():
    """The router (gate GEMM fused or given logits; every router kind; DeepSeek-V4's hash
    layers), its constexprs derived from the presets as the launch derives them."""
    from epmoe.config import get_preset
    from epmoe.kernels._common import next_pow2
    from epmoe.kernels.gate_topk import (LOGITS_ROUTER, _KIND, RouterConfig,
                                         _router_kernel as k, router_config)
    from epmoe.router import group_best

    for model, router, hashed in (("deepseek-v3", None, False), ("kimi-k2", None, False),
                                  ("qwen3-235b-a22b", None, False),
                                  ("qwen3-235b-a22b", "softmax_biased", False),
                                  ("gpt-oss-120b", None, False),
                                  ("deepseek-v4-tiny", None, False),
                                  ("deepseek-v4-tiny", None, True)):
        cfg = get_preset(model)
        cfg = cfg.replace(router=router) if router else cfg
        block_e = max(16, next_pow2(cfg.num_experts))
        variants = [(True, router_config(cfg.num_experts)), (False, LOGITS_ROUTER)]
        if model == "deepseek-v3":  # the logits config before LOGITS_ROUTER's one token
            variants.append((False, RouterConfig(16, LOGITS_ROUTER.block_k, 8, 1)))
        for fused, c in variants:
            yield (f"router {model} ({cfg.router}) fused={fused} hash={hashed}"
                   + ("" if fused else f" bm={c.block_m} w={c.num_warps}"), k,
                   dict(x_ptr=BF16 if fused else F32, g_ptr=BF16, l_ptr=F32, bias_ptr=F32,
                        ids_ptr=I32, w_ptr=F32, tab_ptr=I32, tok_ptr="*i64",
                        scaling="fp32", renorm_eps="fp32"),
                   dict(KIND=_KIND[cfg.router], FUSED=fused, HASH=hashed,
                        HAS_BIAS=cfg.router != "softmax" and not hashed,
                        N_GROUP=cfg.n_group, NG_PAD=next_pow2(cfg.n_group),
                        GROUP_SIZE=cfg.num_experts // cfg.n_group,
                        GROUP_BEST=group_best(cfg), TOPK_GROUP=cfg.topk_group,
                        TOP_K=cfg.top_k, RENORM=cfg.renormalize, INTERP=False,
                        EVEN_K=cfg.hidden % c.block_k == 0,
                        BLOCK_M=c.block_m, BLOCK_E=block_e,
                        BLOCK_K=c.block_k, K_PAD=max(2, next_pow2(cfg.top_k))),
                   dict(num_warps=c.num_warps, num_stages=c.num_stages))


def layer_kernels() -> list[tuple]:
    """(name, jit fn, signature, constexprs, fp fusion, warps, stages), as the tool takes."""
    from triton.runtime.jit import JITFunction

    out = []
    for cases in (_pointer_cases, _w4a8_cases, _tma_cases, _layout_cases, _act_quant_cases,
                  _router_cases):
        for name, kernel, types, consts, opts in cases():
            while not isinstance(kernel, JITFunction):  # under an autotuner
                kernel = kernel.fn
            out.append((name, kernel, full_signature(kernel, types, consts), consts, True,
                        opts["num_warps"], opts.get("num_stages")))
    return out
