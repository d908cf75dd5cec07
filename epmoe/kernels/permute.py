"""ep_scatter: (token, k) pairs -> rows of the contiguous layout, token rows and scales copied.

Two launches, no torch ops in between: (a) count pairs per local expert: each program takes a
chunk of pairs, builds a `tl.histogram`, adds it into a zeroed accumulator with atomics and
takes a ticket; the last program reads the totals back (resetting the accumulator and the
ticket to zero for the next call) and writes counts, aligned offsets and the scatter cursors;
(b) one program per token takes a row of each of its K experts' groups with atomic cursors
(K atomics issued together), then copies the token's row (whole row in registers, read once as
32-bit words, 16-byte vectors) and its scale row to its K rows; the same launch writes
row_expert (from counts and offsets: a group's valid rows are its first counts[e] rows). Row
order inside a group follows the atomics (not token order as in `epmoe.layout`); padding rows
have row_expert -1 and unspecified data.

Sizing: exact (`num_rows=None`: one host sync), a given worst case (`num_rows`), or a
`PermuteWorkspace` (no allocation, no host sync: the layout is sized for the worst case of the
call's pairs and every output is a view into the workspace).
"""

from __future__ import annotations

from epmoe.kernels._common import (as_bits, check, check_tensor,
                                   empty_mn_major, is_mn_major, next_pow2)
from epmoe.kernels.workspace import PermuteWorkspace, hist_bins

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.layout import ContiguousLayout, contiguous_rows_upper_bound  # noqa: E402
from epmoe.quant import QTensor  # noqa: E402

_IDS_DTYPES = (torch.int32, torch.int64)
_HIST_CHUNK = 4096  # (token, k) pairs per histogram program
_HIST_BLOCK = 1024


@triton.jit
def _local_ids(ids_ptr, map_ptr, offs, m, E, HAS_MAP: tl.constexpr):
    """Local expert of pairs `offs` (-1: empty slot, not on this rank, or out of range)."""
    e = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=m & (e >= 0), other=-1)
    return tl.where(m & (e >= 0) & (e < E), e, -1)


