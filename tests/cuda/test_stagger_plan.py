"""Staggered staged loads (pure NumPy, runs anywhere): the schedule covers every layer of every part once,
a layer's ready unit is the first after which every part holds it, and the staggered load reproduces the
host pieces layer by layer."""

import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from hicache.transfer.staged_plan import plan_group, with_slot_base
from hicache.transfer.stagger import load_schedule, stagger_schedule, way_bounds


def test_one_way_is_the_plain_grouping() -> None:
    s = stagger_schedule(32, 8, 1)
    assert [(u.layer_begin, u.n_layers) for u in s.units] == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert s.ready == [0] * 8 + [1] * 8 + [2] * 8 + [3] * 8


def test_two_ways_offset_by_half_a_group() -> None:
    s = stagger_schedule(16, 4, 2)
    assert [tuple(u) for u in s.units] == [(1, 0, 2), (0, 0, 4), (1, 2, 4), (0, 4, 4), (1, 6, 4), (0, 8, 4),
                                          (1, 10, 4), (0, 12, 4), (1, 14, 2)]
    # layers 0-1 are whole after part 0's first group (unit 1), layers 2-3 after part 1's second (unit 2)
    assert s.ready == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8]


def _max_lag(num_layers: int, per_group: int, ways: int) -> float:
    """Fluid model, compute exactly as fast as the load: layers of extra time past the load's end."""
    s = stagger_schedule(num_layers, per_group, ways)
    moved, t_unit = 0.0, []
    for u in s.units:
        moved += u.n_layers / ways
        t_unit.append(moved)
    end = 0.0
    for layer in range(num_layers):
        end = max(end, t_unit[s.ready[layer]]) + 1.0
    return end - num_layers


def test_staggering_shortens_the_wait_on_the_last_group() -> None:
    assert _max_lag(32, 8, 1) == pytest.approx(8.0)
    assert _max_lag(32, 8, 4) < 5.5
    assert _max_lag(32, 4, 4) < 2.6


@settings(max_examples=150, deadline=None)
@given(L=st.integers(1, 40), g=st.integers(1, 12), ways=st.integers(1, 6))
def test_schedule_covers_each_part_and_layer_once(L: int, g: int, ways: int) -> None:
    s = stagger_schedule(L, g, ways)
    seen = {(k, layer): 0 for k in range(ways) for layer in range(L)}
    holds: list[set[tuple[int, int]]] = []
    acc: set[tuple[int, int]] = set()
    for u in s.units:
        assert 1 <= u.n_layers <= g
        for layer in range(u.layer_begin, u.layer_begin + u.n_layers):
            seen[(u.way, layer)] += 1
            acc.add((u.way, layer))
        holds.append(set(acc))
    assert set(seen.values()) == {1}
    for k in range(ways):  # each part's groups in layer order
        begins = [u.layer_begin for u in s.units if u.way == k]
        assert begins == sorted(begins)
    for layer in range(L):  # ready: the first unit after which every part holds the layer
        r = s.ready[layer]
        assert all((k, layer) in holds[r] for k in range(ways))
        assert r == 0 or not all((k, layer) in holds[r - 1] for k in range(ways))
    assert s.ready == sorted(s.ready)


def test_schedule_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        stagger_schedule(0, 4, 1)
    with pytest.raises(ValueError):
        way_bounds(10, 0)


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 9), C=st.integers(1, 2), piece=st.sampled_from([2, 16]), n=st.integers(1, 14),
       g=st.integers(1, 4), ways=st.integers(1, 4), pages_per_slot=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_staggered_load_reproduces_host_pieces_layer_by_layer(L: int, C: int, piece: int, n: int, g: int,
                                                               ways: int, pages_per_slot: int, seed: int) -> None:
    """The engine's loop (:meth:`CudaTransferEngine._staged_load`) on NumPy arrays: after the unit
    ``ready[i]``, layer ``i`` of every page is in place."""
    rng = np.random.default_rng(seed)
    g = min(g, L)
    n_host, n_dev = n + 3, n + 2
    h = np.sort(rng.permutation(n_host)[:n]).astype(np.int64)
    d = rng.permutation(n_dev)[:n].astype(np.int64)
    host = rng.integers(0, 256, n_host * L * C * piece, dtype=np.uint8)
    hv = host.reshape(n_host, L * C, piece)
    dev = np.zeros((L * C, n_dev, piece), dtype=np.uint8)
    slot = pages_per_slot * g * C * piece
    staging = np.zeros(slot, dtype=np.uint8)
    stage_base = 1 << 40
    sched = stagger_schedule(L, g, ways)
    bounds = way_bounds(n, ways)
    for ui, u in enumerate(sched.units):
        lo, hi = bounds[u.way]
        for ch in plan_group(0, L * C * piece, piece, C, h[lo:hi], u.layer_begin, u.n_layers, slot, False, 0,
                             2 if ui == len(sched.units) - 1 else 0):
            plan = with_slot_base(ch.plan, stage_base, to_host=False)
            for dst, src, size in zip(plan.dst.tolist(), plan.src.tolist(), plan.size.tolist(), strict=True):
                staging[dst - stage_base: dst - stage_base + size] = host[src: src + size]
            base = stage_base - u.layer_begin * C * piece
            for p in range(ch.i1 - ch.i0):
                for lc in range(u.layer_begin * C, (u.layer_begin + u.n_layers) * C):
                    a = base + p * u.n_layers * C * piece + lc * piece - stage_base
                    dev[lc, d[lo + ch.i0 + p]] = staging[a: a + piece]
        for layer in range(L):
            if sched.ready[layer] == ui:
                for c in range(C):
                    assert np.array_equal(dev[layer * C + c, d], hv[h, layer * C + c]), (ui, layer, c)


