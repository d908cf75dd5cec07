"""Tuning knobs of the symm backends (a frozen dataclass; no environment variables)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from epmoe.kernels._common import INTERPRET


@dataclass(frozen=True)
class SymmOptions:
    """num_sms     CTAs of every persistent kernel that writes to peers (<= the GPU's SMs);
                0 = the backend's default: symm-ht 24 (DeepEP's budget: the rest stay with
                the GEMMs the sends overlap), symm-ll every SM (decode: nothing to overlap,
                and its cost is per-CTA latency, so more CTAs mean fewer steps each)
    recv_sms    CTAs of the receive halves (after their wait they only copy within this GPU:
                the layout rows of the HT dispatch, the sums of both combines); 0 = every SM
                when num_sms is the default (a local copy like the permute it replaces),
                else num_sms
    tile_tokens tokens (rows) per CTA step in every kernel; 0 = each kernel's default (a
                tuning knob for the benchmark's sweep)
    chunk_cols  columns per work item of the reducing kernels (both combines; a power of two);
                0 = 1024 on GPU, the whole row under the interpreter
    num_warps   warps per CTA of every kernel on GPU (a power of two); 0 = 16 (1 when
                interpreting)
    timeout_s   bound of every spin-wait; a timeout raises naming rank, peer and phase (under
                the interpreter it bounds polls: 1000 per second)
    first_timeout_s  the bound instead in each op's first call on an arena, on GPU (when it is
                longer): a peer may still be compiling its kernels, or the experts' GEMMs
                between dispatch and combine (Triton, DeepGEMM's JIT) for the first time
    exact_rows  symm-ht: sync once after the receive and return only the used rows (M exact)
                instead of the worst-case row count (no host sync, CUDA-graph safe)
    pipelined   symm-ht dispatch as one kernel whose first CTAs send and the rest receive,
                placing each chunk in the layout as it lands (the layout writes overlap the
                link), and its combine as one kernel whose last CTAs sum each token block
                as its rows land; None = on for real ranks, off in the loopback world run
                rank by rank (a receive there would wait for a send launched after it)
    chunk_rows  symm-ht dispatch: slots per chunk (the unit a receive waits for; a power of
                two); 0 = 16 on GPU, 4 when interpreting (several rounds in small tests)
    ll_dedup    symm-ll dispatch: send a token once per destination rank into a staging
                region, the receive (every SM) copying it into its experts' rows (a quarter
                of the link bytes at ep 2 with top-8), instead of one row per (token, expert)
                straight into the peers' masked layout (DeepEP LL's way, the default: on one
                H200 the staged copy costs 2-8 us more; not yet measured on a link)
    ll_gather   with ll_dedup: the receive copies no row; the masked batch is the staged
                rows with an index (`MaskedBatch.rows_EC`) that the experts' GEMM reads
                through (Triton experts)
    ht_gather   symm-ht dispatch: the receive writes each layout row's index into the rows
                that landed in the arena (its own rows copied there once) instead of the
                rows themselves; the batch is those rows with the index
                (`LayoutBatch.rows_M`) that the experts' GEMM1 reads through (Triton experts,
                every recipe). The batch then views the arena: valid until this rank's
                combine_send of the next dispatch
    """

    num_sms: int = 0
    recv_sms: int = 0
    tile_tokens: int = 0
    chunk_cols: int = 0
    num_warps: int = 0
    timeout_s: float = 10.0
    first_timeout_s: float = 120.0
    exact_rows: bool = False
    pipelined: bool | None = None
    chunk_rows: int = 0
    ll_dedup: bool = False
    ll_gather: bool = False
    ht_gather: bool = False

    def __post_init__(self):
        if self.ll_gather and not self.ll_dedup:
            raise ValueError("ll_gather reads the staged rows of ll_dedup: turn ll_dedup on "
                             "too (ll_dedup=1)")
        if self.num_sms < 0:
            raise ValueError(f"num_sms ({self.num_sms}) must be >= 0 (0: the backend's "
                             f"default)")
        if self.recv_sms < 0 or self.tile_tokens < 0:
            raise ValueError(f"recv_sms ({self.recv_sms}) and tile_tokens ({self.tile_tokens}) "
                             f"must be >= 0 (0: the default)")
        if self.chunk_cols < 0 or self.chunk_cols & (self.chunk_cols - 1):
            raise ValueError(f"chunk_cols ({self.chunk_cols}) must be 0 (the default) or a "
                             f"power of two")
        if self.num_warps < 0 or self.num_warps & (self.num_warps - 1) or self.num_warps > 32:
            raise ValueError(f"num_warps ({self.num_warps}) must be 0 (the default) or a power "
                             f"of two <= 32")
        if self.chunk_rows < 0 or self.chunk_rows & (self.chunk_rows - 1):
            raise ValueError(f"chunk_rows ({self.chunk_rows}) must be 0 (the default) or a "
                             f"power of two")
        if not (self.timeout_s > 0 and self.first_timeout_s > 0):
            raise ValueError(f"timeout_s ({self.timeout_s}) and first_timeout_s "
                             f"({self.first_timeout_s}) must be > 0")

    def for_call(self, first: bool) -> "SymmOptions":
        """The options of one call: a first call on GPU waits up to first_timeout_s."""
        if first and not INTERPRET and self.first_timeout_s > self.timeout_s:
            return replace(self, timeout_s=self.first_timeout_s)
        return self

    @property
    def spin_limit(self) -> int:
        """The kernels' `limit`: nanoseconds of %globaltimer on GPU, polls when interpreting."""
        return max(1, int(self.timeout_s * 1000)) if INTERPRET else int(self.timeout_s * 1e9)

    def tile(self, default: int) -> int:
        """Tokens per CTA step: the override, else `default` (64 under the interpreter: its
        cost is per program step, not per element)."""
        return 64 if INTERPRET else (self.tile_tokens or default)


    def chunk_rows_or_default(self) -> int:
        """Slots per symm-ht dispatch chunk: the override, else 16 (4 when interpreting)."""
        return self.chunk_rows or (4 if INTERPRET else 16)

    def chunk(self, row: int) -> int:
        """Columns per work item of a reducing kernel for rows of `row` columns."""
        from epmoe.comm.symm.tiles import chunk_cols  # noqa: PLC0415

        return min(self.chunk_cols, chunk_cols(row)) if self.chunk_cols else chunk_cols(row)


    def warps(self) -> int:
        """Warps per CTA: the override on GPU, else `tiles.warps()`."""
        from epmoe.comm.symm.tiles import warps  # noqa: PLC0415

        return self.num_warps if self.num_warps and not INTERPRET else warps()


