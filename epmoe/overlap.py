"""Overlap inside one MoE layer on one rank (CUDA streams; on CPU the same calls in order).

shared experts   on their own side stream, concurrently with dispatch -> experts -> combine
                 (forked after the input is ready, joined before the sum)
micro-batches    the tokens split in two; dispatch/combine on a comm stream, experts on the
                 compute stream, so one half's communication overlaps the other half's GEMMs:

    comm:     dispatch0 ─┐  dispatch1 ─┐      combine0      combine1
    compute:             └► experts0 ──┼──────┘ experts1 ───┘
                                        └──────►

Cross-stream rules: every wait is an event recorded where the producer was issued (never a
whole-stream wait that would also wait for later work); every tensor read on a stream other
than the one that allocated it is `record_stream`-ed there, so the caching allocator cannot
hand its memory out while that stream may still read it.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch


def tensors_of(obj):
    """Every tensor inside obj (tensors, dataclasses, tuples/lists/dicts, nested)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_of(getattr(obj, f.name))
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors_of(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_of(o)


class LayerStreams:
    """The side streams of one layer on `device` (no streams on CPU: everything inline).

    shared  runs the shared experts;  comm  runs the micro-batches' dispatch and combine."""

    def __init__(self, device):
        device = torch.device(device)
        self.cuda = device.type == "cuda"
        self.shared = torch.cuda.Stream(device) if self.cuda else None
        self.comm = torch.cuda.Stream(device) if self.cuda else None

    @property
    def current(self):
        return torch.cuda.current_stream() if self.cuda else None

    def mark(self, stream=None):
        """An event recorded now on `stream` (default: the current one); None on CPU."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else self.current)
        return ev

    @contextlib.contextmanager
    def on(self, stream, after=None, reads=()):
        """Issue the block's work on `stream`, after event(s) `after` (default: everything issued
        so far on the current stream); `reads`: objects whose tensors the block reads."""
        if not self.cuda:
            yield
            return
        events = [after] if isinstance(after, torch.cuda.Event) else list(after or ())
        if after is None:
            events = [self.mark()]
        for ev in events:
            stream.wait_event(ev)
        for t in tensors_of(reads):
            t.record_stream(stream)
        with torch.cuda.stream(stream):
            yield

    def wait(self, event, reads=()):
        """The current stream waits for `event`; `reads`: what it will read of that work."""
        if not self.cuda or event is None:
            return
        cur = self.current
        cur.wait_event(event)
        for t in tensors_of(reads):
            t.record_stream(cur)


def overlap_fraction(stage_ms: dict, step_ms: float) -> float:
    """(sum of stage times - step time) / sum of stage times: the share of the stages' time
    hidden under other stages (0: serial; negative: gaps between stages)."""
    total = float(sum(stage_ms.values()))
    return (total - step_ms) / total if total > 0 else 0.0


__all__ = ["LayerStreams", "overlap_fraction", "tensors_of"]
