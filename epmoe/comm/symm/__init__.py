"""symm: our own comm layer on symmetric memory (nvshmem4py arena + Triton kernels).

Two backends behind the comm contract (`epmoe.comm.base`):

| backend | batch       | dispatch                               | combine                     |
|---------|-------------|----------------------------------------|-----------------------------|
| symm-ht | LayoutBatch | a token goes once to each rank holding | expert rank: fp32 sum over  |
|         |             | one of its experts (dedup); counts on  | a token's local slots, one  |
|         |             | the device; the receiver writes rows   | bf16 row per (token, rank)  |
|         |             | straight into the experts' contiguous  | back; source: fp32 sum in   |
|         |             | layout (groups padded to `alignment`); | rank order, one cast        |
|         |             | or (ht_gather) the layout's index into |                             |
|         |             | the arena's rows: rows_M               |                             |
| symm-ll | MaskedBatch | per (token, k), fp8 quantized in the   | as symm-ht: the expert rank |
|         |             | send, straight into the peer's         | reduces a token's rows (the |
|         |             | [E_l, C, D] (C = W x max tokens), plus | message: rows, weights); a  |
|         |             | one message per (token, rank); or      | bf16 row per (token, rank)  |
|         |             | (ll_dedup) once per (token, rank), the |                             |
|         |             | receiver copying it into its rows (or, |                             |
|         |             | ll_gather, indexing it: rows_EC)       |                             |

    ctx = CommContext(group, rank, world, device, max_tokens_per_rank=T)   # the Runtime's
    ht = SymmHighThroughputComm(cfg, quant, expert_map_E, ctx)  # options=SymmOptions(...),
    ll = SymmLowLatencyComm(cfg, quant, expert_map_E, ctx)      # alignment=128 (ht only)
    batch, handle = ht.dispatch(x_TD, topk_ids_TK, topk_weights_TK)
    out_TD = ht.combine(experts.run(batch), handle)              # bf16 [T, D]
    ctx.close()                                                  # collective: frees arenas

Halves for overlap: `dispatch_send` / `dispatch_recv`, `combine_recv(combine_send(y, h))`.
Experts in contiguous blocks (rank r: slots [r E/W, (r+1) E/W)), one NVLink node.

## The arena (one allocation per rank and backend, identical layout on every rank)

A `CommContext` resource ("symm-arena-ht" / "symm-arena-ll"), sized from the run's worst case
(`max_tokens_per_rank`, hidden, top-k, world, local experts, recipe); every offset 128-byte
aligned. Peers are reached as `arena_ptr + peer_delta_W[d]` (byte distances: NVSHMEM peer views
from `get_peer_tensor`, taken once on the base allocation; in the loopback world the other
rows of one [W, bytes] tensor). Kernels are identical for both.

    HT arena                                  LL arena
    +--------------------------------------+  +---------------------------------------+
    | ctrl   seq[4] done[8] err[8] send_seq|  | ctrl   (same block)                   |
    |        [4] role[4]                   |  |                                       |
    |        ready[4][W] ack[4][W]         |  | ll_slots  [E_l] rows taken per expert |
    | ht_rows   [2][W][T] data|scale words |  | ll_data   [E_l][C][D] fp8 | bf16      |
    | ht_meta   [2][W][T] t, e_k, pos_k,w_k|  | ll_scale  [E_l][G][C] fp32 (C-major)  |
    | ht_counts [2][W] n, pairs/expert,G,CK|  | ll_meta   [E_l][C] (src*T + t)*K + k  |
    | ht_prog   [W][1024] i64 chunk rounds |  | ll_msg    [W][T] epoch, row_k, w_k    |
    | ht_comb   [2][W][T] bf16 [D] partial |  | ll_arow   [E_l][C] src*T + t (gather) |
    |                                      |  | ll_stage  [W][T] data|scale (ll_dedup)|
    |                                      |  | ll_comb   [2][W][T] bf16 [D] partial  |
    +--------------------------------------+  +---------------------------------------+
    [2] = buffer epoch % 2, [W] = source rank, T = max tokens per rank, C = W x T

## Synchronisation and epochs (all on the device: CUDA-graph safe)

Every op (ht-dispatch, ht-combine, ll-dispatch, ll-combine) has on each rank a call counter
`seq` in its control block; a call's epoch is seq + 1, the receive half's last CTA stores it
(symm-ll's dispatch counts its send's calls instead, `send_seq`: its receive has no last CTA).
A send half: waits until every peer's `ack[op][me]` (written by the peer into my control block)
says the buffer it is about to fill was consumed (HT: epoch - 2, double-buffered; LL dispatch:
epoch - 1, single buffer released by the peer's combine_send), stores rows, then its last CTA
(a CTA counter, acq_rel) releases `ready[op][me] = epoch` at every peer (after a CTA barrier,
`atomic_xchg` with sem=release, scope=sys). A receive half polls `ready[op][s] >= epoch` with
acquire at system scope, consumes, and its last CTA releases `ack[op][me] = epoch` at every
source. Flags are monotonic epochs: nothing is reset, no host-passed value (a CUDA graph
replays correctly). Every spin is bounded (`SymmOptions.timeout_s`: %globaltimer on GPU, polls
under the interpreter); the first timeout writes (phase, peer, flag, expected) to the arena's
error record, later waits give up at once, and `check_errors()` raises `SymmTimeoutError`
naming rank, peer and phase (the loopback driver checks after every phase; the Runtime at a
sync point it already has). Until that point a timed-out receive's outputs are well formed
and in bounds (LL: zero counts; HT: an empty layout, or the steps that never landed dropped),
so no kernel after it reads or writes out of bounds (a rank that faulted there would die and
be blamed for its peer's stall). An arena that timed out stays failed: close the context.
symm-ht's dispatch publishes finer: the counts first (ready), then after each round of
CK-slot chunks a send CTA releases `ht_prog[me][cta] = epoch << 32 | rounds` at every peer,
and the receive places each chunk once its round has landed (`ht_send.py`, `ht_recv.py`). On
real ranks both roles run in one kernel (`SymmOptions.pipelined`): its first CTAs to start
take the send role (an arrival counter, so a role others wait for is always running), the
rest receive, and the layout writes overlap the link. Its two roles count their own epochs
(send_seq, seq): the receive may finish first.
Kernels that spin run persistent grids of `num_sms` CTAs (<= the SMs; by default symm-ht 24,
symm-ll every SM); the receive halves (local copies after their wait) run `recv_sms` CTAs
(default: every SM, or num_sms when that is given). symm-ht's combine is one kernel too:
its push CTAs copy each token block as soon as its reduce CTAs finish it (done words), and
count the rows into their sources' landing counters; the source sums a block of its tokens
once every rank's rows for it have landed (in the same kernel on real ranks, in the receive's
launch in the loopback world; see `ht_combine.py`). The only CTAs that wait on CTAs of
their own grid (that push) took their role after those (arrival order), so what they wait for
is running: a CTA that is not resident yet only delays (the grid need not fit at once).
Every kernel moves whole rows per CTA step, all loads of a step before its stores (tiles.py).

## NVSHMEM in one process

The first symm arena of a process initializes NVSHMEM (UID broadcast over the context's
process group; resource "symm-nvshmem", finalized by `ctx.close()` after the arenas are
freed). DeepEP's low-latency mode initializes NVSHMEM itself: symm-* refuses to start in a
context that holds a deepep-ll buffer (a clear error); run them in separate processes (the
benchmark does). DeepEP high-throughput (CUDA IPC) coexists. Size the symmetric heap with
NVSHMEM_SYMMETRIC_SIZE when the arena is large (HT at 4096 tokens x 7168 bf16, 2 ranks:
about 0.5 GB).

Files: arena.py (layouts, loopback world, NVSHMEM arena), sync.py (device flags), route.py
(sender's routing table), ht_dispatch.py (+ ht_send.py, ht_recv.py: its roles) /
ht_combine.py, ll_dispatch.py (+ ll_send.py) / ll_combine.py, sum_back.py (symm-ll
combine's receive), tiles.py (row tiles, `ksum`), options.py (knobs), ht.py / ll.py (the
backends), loopback.py (W ranks in one process).
"""

from epmoe.comm.symm.options import SymmOptions  # noqa: F401