class BoundOptions:
    """A symm backend's `options`: replacing them binds its kernels again (`_bind`: launchers,
    grids and constants are built from the options once, `epmoe.kernels.launcher`)."""

    _options: SymmOptions

    def _bind(self) -> None:
        raise NotImplementedError

    @property
    def options(self) -> SymmOptions:
        return self._options

    @options.setter
    def options(self, options: SymmOptions) -> None:
        self._options = options
        if hasattr(self, "arena"):  # replaced after construction: bind the kernels again
            self._bind()


# the knobs that leave rows for an expert GEMM reading them through an index (the Triton
# experts), and the backend each tunes
GATHER_KNOBS = {"ll_gather": "symm-ll", "ht_gather": "symm-ht"}

_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def parse_knobs(items) -> tuple[tuple[str, object], ...]:
    """["ll_dedup=1", "num_sms=32", ...] (a launcher's --comm-option) -> ((knob, typed value),
    ...), checked by building the SymmOptions they describe; ValueError names the bad item
    and the knobs there are."""
    types = {f.name: str(f.type) for f in fields(SymmOptions)}
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not sep or key not in types:
            raise ValueError(f"comm option {item!r}: expected KNOB=VALUE with KNOB one of "
                             f"{', '.join(types)} (SymmOptions)")
        kind = types[key]
        try:
            if kind.startswith("bool"):
                if text.lower() not in _TRUE + _FALSE:
                    raise ValueError
                value: object = text.lower() in _TRUE
            else:
                value = float(text) if kind == "float" else int(text)
        except ValueError:
            raise ValueError(f"comm option {item!r}: {key} takes a value of type "
                             f"{kind.split()[0]}") from None
        out[key] = value
    try:
        SymmOptions(**out)  # its own range checks
    except ValueError as exc:
        raise ValueError(f"comm options {', '.join(items)}: {exc}") from None
    return tuple(out.items())


HT_SMS = 24  # symm-ht's default CTAs for the halves that write to peers
LL_SMS = 0  # symm-ll's: every SM
CPU_PROGRAMS = 24  # "every SM" under the interpreter (programs run one after another)


def device_sms(device) -> int | None:
    """SMs of a CUDA device; None under the interpreter / on CPU."""
    import torch  # noqa: PLC0415

    dev = torch.device(device)
    if dev.type == "cuda" and not INTERPRET:
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return None


def grid(opts: SymmOptions, device, recv: bool = False, send_default: int = HT_SMS) -> int:
    """Persistent grid size, capped by the device's SMs. Send halves: num_sms, else
    `send_default` (0: every SM); receive halves: recv_sms, else num_sms when given, else every
    SM (see SymmOptions). Under the interpreter "every SM" is CPU_PROGRAMS."""
    sms = device_sms(device)
    every = sms or CPU_PROGRAMS
    n = (opts.recv_sms or opts.num_sms or every) if recv else \
        (opts.num_sms or send_default or every)
    return min(n, sms) if sms else n