@triton.jit
def _finalize_counts(h, counts_ptr, offsets_ptr, cursor_ptr, E, alignment,
                     BLOCK_E: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    em = offs_e < E
    c = tl.where(em, h, 0)
    aligned = (c + (alignment - 1)) // alignment * alignment
    excl = tl.cumsum(aligned, 0) - aligned  # offsets[e] for e <= E (BLOCK_E > E)
    tl.store(counts_ptr + offs_e, c, mask=em)
    tl.store(cursor_ptr + offs_e, excl, mask=em)
    tl.store(offsets_ptr + offs_e, excl, mask=offs_e <= E)


@triton.jit
def _hist_kernel(ids_ptr, map_ptr, acc_ptr, ticket_ptr, counts_ptr, offsets_ptr, cursor_ptr,
                 num_pairs, E, alignment, CHUNK,
                 HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Histogram of local expert ids over pairs [pid*CHUNK, +CHUNK); bin BLOCK_E-1 (> E-1)
    collects the invalid ones. The last program to finish writes counts / offsets / cursor."""
    pid = tl.program_id(0)
    start = pid * CHUNK
    end = tl.minimum(start + CHUNK, num_pairs)
    h = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for i in range(start, end, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        e = _local_ids(ids_ptr, map_ptr, offs, offs < end, E, HAS_MAP)
        h += tl.histogram(tl.where(e >= 0, e, BLOCK_E - 1), BLOCK_E)
    offs_e = tl.arange(0, BLOCK_E)
    if tl.num_programs(0) == 1:
        _finalize_counts(h, counts_ptr, offsets_ptr, cursor_ptr, E, alignment, BLOCK_E)
    else:
        tl.atomic_add(acc_ptr + offs_e, h)  # acq_rel, gpu scope: ordered before the ticket
        done = tl.atomic_add(ticket_ptr, 1)
        if done == tl.num_programs(0) - 1:  # every other program's counts are in acc
            total = tl.atomic_xchg(acc_ptr + offs_e, tl.zeros_like(h))  # read and reset
            tl.atomic_xchg(ticket_ptr, 0)
            _finalize_counts(total, counts_ptr, offsets_ptr, cursor_ptr, E, alignment, BLOCK_E)


def _check_routing(topk_ids_NK, num_experts, alignment, expert_map):
    check_tensor("topk_ids_NK", topk_ids_NK, _IDS_DTYPES, dim=2)
    check(isinstance(num_experts, int) and num_experts >= 1,
          f"num_experts ({num_experts!r}) must be a positive int (local experts on this rank)")
    check(isinstance(alignment, int) and alignment >= 1,
          f"alignment ({alignment!r}) must be a positive int (rows per group boundary)")
    if expert_map is not None:
        check_tensor("expert_map", expert_map, (torch.int32,), dim=1)
        check(expert_map.device == topk_ids_NK.device,
              f"expert_map is on {expert_map.device} but topk_ids_NK on {topk_ids_NK.device}; "
              f"move both to one device")


def _count_and_offsets(topk_ids_NK, num_experts, alignment, expert_map, bufs,
                       chunk=_HIST_CHUNK):
    """Phase (a): bufs = (hist (zero), ticket (zero), counts_E, offsets_E1, cursor_E) int32;
    writes counts, offsets (aligned prefix sum), cursor (= offsets[:-1]); one launch, no sync."""
    hist, ticket, counts, offsets, cursor = bufs
    num_pairs = topk_ids_NK.numel()
    has_map = expert_map is not None
    parts = max(1, triton.cdiv(num_pairs, chunk))
    _hist_kernel[(parts,)](topk_ids_NK, expert_map if has_map else counts, hist, ticket,
                           counts, offsets, cursor, num_pairs,
                           num_experts, alignment, chunk, HAS_MAP=has_map,
                           BLOCK=min(_HIST_BLOCK, chunk, next_pow2(max(num_pairs, 1))),
                           BLOCK_E=hist_bins(num_experts), num_warps=4)


@triton.jit
def _scatter_kernel(ids_ptr, map_ptr, cursor_ptr, counts_ptr, offsets_ptr, inv_ptr,
                    row_expert_ptr, tok_ptr, x_ptr, out_ptr, s_ptr, s_out_ptr,
                    K, E, D, G, num_rows,
                    stride_x, stride_out, s_stride_n, s_stride_g, so_stride_m, so_stride_g,
                    HAS_MAP: tl.constexpr, ASSIGN: tl.constexpr, COPY: tl.constexpr,
                    TOKENS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_E: tl.constexpr):
    """One program per token: its K pairs' rows (taken by atomics, or read from inv), then its
    data row and scale row copied to each of them; TOKENS (with ASSIGN): instead of rows, each
    layout row's token index (the token programs write the valid rows, the row_expert loop -1
    on the padding rows: disjoint sets, so no order between programs is needed)."""
    tok = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    km = offs_k < K
    pair = tok * K + offs_k
    if ASSIGN:  # take a row of each expert's group; the cursor starts at the group's offset
        e = _local_ids(ids_ptr, map_ptr, pair, km, E, HAS_MAP)
        valid = e >= 0
        row = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
        row = tl.where(valid, row, -1)
        tl.store(inv_ptr + pair, row, mask=km)
        if TOKENS:
            tl.store(tok_ptr + row, tl.full([BLOCK_K], 0, tl.int32) + tok, mask=valid)
        # row_expert from counts / offsets (grid-stride over rows): rows [off_e, off_e + c_e)
        # belong to expert e, the rest of the group and rows past offsets[E] are padding (-1)
        offs_e = tl.arange(0, BLOCK_E)
        ends = tl.load(offsets_ptr + 1 + offs_e, mask=offs_e < E, other=2147483647)
        for r0 in range(tok * BLOCK_R, num_rows, tl.num_programs(0) * BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            re = tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), axis=1)
            has = re < E
            start = tl.load(offsets_ptr + re, mask=has, other=0)
            cnt = tl.load(counts_ptr + re, mask=has, other=0)
            used = has & (r < start + cnt)
            tl.store(row_expert_ptr + r, tl.where(used, re, -1), mask=r < num_rows)
            if TOKENS:
                tl.store(tok_ptr + r, -1, mask=(r < num_rows) & ~used)
    else:  # rows given by an existing layout
        row = tl.load(inv_ptr + pair, mask=km, other=-1)
    if COPY:
        x_row = x_ptr + tok.to(tl.int64) * stride_x
        for d0 in range(0, D, BLOCK_D):  # one trip when the row fits BLOCK_D (the usual case)
            offs_d = d0 + tl.arange(0, BLOCK_D)
            dm = offs_d < D
            v = tl.load(x_row + offs_d, mask=dm)
            for kk in tl.static_range(BLOCK_K):
                r = tl.sum(tl.where(offs_k == kk, row, 0), axis=0)
                tl.store(out_ptr + r.to(tl.int64) * stride_out + offs_d, v, mask=dm & (r >= 0))
        if HAS_SCALE:
            s_row = s_ptr + tok.to(tl.int64) * s_stride_n
            for g0 in range(0, G, BLOCK_G):
                offs_g = g0 + tl.arange(0, BLOCK_G)
                gm = offs_g < G
                s = tl.load(s_row + offs_g * s_stride_g, mask=gm)
                for kk in tl.static_range(BLOCK_K):
                    r = tl.sum(tl.where(offs_k == kk, row, 0), axis=0)
                    tl.store(s_out_ptr + r.to(tl.int64) * so_stride_m + offs_g * so_stride_g, s,
                             mask=gm & (r >= 0))


def _as_words(a: torch.Tensor, b: torch.Tensor):
    """Same bytes as the widest int words (<= 4 bytes) both [rows, D] views allow."""
    a, b = as_bits(a), as_bits(b)
    for dt in (torch.int32, torch.int16):
        if dt.itemsize <= a.element_size():
            break
        try:
            return a.view(dt), b.view(dt)
        except RuntimeError:
            continue
    return a, b


def _launch_scatter(topk_ids_NK, expert_map, cursor, counts, offsets, inv, row_expert, x, out,
                    assign, num_experts=0, tokens=None):
    """tokens: int32 [num_rows] to receive each layout row's token (assign only)."""
    n, k = inv.shape
    if n * k == 0:
        if assign:
            row_expert.fill_(-1)
        if tokens is not None:
            tokens.fill_(-1)
        return
    copy = x is not None
    if copy:
        data, odata = _as_words(x.data, out.data)
    else:
        data = odata = inv
    has_scale = copy and x.scale is not None
    s = as_bits(x.scale) if has_scale else inv
    so = as_bits(out.scale) if has_scale else inv
    d = data.shape[1] if copy else 0
    g = x.scale.shape[1] if has_scale else 0
    dummy = inv
    _scatter_kernel[(n,)](
        topk_ids_NK if assign else dummy, expert_map if expert_map is not None else dummy,
        cursor if assign else dummy, counts if assign else dummy, offsets if assign else dummy,
        inv, row_expert if assign else dummy, dummy if tokens is None else tokens, data, odata,
        s, so,
        k, num_experts, d, g, row_expert.shape[0] if assign else 0,
        data.stride(0) if copy else 0, odata.stride(0) if copy else 0,
        s.stride(0) if has_scale else 0, s.stride(1) if has_scale else 0,
        so.stride(0) if has_scale else 0, so.stride(1) if has_scale else 0,
        HAS_MAP=expert_map is not None, ASSIGN=assign, COPY=copy,
        TOKENS=tokens is not None, HAS_SCALE=has_scale,
        BLOCK_K=next_pow2(k), BLOCK_D=min(next_pow2(max(d, 1)), 4096),
        BLOCK_G=min(next_pow2(max(g, 1)), 256), BLOCK_R=16,
        BLOCK_E=next_pow2(max(num_experts, 1)), num_warps=4)


def _check_x(x: QTensor, n: int, device) -> None:
    check(isinstance(x, QTensor), f"x must be an epmoe.quant.QTensor, got {type(x).__name__}")
    check(x.data.dim() == 2 and x.data.shape[0] == n,
          f"x.data must be [N, D] with N = topk_ids_NK.shape[0] ({n}), got "
          f"{tuple(x.data.shape)}")
    check(x.data.stride(1) == 1, f"x.data rows must be contiguous (stride {x.data.stride()}); "
          f"call .contiguous() first")
    check(x.data.device == device, f"x is on {x.data.device} but topk_ids_NK on {device}")
    if x.scale is not None:
        check(x.scale.dim() == 2 and x.scale.shape[0] == n,
              f"x.scale must be [N, G] with N = {n}, got {tuple(x.scale.shape)}")


def _empty_like_rows(x: QTensor, num_rows: int) -> QTensor:
    dev = x.data.device
    data = torch.empty((num_rows, x.data.shape[1]), dtype=x.data.dtype, device=dev)
    scale = None
    if x.scale is not None:
        g = x.scale.shape[1]
        if x.scale_fmt == "ue8m0_packed" or is_mn_major(x.scale):  # keep the TMA layout
            scale = empty_mn_major(num_rows, g, x.scale.dtype, dev)
        else:
            scale = torch.empty((num_rows, g), dtype=x.scale.dtype, device=dev)
    return QTensor(data, scale, x.recipe, x.group, x.scale_fmt)


def _check_workspace(ws, num_experts, alignment, x, num_pairs):
    check(isinstance(ws, PermuteWorkspace), f"workspace must be a PermuteWorkspace, got "
          f"{type(ws).__name__}")
    check(ws.num_experts == num_experts and ws.alignment == alignment,
          f"workspace was made for {ws.num_experts} experts at alignment {ws.alignment}, the "
          f"call has {num_experts} at {alignment}; create one per (experts, alignment)")
    if x is not None:
        ws.check_input(x, num_pairs)
    else:
        check(num_pairs <= ws.max_pairs, f"{num_pairs} pairs exceed the workspace's "
              f"max_pairs ({ws.max_pairs}); create it with a larger max_tokens")


def _layout(topk_ids_NK, num_experts, alignment, expert_map, num_rows, x, ws=None,
            tokens=False):
    """-> (rows of x in the layout or None, layout, each row's token or None (tokens))."""
    _check_routing(topk_ids_NK, num_experts, alignment, expert_map)
    n, k = topk_ids_NK.shape
    dev = topk_ids_NK.device
    topk_ids_NK = topk_ids_NK.contiguous()
    bound = contiguous_rows_upper_bound(n * k, num_experts, alignment)
    if ws is not None:
        _check_workspace(ws, num_experts, alignment, x, n * k)
        num_rows = bound if num_rows is None else num_rows
        check(num_rows <= ws.max_rows, f"num_rows ({num_rows}) exceeds the workspace's "
              f"max_rows ({ws.max_rows})")
        bufs = (ws.hist_B, ws.ticket_1, ws.counts_E, ws.offsets_E1, ws.cursor_E)
    else:
        bins = hist_bins(num_experts)
        zero = torch.zeros(bins + 1, dtype=torch.int32, device=dev)
        bufs = (zero[:bins], zero[bins:]) + tuple(
            torch.empty(num_experts + j, dtype=torch.int32, device=dev) for j in (0, 1, 0))
    _count_and_offsets(topk_ids_NK, num_experts, alignment, expert_map, bufs)
    counts, offsets, cursor = bufs[2:]
    if num_rows is None:
        num_rows = int(offsets[-1])  # host sync: exact size (the only one)
    else:
        check(num_rows >= bound, f"num_rows ({num_rows}) is below the worst case for "
              f"{n * k} pairs over {num_experts} experts at alignment {alignment} ({bound}); "
              f"pass contiguous_rows_upper_bound(...) or None (exact, syncs the host)")
    if ws is not None:
        inv, row_expert = ws.inv_P[:n * k].view(n, k), ws.row_expert_R[:num_rows]
        out = None if x is None else ws.rows(num_rows)
        tok = ws.token_R[:num_rows] if tokens else None
    else:
        inv = torch.empty((n, k), dtype=torch.int32, device=dev)
        row_expert = torch.empty((num_rows,), dtype=torch.int32, device=dev)  # in-kernel
        out = None if x is None else _empty_like_rows(x, num_rows)
        tok = torch.empty((num_rows,), dtype=torch.int32, device=dev) if tokens else None
    _launch_scatter(topk_ids_NK, expert_map, cursor, counts, offsets, inv, row_expert, x, out,
                    assign=True, num_experts=num_experts, tokens=tok)
    layout = ContiguousLayout(row_expert_M=row_expert, inv_perm_NK=inv, counts_E=counts,
                              offsets_E1=offsets, alignment=alignment)
    return out, layout, tok


def triton_permute(x: QTensor, topk_ids_NK: torch.Tensor, num_experts: int,
                   alignment: int = 128, expert_map: torch.Tensor | None = None,
                   num_rows: int | None = None, workspace: PermuteWorkspace | None = None
                   ) -> tuple[QTensor, ContiguousLayout]:
    """Tokens x [N, D] (+ scales [N, G]) routed by topk_ids_NK -> (rows [M, D], layout).

    topk_ids_NK  int32/int64 [N, K]  local expert ids in [0, E), or global ids when
                                     expert_map is given; -1 = empty slot
    expert_map   int32 [E_global]    global -> local id, -1 = not on this rank
    num_rows     None = exact M (syncs the host; with a workspace: the worst case of N*K
                 pairs, no sync), else M >= contiguous_rows_upper_bound
    workspace    PermuteWorkspace: no allocation, no host sync; outputs are views into it
    Scales keep their layout: row-major stays row-major, MN-major (fp32 TMA-aligned or packed
    UE8M0) comes back MN-major with strides (1, align(M, 4)).
    """
    _check_x(x, topk_ids_NK.shape[0] if topk_ids_NK.dim() == 2 else -1, topk_ids_NK.device)
    return _layout(topk_ids_NK, num_experts, alignment, expert_map, num_rows, x, workspace)[:2]


def triton_make_contiguous_layout(topk_ids_NK: torch.Tensor, num_experts: int,
                                  alignment: int = 128, expert_map: torch.Tensor | None = None,
                                  num_rows: int | None = None,
                                  workspace: PermuteWorkspace | None = None
                                  ) -> ContiguousLayout:
    """The layout alone (same kernels, no data copied); `triton_permute_rows` copies later."""
    return _layout(topk_ids_NK, num_experts, alignment, expert_map, num_rows, None,
                   workspace)[1]


def triton_layout_tokens(topk_ids_NK: torch.Tensor, num_experts: int, alignment: int = 128,
                         expert_map: torch.Tensor | None = None, num_rows: int | None = None,
                         workspace: PermuteWorkspace | None = None
                         ) -> tuple[ContiguousLayout, torch.Tensor]:
    """The layout and, per layout row, the token it holds (int32 [M], -1 on padding): what a
    GEMM that reads its rows through an index (`rows_M`) takes instead of permuted rows. Same
    kernels and sizing as `triton_permute`, no row copied."""
    _, layout, tokens = _layout(topk_ids_NK, num_experts, alignment, expert_map, num_rows,
                                None, workspace, tokens=True)
    return layout, tokens


def triton_permute_rows(x: QTensor, layout: ContiguousLayout,
                        out: QTensor | None = None) -> QTensor:
    """Copy token rows (and scales) into an existing layout: out[inv_perm[n, k]] = x[n].
    out: preallocated rows (e.g. `PermuteWorkspace.rows(layout.num_rows)`), else allocated."""
    n, _ = layout.inv_perm_NK.shape
    _check_x(x, n, layout.inv_perm_NK.device)
    check_tensor("layout.inv_perm_NK", layout.inv_perm_NK, (torch.int32,), dim=2)
    if out is None:
        out = _empty_like_rows(x, layout.num_rows)
    check(isinstance(out, QTensor) and out.data.shape[0] == layout.num_rows and
          out.data.shape[1] == x.data.shape[1] and out.data.dtype == x.data.dtype and
          (out.scale is None) == (x.scale is None),
          f"out must be a QTensor of {layout.num_rows} rows in x's format")
    _launch_scatter(None, None, None, None, None, layout.inv_perm_NK, None, x, out, assign=False)
    return out


__all__ = ["triton_permute", "triton_make_contiguous_layout", "triton_layout_tokens",
           "triton_permute_rows", "PermuteWorkspace"]
