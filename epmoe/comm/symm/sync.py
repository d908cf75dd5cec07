"""Device-side synchronisation shared by the symm kernels (every helper is `@triton.jit`).

Publication: all threads store, `tl.debug_barrier()` (CTA barrier), then one
`fence.acq_rel.sys` and a relaxed system-scope store per peer (`publish`: the PTX memory
model's release pattern, a fence followed by strong writes; one fence per publication instead
of one release atomic per peer, ~0.3 us each on H200). Waiting: acquire polls at system
scope (`wait_geq`), bounded: after `limit` (nanoseconds of %globaltimer on GPU, polls under
the interpreter, which has no inline asm) the first timeout writes (phase, peer, seen,
expected) to the arena's error record and every later wait gives up at once, so a missing
peer never hangs a rank; Python raises from the record.
Flags hold epochs (monotonic call numbers kept on the device), so nothing is reset between
calls and a CUDA graph replays them correctly.
Kernels whose peers spin on them never specialize on a value that differs between ranks or
calls (`me`, token counts, `limit`: `do_not_specialize`): Triton compiles a variant per int
equal to 1 or multiple of 16, and a rank compiling one mid-run stalls its peers' spins past
their bound.
"""

from __future__ import annotations

from epmoe.kernels._common import INTERPRET

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epmoe.comm.symm import arena as _a  # noqa: E402

USE_TIMER = not INTERPRET  # %globaltimer on GPU; poll counts under the interpreter
ON_GPU = tl.constexpr(not INTERPRET)  # inline PTX compiles (the interpreter has none)
# control-block word indices as constexprs (jit code reads only constexpr globals)
C_SEQ = tl.constexpr(_a.CTRL_SEQ)
C_DONE_SEND = tl.constexpr(_a.CTRL_DONE_SEND)
C_DONE_RECV = tl.constexpr(_a.CTRL_DONE_RECV)
C_ERR = tl.constexpr(_a.CTRL_ERR)
C_READY = tl.constexpr(_a.CTRL_READY)
C_SEQ_SEND = tl.constexpr(_a.CTRL_SEQ_SEND)
C_ROLE = tl.constexpr(_a.CTRL_ROLE)
C_NUM_OPS = tl.constexpr(_a.NUM_OPS)
CTA_THREADS = tl.constexpr(1024)  # the most threads a CTA has (32 warps): one value each
TIMER_POLLS = tl.constexpr(16)  # polls between two readings of the timer (a CTA reduction)


@triton.jit
def ctrl_ptr(base_ptr, word):
    """int32 pointer to control word `word` of the arena at `base_ptr` (uint8)."""
    return base_ptr.to(tl.pointer_type(tl.int32)) + word


@triton.jit
def peer_ptr(arena_ptr, peer_delta_ptr, d):
    """uint8 pointer to rank d's arena base (NVLink peer view, or a loopback row)."""
    delta = tl.load(peer_delta_ptr + d)
    return arena_ptr + tl.multiple_of(delta, 128)