_MIB = 1 << 20


@settings(max_examples=200, deadline=None)
@given(st.integers(4, 1 << 30), st.integers(1, 1 << 26), st.booleans(), st.integers(4, 64))
# loads of budgets that are multiples of LOAD_SLOT_BYTES (16 MiB) and DEFAULT_STAGING_BYTES (256 MiB), pages
# under a slot: the load side's full slots, always checked
@example(64 * _MIB, 4096, False, 4)  # 4 x LOAD_SLOT_BYTES: exactly STAGE_SLOTS slots
@example(80 * _MIB, 256 << 10, False, 4)  # 5 x
@example(16 * 16 * _MIB + 16 * _MIB, 1, False, 4)  # 17 x
@example(256 * _MIB, 256 << 10, False, 4)  # DEFAULT_STAGING_BYTES: 16 slots
@example(256 * _MIB, 16 * _MIB, False, 4)  # a page of exactly one slot
@example(3 * 256 * _MIB, 4096, False, 16)  # 3 x DEFAULT_STAGING_BYTES
@example(256 * _MIB + 16 * _MIB - 1, 4096, False, 4)  # just short of one more slot
@example(1 << 30, 1 << 24, False, 64)  # the strategy's largest budget
def test_staging_slots_stay_within_the_budget(staging: int, page: int, to_host: bool, backup_slots: int) -> None:
    from hicache.transfer.cuda_tuning import BACKUP_SLOT_BYTES, LOAD_SLOT_BYTES, STAGE_SLOTS, staging_slots

    backup_slots = min(backup_slots, staging)
    n, slot = staging_slots(staging, page, to_host, backup_slots)
    assert n >= STAGE_SLOTS and slot >= 1
    assert n * slot <= staging
    cap = BACKUP_SLOT_BYTES if to_host else LOAD_SLOT_BYTES
    assert slot <= max(cap, page)
    if to_host:
        assert n == backup_slots
    else:  # slot <= staging // STAGE_SLOTS, so the budget always holds at least STAGE_SLOTS of them
        event(f"load-side slot count checked ({'full' if slot == LOAD_SLOT_BYTES else 'other'} slots)")
        assert staging - n * slot < slot  # the budget buys as many slots as it holds
        if page <= LOAD_SLOT_BYTES and staging >= STAGE_SLOTS * LOAD_SLOT_BYTES:  # full slots
            assert slot == LOAD_SLOT_BYTES and n == staging // LOAD_SLOT_BYTES


def test_default_staging_is_sixteen_load_slots() -> None:
    from hicache.transfer.cuda_tuning import DEFAULT_STAGING_BYTES, staging_slots

    assert staging_slots(DEFAULT_STAGING_BYTES, 256 << 10, False) == (16, 16 << 20)
    assert staging_slots(DEFAULT_STAGING_BYTES, 256 << 10, True) == (4, 8 << 20)
    assert staging_slots(64 << 20, 256 << 10, False) == (4, 16 << 20)  # as before: four quarters
    assert staging_slots(64 << 20, 32 << 20, False) == (4, 16 << 20)  # a quarter, whatever the page


