"""EPLB weight migration: the plan (pure) and `migrate_layer` on gloo ranks, bit-exact against
`synthetic_layer` built for each slot's new logical expert, with checksum failure detection."""

from __future__ import annotations

import random

import pytest
import torch

from epmoe.config import QuantConfig, get_preset
from epmoe.eplb.migrate import Transfer, migrate_layer, plan_migration, slot_checksums
from epmoe.weights import synthetic_layer
from epmoe.ranks import run_ranks

CFG = get_preset("deepseek-v3-tiny")  # 16 experts, hidden 256, intermediate 128
LAYER, SEED = 1, 3


# ---------------------------------------------------------------------------------- plan


def random_placement(num_experts: int, num_slots: int, rng: random.Random) -> list[int]:
    """Every logical expert at least once, the extra slots random replicas, shuffled."""
    p = list(range(num_experts)) + [rng.randrange(num_experts)
                                    for _ in range(num_slots - num_experts)]
    rng.shuffle(p)
    return p


@pytest.mark.parametrize("world,slots", [(1, 16), (2, 20), (4, 20), (4, 32), (8, 24)])
def test_plan_moves_only_changed_slots_and_prefers_local_sources(world, slots, seed):
    rng = random.Random(seed)
    per = slots // world
    for trial in range(20):
        old, new = random_placement(16, slots, rng), random_placement(16, slots, rng)
        plan = plan_migration(old, new, world)
        changed = [s for s in range(slots) if old[s] != new[s]]
        assert sorted(t.dst_slot for t in plan) == changed, f"{seed=} {trial=}"
        for t in plan:
            assert t.expert == new[t.dst_slot] == old[t.src_slot]
            assert (t.src, t.dst) == (t.src_slot // per, t.dst_slot // per)
            local = [s for s in range(t.dst * per, (t.dst + 1) * per) if old[s] == t.expert]
            if local:  # a copy on the same rank, never a transfer
                assert t.src == t.dst and t.src_slot == local[0], f"{seed=} {t=} {local=}"
            else:  # the lowest slot (hence rank) that held it
                assert t.src_slot == old.index(t.expert), f"{seed=} {t=}"


def test_plan_identity_is_empty_and_examples():
    old = [0, 1, 2, 3, 0, 1, 2, 3]
    assert plan_migration(old, list(old), 4) == []
    # rank 1 (slots 2,3) swaps its slots: both are local copies
    assert plan_migration(old, [0, 1, 3, 2, 0, 1, 2, 3], 4) == [
        Transfer(3, 3, 2, 1, 1), Transfer(2, 2, 3, 1, 1)]
    # rank 3 (slots 6,7) wants expert 0: not local there, from slot 0 (rank 0)
    assert plan_migration(old, [0, 1, 2, 3, 0, 1, 2, 0], 4) == [Transfer(0, 0, 7, 0, 3)]
    # slot 4 (rank 2) wants expert 1: rank 2's slot 5 holds it, a local copy
    assert plan_migration(old, [0, 1, 2, 3, 1, 1, 2, 3], 4) == [Transfer(1, 5, 4, 2, 2)]
    # slot 4 (rank 2) wants expert 3: not on rank 2, slot 3 (rank 1) is the lowest holder
    assert plan_migration(old, [0, 1, 2, 3, 3, 1, 2, 3], 4) == [Transfer(3, 3, 4, 1, 2)]


def test_plan_rejects_bad_shapes_and_unsourced_experts():
    with pytest.raises(ValueError, match=r"equal slot counts divisible by world \(6, 6, world 4\)"):
        plan_migration([0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1, 2], 4)
    with pytest.raises(ValueError, match=r"equal slot counts"):
        plan_migration([0, 1, 2, 3], [0, 1, 2], 1)
    with pytest.raises(ValueError, match="logical expert 4 has no replica in the old placement"):
        plan_migration([0, 1, 2, 3], [0, 1, 2, 4], 2)


# ---------------------------------------------------------------------------------- migrate


def _layer_weights(quant: QuantConfig, logical: list[int], model: str = CFG.name):
    return synthetic_layer(get_preset(model), quant, LAYER, SEED, logical,
                           with_shared=False).experts


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def _slot_mismatches(w, logical: list[int], quant: QuantConfig,
                     model: str = CFG.name) -> list[str]:
    """Slots whose data, scales or biases differ (bit-wise) from their logical expert's
    synthetic weights."""
    ref = _layer_weights(quant, logical, model)
    bad = []
    for name in ("b13", "b2"):
        got, want = getattr(w, name), getattr(ref, name)
        assert (got is None) == (want is None)
        bad += [f"slot {i} {name}" for i in range(len(logical))
                if got is not None and not torch.equal(got[i], want[i])]
    for name in ("w13", "w2"):
        got_q, ref_q = getattr(w, name), getattr(ref, name)
        for part in ("data", "scale"):
            got, want = getattr(got_q, part), getattr(ref_q, part)
            assert (got is None) == (want is None)
            if got is None:
                continue
            for i in range(len(logical)):
                if not torch.equal(_bytes(got[i]), _bytes(want[i])):
                    bad.append(f"slot {i} {name}.{part}")
    return bad


def _exact_case(rank, world, group, recipe, model, old, new):
    quant = QuantConfig(recipe)
    per = len(old) // world
    mine = slice(rank * per, (rank + 1) * per)
    w = _layer_weights(quant, old[mine], model)
    assert w.w13.scale is not None
    assert (w.b2 is not None) == get_preset(model).expert_bias
    assert not _slot_mismatches(w, old[mine], quant, model)
    before = slot_checksums(w).clone()
    moved = migrate_layer(w, old, new, rank, world, group)
    return dict(moved=moved, bad=_slot_mismatches(w, new[mine], quant, model),
                still_old=not _slot_mismatches(w, old[mine], quant, model),
                sums_changed=bool((slot_checksums(w) != before).any()))


def _corrupt_case(rank, world, group, mode, old, new):
    """'stale': rank 1's local slot 0 (global 5, an unchanged replica) holds wrong bytes before
    the migration; 'wire': rank 3 flips one byte of the first buffer it receives."""
    import torch.distributed as dist

    quant = QuantConfig("fp8_block")
    per = len(old) // world
    w = _layer_weights(quant, old[rank * per:(rank + 1) * per])
    real = dist.batch_isend_irecv
    if mode == "stale" and rank == 1:
        w.w2.scale[0].view(-1)[0] *= 2
    if mode == "wire" and rank == 3:
        def corrupting(ops):
            for req in real(ops):
                req.wait()
            recvs = [op.tensor for op in ops if op.op is dist.irecv]
            recvs[0].view(-1)[0] ^= 0x10
            return []

        dist.batch_isend_irecv = corrupting
    try:
        migrate_layer(w, old, new, rank, world, group)
    except RuntimeError as e:
        return str(e)
    finally:
        dist.batch_isend_irecv = real
    return None


def _all_cases(rank, world, group, exact_cases, corrupt_cases):
    """One spawn of 4 ranks for every multi-rank case (spawning costs ~20 s on 2 cores)."""
    out = {}
    for name, (recipe, model, old, new) in exact_cases.items():
        out[name] = _exact_case(rank, world, group, recipe, model, old, new)
    for mode, (old, new) in corrupt_cases.items():
        out[mode] = _corrupt_case(rank, world, group, mode, old, new)
    return out


WORLD, SLOTS = 4, 20
OLD = [s % 16 for s in range(SLOTS)]
# rank 1 (slots 5..9) holds a second replica of expert 0 at slot 5 that stays put; rank 1 swaps
# two slots locally; rank 3's slot 17 receives expert 4 from rank 0 (slot 4).
CORRUPT_OLD = [0, 1, 2, 3, 4, 0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 1, 2, 3]
CORRUPT_NEW = [0, 1, 2, 3, 4, 0, 5, 6, 8, 7, 9, 10, 11, 12, 13, 14, 15, 4, 2, 3]


def _exact_new(seed: int) -> list[int]:
    new = random_placement(16, SLOTS, random.Random(seed))
    new[0] = OLD[0]  # an unchanged slot
    new[6], new[7] = OLD[7], OLD[6]  # a swap inside rank 1
    return new


@pytest.fixture(scope="module")
def migrated():
    seed = random.randrange(1 << 30)
    # gpt-oss-tiny: 16 experts like CFG, plus expert biases (they migrate with the slot)
    exact = {name: (r, m, OLD, _exact_new(seed + i)) for i, (name, r, m) in enumerate(
        (("fp8_block", "fp8_block", CFG.name), ("mxfp8", "mxfp8", CFG.name),
         ("mxfp8-gpt-oss", "mxfp8", "gpt-oss-tiny")))}
    corrupt = {"stale": (CORRUPT_OLD, CORRUPT_NEW), "wire": (CORRUPT_OLD, CORRUPT_NEW)}
    res = run_ranks(_all_cases, WORLD, exact, corrupt, timeout=240)
    return seed, exact, res


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8", "mxfp8-gpt-oss"])
def test_migrate_layer_bit_exact_on_4_ranks(migrated, recipe):
    seed, exact, res = migrated
    _, _, old, new = exact[recipe]
    print(f"{recipe=} {seed=} {new=}")
    plan = plan_migration(old, new, WORLD)
    assert any(t.src != t.dst for t in plan) and any(t.src == t.dst for t in plan)
    per = SLOTS // WORLD
    for r, out in enumerate(res):
        out = out[recipe]
        assert out["bad"] == [], f"rank {r}: {out['bad']} ({seed=})"
        if old[r * per:(r + 1) * per] != new[r * per:(r + 1) * per]:
            assert not out["still_old"] and out["sums_changed"], f"rank {r} kept stale weights"
        assert out["moved"] == len(plan)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_migrate_layer_checksum_detects_stale_and_corrupt_slots(migrated):
    plan = plan_migration(CORRUPT_OLD, CORRUPT_NEW, WORLD)
    assert 5 not in [t.dst_slot for t in plan]
    assert Transfer(4, 4, 17, 0, 3) in plan
    stale = [r["stale"] for r in migrated[2]]
    assert stale[0] is None and stale[2] is None and stale[3] is None, stale
    assert stale[1] is not None, "a stale replica slot went undetected"
    assert "rank 1 slot 5" in stale[1] and "logical expert 0" in stale[1]
    assert "stale or corrupt slot" in stale[1]
    wire = [r["wire"] for r in migrated[2]]
    assert wire[:3] == [None, None, None], wire
    assert wire[3] is not None, "a byte corrupted in flight went undetected"
    assert "rank 3 slot 17" in wire[3] and "logical expert 4" in wire[3]


def test_migrate_layer_one_rank_bf16_and_identity(seed):
    quant = QuantConfig("bf16")
    rng = random.Random(seed)
    old = [s % 16 for s in range(24)]
    new = random_placement(16, 24, rng)
    w = _layer_weights(quant, old)
    assert migrate_layer(w, old, list(old), 0, 1) == 0
    assert not _slot_mismatches(w, old, quant)
    moved = migrate_layer(w, old, new, 0, 1)
    assert moved == sum(o != n for o, n in zip(old, new)) > 0
    assert not _slot_mismatches(w, new, quant), f"{seed=} {new=}"