@triton.jit
def peer_bases(arena_ptr, peer_delta_ptr, W: tl.constexpr):
    """(uint8 pointers to every rank's arena base as one vector of next_power_of_2(W) lanes,
    the lanes): one load for all peers. A loop of `peer_ptr` loads after stores would take a
    memory round trip per peer, since no load is hoisted above a store."""
    dd = tl.arange(0, triton.next_power_of_2(W))
    delta = tl.load(peer_delta_ptr + dd, mask=dd < W, other=0)
    return arena_ptr + (delta // 128) * 128, dd  # (x // 128) * 128: known aligned


@triton.jit
def ld_acquire(p):
    return tl.atomic_add(p, 0, sem="acquire", scope="sys")


@triton.jit
def fence_release():
    """fence.acq_rel.sys in every thread (on GPU; the interpreter runs programs one after
    another): with a strong write after it, the release pattern of the PTX memory model."""
    if ON_GPU:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def signal(p, value, mask):
    """A relaxed system-scope store of `value` where `mask` (strong: after `fence_release`, a
    release); p may be a vector of pointers (one store per lane, all in flight together)."""
    tl.atomic_xchg(p, value, mask=mask, sem="relaxed", scope="sys")


@triton.jit
def _now(USE_TIMER: tl.constexpr):
    """This thread's %globaltimer (GPU; threads read it a few ns apart)."""
    if USE_TIMER:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        t = tl.zeros((), dtype=tl.int64)
    return t


@triton.jit
def _cta_any(x):
    """1 if the int32 `x` is nonzero in any thread of the CTA, the same answer in every thread
    (a reduction over one element per thread)."""
    return tl.max(tl.zeros((CTA_THREADS,), dtype=tl.int32) + x, axis=0)


@triton.jit
def wait_geq(flag, target, arena_ptr, phase, peer, limit, USE_TIMER: tl.constexpr):
    """Spin until *flag >= target (acquire, sys scope). -> 1 if reached, 0 after a timeout
    (recorded once in the arena's error record) or when an earlier timeout was recorded.

    Every value the loop decides on is the same in all threads of the CTA, so the CTA leaves
    it as one: scalar atomics are done by one thread and broadcast through shared memory
    behind a barrier, and the timeout is the CTA's (`_cta_any` over each thread's timer, every
    TIMER_POLLS polls). A timeout decided per thread split the warps at the bound, some
    leaving, some polling again; the barriers of the atomics that followed then paired up
    wrongly (on a lent H200 the receive after a timed-out call read garbage counts and wrote
    ~4 GB out of bounds: tests/test_symm_gpu_faults.py)."""
    err = ctrl_ptr(arena_ptr, C_ERR)
    v = ld_acquire(flag)
    ok = (v >= target).to(tl.int32)
    if ok == 0:
        bad = ld_acquire(err)
        t0 = _now(USE_TIMER)
        polls = tl.zeros((), dtype=tl.int64)
        while (v < target) & (bad == 0):
            v = ld_acquire(flag)
            polls += 1
            late = tl.zeros((), dtype=tl.int32)
            if USE_TIMER:
                if polls % TIMER_POLLS == 0:
                    late = _cta_any(((_now(USE_TIMER) - t0) > limit).to(tl.int32))
            else:
                late = (polls > limit).to(tl.int32)
            if (late != 0) & (v < target):
                if tl.atomic_cas(err, 0, 1, sem="acq_rel", scope="sys") == 0:
                    tl.store(err + 1, phase)
                    tl.store(err + 2, peer)
                    tl.store(err + 3, v)
                    tl.store(err + 4, target)
                bad = 1
        ok = (v >= target).to(tl.int32)
    return ok


@triton.jit
def ld_acquire_all(p):
    """Acquire loads at system scope of a vector of int32 pointers, in every thread that holds
    a lane (inline PTX; a tensor atomic would run in one thread per lane and leave the others
    without its value). On GPU only."""
    return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [p],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_all(arena_ptr, first_word, target, phase, limit, W: tl.constexpr,
             USE_TIMER: tl.constexpr):
    """wait_geq on W consecutive control words (one per peer). -> 1 if all reached. On GPU
    one vector of acquire loads first: when every word is there already (a send's acks, as
    a rule), one memory round trip instead of W in a chain."""
    ok = tl.full((), 0, dtype=tl.int32)
    if ON_GPU:
        dd = tl.arange(0, triton.next_power_of_2(W))  # lanes past W read word W-1 again
        v = ld_acquire_all(ctrl_ptr(arena_ptr, first_word) + tl.minimum(dd, W - 1))
        ok = tl.min(tl.where(dd < W, v >= target, True).to(tl.int32), axis=0)
    if ok == 0:
        ok = tl.full((), 1, dtype=tl.int32)
        for d in tl.static_range(W):
            ok = ok & wait_geq(ctrl_ptr(arena_ptr, first_word + d), target, arena_ptr, phase,
                               d, limit, USE_TIMER)
    return ok


@triton.jit
def arrive_last(arena_ptr, done_word, num_ctas):
    """CTA barrier, then count this CTA in; -> 1 in the last CTA to arrive (which resets the
    counter). Everything the other CTAs did happens before the last CTA's later releases.

    The count is an acq_rel atomic at *GPU* scope: every CTA that counts in runs on this GPU.
    What the other CTAs stored to peers reaches them through the last CTA's release at system
    scope (`publish`: PTX fences are cumulative and causality order is transitive across
    scopes), which every caller does before a peer may look."""
    tl.debug_barrier()
    done = ctrl_ptr(arena_ptr, done_word)
    old = tl.atomic_add(done, 1, sem="acq_rel", scope="gpu")
    last = (old == num_ctas - 1).to(tl.int32)
    if last != 0:
        tl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def epoch(arena_ptr, OP: tl.constexpr):
    """This call's epoch for op OP: calls completed on this rank + 1."""
    return tl.load(ctrl_ptr(arena_ptr, C_SEQ + OP)) + 1


@triton.jit
def wait_acks(arena_ptr, OP: tl.constexpr, target, limit, W: tl.constexpr,
              USE_TIMER: tl.constexpr):
    """Send half: every peer consumed (released) my buffer up to epoch `target`."""
    return wait_all(arena_ptr, C_READY + C_NUM_OPS * W + OP * W, target, 2 * OP, limit, W,
                    USE_TIMER)


@triton.jit
def wait_ready(arena_ptr, OP: tl.constexpr, target, limit, W: tl.constexpr,
               USE_TIMER: tl.constexpr):
    """Receive half: every source published epoch `target` to me."""
    return wait_all(arena_ptr, C_READY + OP * W, target, 2 * OP + 1, limit, W, USE_TIMER)


@triton.jit
def publish(arena_ptr, delta_ptr, word, value, W: tl.constexpr):
    """Release `value` into control word `word` of every rank (after the caller's CTA
    barrier; skipped after a timeout: the peers then time out too, naming this rank)."""
    peers, dd = peer_bases(arena_ptr, delta_ptr, W)  # in flight with no_error's load
    if no_error(arena_ptr) != 0:
        fence_release()
        signal(ctrl_ptr(peers, word), value, dd < W)


@triton.jit
def publish2(arena_ptr, delta_ptr, word_a, value_a, word_b, value_b, W: tl.constexpr):
    """`publish` of two words under one fence (neither needs to be seen before the other)."""
    peers, dd = peer_bases(arena_ptr, delta_ptr, W)
    if no_error(arena_ptr) != 0:
        fence_release()
        signal(ctrl_ptr(peers, word_a), value_a, dd < W)
        signal(ctrl_ptr(peers, word_b), value_b, dd < W)


@triton.jit
def finish_send(arena_ptr, delta_ptr, OP: tl.constexpr, e, me, W: tl.constexpr):
    """Last CTA of a send half that counts its own calls (`send_epoch`): send_seq[OP] = e
    here, ready[OP][me] = e at every rank."""
    if arrive_last(arena_ptr, C_DONE_SEND + OP, tl.num_programs(0)) != 0:
        tl.store(ctrl_ptr(arena_ptr, C_SEQ_SEND + OP), e)
        publish(arena_ptr, delta_ptr, C_READY + OP * W + me, e, W)


@triton.jit
def finish_recv(arena_ptr, delta_ptr, OP: tl.constexpr, e, me, W: tl.constexpr):
    """Last CTA of a receive half: seq[OP] = e here, ack[OP][me] = e at every rank."""
    finish_recv_of(arena_ptr, delta_ptr, OP, e, me, W, tl.num_programs(0))


@triton.jit
def finish_recv_of(arena_ptr, delta_ptr, OP: tl.constexpr, e, me, W: tl.constexpr, n):
    """`finish_recv` for a receive half of `n` CTAs (a role of a larger grid)."""
    if arrive_last(arena_ptr, C_DONE_RECV + OP, n) != 0:
        end_call(arena_ptr, delta_ptr, OP, e, me, W)


@triton.jit
def end_call(arena_ptr, delta_ptr, OP: tl.constexpr, e, me, W: tl.constexpr):
    """In the last CTA of a call's receive (after every other CTA of it arrived): seq[OP] = e
    here, ack[OP][me] = e at every rank (each may refill its buffer of epoch e)."""
    tl.store(ctrl_ptr(arena_ptr, C_SEQ + OP), e)
    publish(arena_ptr, delta_ptr, C_READY + C_NUM_OPS * W + OP * W + me, e, W)


@triton.jit
def send_epoch(arena_ptr, OP: tl.constexpr):
    """The epoch of a send half that counts its own calls (send_seq + 1, stored by its last
    CTA: `ht_send.finish_send_rows`)."""
    return tl.load(ctrl_ptr(arena_ptr, C_SEQ_SEND + OP)) + 1


@triton.jit
def take_role(arena_ptr, OP: tl.constexpr, n):
    """-> this CTA's arrival index among the `n` CTAs of a running kernel (0 = first to run).
    A kernel that splits its CTAs into roles by arrival gives the first roles to CTAs that
    are running, whatever order the hardware starts them in: a role that others wait for
    never waits for a free SM. The last to arrive resets the counter for the next launch."""
    p = ctrl_ptr(arena_ptr, C_ROLE + OP)
    i = tl.atomic_add(p, 1, sem="relaxed", scope="gpu")
    if i == n - 1:
        tl.atomic_xchg(p, 0, sem="relaxed", scope="gpu")
    return i


@triton.jit
def no_error(arena_ptr):
    """1 while no timeout has been recorded in this arena."""
    return (ld_acquire(ctrl_ptr(arena_ptr, C_ERR)) == 0).to(tl.int32)  # uniform in the CTA


__all__ = ["epoch", "wait_acks", "wait_ready", "publish", "publish2", "fence_release",
           "finish_send", "finish_recv", "finish_recv_of", "end_call",
           "send_epoch",
           "take_role",
           "no_error", "C_SEQ", "C_DONE_SEND", "C_DONE_RECV", "C_ERR", "C_READY", "ctrl_ptr",
           "peer_ptr", "peer_bases", "ld_acquire", "signal", "wait_geq", "wait_all", "arrive_last",
           "USE_TIMER"]