@pytest.mark.parametrize(("g", "ways"), [(8, 1), (8, 2), (8, 4), (4, 4), (8, 8)])
def test_first_layer_waits_for_every_parts_first_group(g: int, ways: int) -> None:
    """Layer 0 is ready after g * (ways + 1) / (2 * ways) layers' worth of the load (the startup lag the
    docstring quotes): every part's first group, and nothing else, comes before it."""
    s = stagger_schedule(32, g, ways)
    before = s.units[: s.ready[0] + 1]
    assert sorted(u.way for u in before) == list(range(ways))
    assert sum(u.n_layers for u in before) / ways == g * (ways + 1) / (2 * ways)


@pytest.mark.parametrize(("queues", "lanes"), [(None, 1), ("8", 1), ("31", 1), ("32", 8), ("64", 8), ("many", 1)])
def test_lanes_only_where_hardware_queues_suffice(queues: str | None, lanes: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Several lanes only where the device has hardware queues enough for them: with the CUDA default
    (8 queues) every stream past the eighth shares one, and compute ended behind the transfers."""
    from hicache.transfer.cuda_tuning import STAGE_LANES, default_stage_lanes

    if queues is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", queues)
    assert default_stage_lanes() == (STAGE_LANES if lanes > 1 else 1)


KIB = 1 << 10


def test_load_schedule_layer_wise_whole_and_head() -> None:
    """32 layers of 4 KiB K/V pieces, 64 KiB runs, 16 MiB slots, 1,000 pages."""
    args = (32, 2, 4 * KIB, 64 * KIB, 16 << 20, 1000, 4, 32)
    sched, bounds = load_schedule(*args)  # layer-wise: groups of 8, staggered 4 ways
    assert len(bounds) == 4 and bounds[0] == (0, 250) and bounds[-1] == (750, 1000)
    assert sched == stagger_schedule(32, 8, 4)
    sched, bounds = load_schedule(*args, layer_wise=False)  # whole pages, one part
    assert bounds == [(0, 1000)] and [tuple(u) for u in sched.units] == [(0, 0, 32)] and sched.ready == [0] * 32
    sched, bounds = load_schedule(*args, head=3)  # layers 3-31: numbered from layer 3, offset back
    plain = stagger_schedule(29, 8, 4)
    assert [(u.way, u.layer_begin - 3, u.n_layers) for u in sched.units] == [tuple(u) for u in plain.units]
    assert sched.ready == plain.ready and len(bounds) == 4
    # too few pages for 4 parts of at least 32: 2 parts
    assert len(load_schedule(32, 2, 4 * KIB, 64 * KIB, 16 << 20, 70, 4, 32)[1]) == 2
    # a whole page does not fit the slot: the largest group that does, still not staggered
    sched, bounds = load_schedule(32, 2, 4 * KIB, 64 * KIB, 100 * KIB, 1000, 4, 32, layer_wise=False)
    assert bounds == [(0, 1000)] and {u.n_layers for u in sched.units} <= {12, 8}
    # one layer group anyway (8 layers of 4 KiB make 64 KiB): never staggered
    sched, bounds = load_schedule(8, 2, 4 * KIB, 64 * KIB, 16 << 20, 1000, 4, 32)
    assert bounds == [(0, 1000)] and len(sched.units) == 1
    with pytest.raises(ValueError, match="does not fit"):
        load_schedule(32, 2, 1 << 20, 64 * KIB, 1 << 20, 10, 4, 32)


def test_lc_major_load_schedule_goes_layer_by_layer() -> None:
    """Lc-major staging (block-first or layer-first pools): one layer per unit when layer-wise, never
    staggered, so layer i is ready after unit i; a whole load takes as many layers as share a slot."""
    args = (32, 2, 4 * KIB, 64 * KIB, 16 << 20, 1000, 4, 32)
    sched, bounds = load_schedule(*args, lc_major=True)
    assert bounds == [(0, 1000)] and sched.ready == list(range(32))
    assert [(u.layer_begin, u.n_layers) for u in sched.units] == [(i, 1) for i in range(32)]
    sched, bounds = load_schedule(*args, layer_wise=False, lc_major=True)  # 1000 pages x 8 KiB: 2 layers a slot
    assert bounds == [(0, 1000)] and {u.n_layers for u in sched.units} == {2} and len(sched.units) == 16
    sched, _ = load_schedule(32, 2, 4 * KIB, 64 * KIB, 16 << 20, 10, 4, 32, layer_wise=False, lc_major=True)
    assert len(sched.units) == 1  # a small load: every layer in one slot
    with pytest.raises(ValueError, match="does not fit"):
        load_schedule(32, 2, 1 << 20, 64 * KIB, 1 << 20, 10, 4, 32, lc_major=True)
