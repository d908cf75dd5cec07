"""The HT arena's sizes and the wire format of its rows (plain Python: no kernels here).

`HTShape` sizes a rank's HT regions for the run's worst case (`ht_dispatch.py` lists them);
`RowFormat` says how one activation row travels; `max_rows` is the worst-case row count of the
contiguous layout a receive writes (no host sync sizes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.comm.symm.arena import ArenaLayout
from epmoe.config import QuantConfig
from epmoe.kernels._common import INTERPRET
from epmoe.quant import FP8_DTYPE


MAX_SEND_CTAS = 1024  # progress words per source rank: one per CTA of its dispatch send


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class RowFormat:
    """How one activation row travels: the wire recipe (packed UE8M0 travels as its fp32
    powers of two, as in `comm.wire`), data dtype and per-row scale dtype / columns."""

    recipe: str
    group: int
    scale_fmt: str
    hidden: int

    @classmethod
    def of(cls, quant: QuantConfig, hidden: int) -> "RowFormat":
        fmt = "ue8m0_fp32" if quant.scale_fmt == "ue8m0_packed" else quant.scale_fmt
        return cls(quant.recipe, quant.act_group, fmt, hidden)

    @property
    def data_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.recipe == "bf16" else FP8_DTYPE

    @property
    def scale_dtype(self) -> torch.dtype | None:
        return None if self.recipe == "bf16" else (
            torch.uint8 if self.recipe == "mxfp8" else torch.float32)

    @property
    def scale_cols(self) -> int:
        return 0 if self.recipe == "bf16" else self.hidden // self.group

    @property
    def data_bytes(self) -> int:
        return self.hidden * self.data_dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        """Scale bytes per row on the wire, padded to whole words (mxfp8 at gpt-oss's hidden
        2880: 90 one-byte scales travel as 92; the padding is never read back)."""
        if self.scale_dtype is None:
            return 0
        return _align(self.scale_cols * self.scale_dtype.itemsize, 4)

    def check(self) -> str | None:
        if self.data_bytes % 4:
            return (f"hidden ({self.hidden}) must make whole 4-byte words of data (a multiple "
                    f"of 4 does for every recipe)")
        return None


@dataclass(frozen=True)
class HTShape:
    """What sizes the HT arena: the run's worst case and the wire row format (bytes per row of
    data and of scales, each a multiple of 4)."""

    world: int
    max_tokens: int
    hidden: int
    top_k: int
    num_local_experts: int
    data_bytes: int
    scale_bytes: int

    @property
    def row_words(self) -> int:
        """Words per arena row, 128-byte aligned (only data + scale words travel): an
        ht_gather GEMM loads each K block of a row from one cache line."""
        return _align(self.data_bytes + self.scale_bytes, 128) // 4

    @property
    def meta_words(self) -> int:
        return _align(1 + 3 * self.top_k, 4)

    @property
    def count_words(self) -> int:
        """n, pairs per local expert, the sender's CTAs and slots per chunk (its chunk -> CTA
        and round map: a receive follows the sender's, whatever its own options)."""
        return _align(3 + self.num_local_experts, 4)

    @property
    def sum_block(self) -> int:
        """Tokens per landing counter of the combine (`ht_csum`) and per step of its sum: 32 /
        W on GPU (at least 4: the sum's tile), 64 under the interpreter. Every rank derives
        the same value (a pusher indexes its source's counters with it)."""
        return 64 if INTERPRET else max(4, 32 // self.world)

    @property
    def sum_blocks(self) -> int:
        return (max(1, self.max_tokens) + self.sum_block - 1) // self.sum_block

    def layout(self) -> ArenaLayout:
        w, t = self.world, max(1, self.max_tokens)
        return ArenaLayout.build(w, [
            ("ht_rows", 2 * w * t * self.row_words * 4),
            ("ht_meta", 2 * w * t * self.meta_words * 4),
            ("ht_counts", 2 * w * self.count_words * 4),
            ("ht_prog", w * MAX_SEND_CTAS * 8),
            ("ht_cdone", w * t * 4),
            ("ht_csum", 2 * w * self.sum_blocks * 4),
            ("ht_comb", 2 * w * t * self.hidden * 2)])


def max_rows(shape: HTShape, alignment: int) -> int:
    """Worst-case M: every rank's tokens here, each on min(K, E_L) local experts, every group
    padded (no host sync needed to size the layout)."""
    pairs = shape.world * shape.max_tokens * min(shape.top_k, shape.num_local_experts)
    a = alignment
    return max(a, (pairs + shape.num_local_experts * (a - 1) + a - 1) // a * a)
