"""Staged-path planning (pure NumPy, runs anywhere): DMA runs into a staging slot, then the kernel's
slot addressing, reproduce the page-first host pieces exactly."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hicache.layout import KVLayout
from hicache.pool import HostPool
from hicache.transfer.copy_engine import CopyPlan
from hicache.transfer.staged_plan import (
    StagedChunk,
    chunk_sizes,
    group_layers,
    plan_group,
    plan_group_lc,
    shift_layers,
    with_slot_base,
)
from hicache.transfer.staged_plan_blocks import plan_group_blocks


def test_group_layers() -> None:
    assert group_layers(32, 2, 4096, 64 << 10, 32 << 20) == 8  # 8 layers x K,V x 4 KiB = 64 KiB runs
    assert group_layers(32, 2, 64 << 10, 64 << 10, 32 << 20) == 1
    assert group_layers(4, 2, 4096, 1 << 30, 32 << 20) == 4  # capped at the layer count
    assert group_layers(32, 2, 4096, 1 << 30, 3 * 8192) == 3  # capped by the slot
    assert group_layers(32, 2, 1 << 20, 64 << 10, 1 << 20) == 0  # one layer does not fit


def test_whole_pages_merge_consecutive_runs() -> None:
    h = np.array([4, 5, 6, 9, 10, 2], dtype=np.int64)
    chunks = plan_group(1000, 64, 8, 2, h, 0, 4, 64 * 100, to_host=False)  # run = 4 * 2 * 8 = 64 = a page
    assert len(chunks) == 1
    p = chunks[0].plan
    assert p.src.tolist() == [1000 + 4 * 64, 1000 + 9 * 64, 1000 + 2 * 64]
    assert p.dst.tolist() == [0, 3 * 64, 5 * 64]
    assert p.size.tolist() == [3 * 64, 2 * 64, 64]
    back = plan_group(1000, 64, 8, 2, h, 0, 4, 64 * 100, to_host=True)[0].plan
    assert back.dst.tolist() == p.src.tolist() and back.src.tolist() == p.dst.tolist()


def test_slot_too_small_is_an_error() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        plan_group(0, 64, 8, 2, np.arange(3), 0, 4, 63, to_host=False)


def _simulate(L: int, C: int, piece: int, n_host: int, n_dev: int, h: np.ndarray, d: np.ndarray, g: int,
              slot: int, rng: np.random.Generator, ramp: tuple[int, int] = (0, 0)) -> tuple[np.ndarray, np.ndarray]:
    """Load through the plan and the kernel's slot addressing; returns (got, expected) L1 pools."""
    host = rng.integers(0, 256, n_host * L * C * piece, dtype=np.uint8)  # page-first [P, L, C, piece]
    dev = np.zeros((L * C, n_dev, piece), dtype=np.uint8)
    stage_base = 1 << 40  # a fake device address, far from the host's (0)
    staging = np.zeros(slot, dtype=np.uint8)
    for l0 in range(0, L, g):
        ng = min(g, L - l0)
        for ch in plan_group(0, L * C * piece, piece, C, h, l0, ng, slot, False, *ramp):
            plan = with_slot_base(ch.plan, stage_base, to_host=False)
            for dst, src, size in zip(plan.dst.tolist(), plan.src.tolist(), plan.size.tolist(), strict=True):
                staging[dst - stage_base: dst - stage_base + size] = host[src: src + size]
            # the kernel: slot page p, slot lc -> base + p * (n_lc * piece) + lc * piece, base shifted back
            base = stage_base - l0 * C * piece
            for p in range(ch.i1 - ch.i0):
                for lc in range(l0 * C, (l0 + ng) * C):
                    a = base + p * ng * C * piece + lc * piece - stage_base
                    dev[lc, d[ch.i0 + p]] = staging[a: a + piece]
    want = np.zeros_like(dev)
    hv = host.reshape(n_host, L * C, piece)
    for i in range(len(h)):
        want[:, d[i]] = hv[h[i]]
    return dev, want


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 5), C=st.integers(1, 2), piece=st.sampled_from([2, 16, 48]), n=st.integers(1, 12),
       g=st.integers(1, 5), pages_per_slot=st.integers(1, 5), seed=st.integers(0, 2**16),
       ramp=st.tuples(st.integers(0, 3), st.integers(0, 3)))
def test_staged_load_reproduces_host_pieces(L: int, C: int, piece: int, n: int, g: int, pages_per_slot: int,
                                            seed: int, ramp: tuple[int, int]) -> None:
    rng = np.random.default_rng(seed)
    g = min(g, L)
    n_host, n_dev = n + 3, n + 2
    h = rng.permutation(n_host)[:n].astype(np.int64)
    if seed % 2:  # runs of consecutive host pages, so whole-page runs merge
        h = (np.arange(n) + rng.integers(0, 3)).astype(np.int64)
    d = rng.permutation(n_dev)[:n].astype(np.int64)
    slot = pages_per_slot * g * C * piece
    got, want = _simulate(L, C, piece, n_host, n_dev, h, d, g, slot, rng, ramp)
    assert np.array_equal(got, want)



def test_chunk_sizes_ramp() -> None:
    assert chunk_sizes(100, 16) == [16] * 6 + [4]
    assert chunk_sizes(100, 16, ramp_up=3) == [2, 4, 8] + [16] * 5 + [6]
    assert chunk_sizes(100, 16, ramp_down=3) == [16] * 5 + [6, 8, 4, 2]
    assert chunk_sizes(3, 16, ramp_up=4, ramp_down=4) == [1, 2]
    assert chunk_sizes(0, 16, 2, 2) == []


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 500), per=st.integers(1, 64), up=st.integers(0, 6), down=st.integers(0, 6))
def test_chunk_sizes_cover_every_page(n: int, per: int, up: int, down: int) -> None:
    sizes = chunk_sizes(n, per, up, down)
    assert sum(sizes) == n
    assert all(1 <= t <= per for t in sizes)
    if n >= per * (up + down + 2):  # long enough: the ramps appear whole, small at the ends
        assert sizes[0] == max(1, per >> up)
        if down:
            assert sizes[-down:] == [max(1, per >> k) for k in range(1, down + 1)]


def _play_chunk(plan: CopyPlan, cells: list[tuple[int, int, int]], d: np.ndarray, staging: np.ndarray,
                stage_base: int, host: np.ndarray, dev: np.ndarray, to_host: bool) -> None:
    """One staged chunk on bytes: ``cells`` are the kernel's (slot page, lc, slot offset) for L1 pages
    ``d``; a backup gathers L1 into the slot and then runs the DMA ``plan``, a load the reverse."""
    piece = dev.shape[-1]
    if to_host:  # gather, then DMA out
        for p, lc, a in cells:
            staging[a: a + piece] = dev[lc, d[p]]
    for dst, src, size in zip(plan.dst.tolist(), plan.src.tolist(), plan.size.tolist(), strict=True):
        if to_host:
            host[dst: dst + size] = staging[src - stage_base: src - stage_base + size]
        else:
            staging[dst - stage_base: dst - stage_base + size] = host[src: src + size]
    if not to_host:  # DMA in, then scatter
        for p, lc, a in cells:
            dev[lc, d[p]] = staging[a: a + piece]


def _transfer_pages(n: int, n_host: int, n_dev: int, seed: int, spread: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Host and L1 pages of a transfer: a run of consecutive host pages (odd seeds, as the allocator
    hands them out) or random ones, and random L1 pages."""
    if seed % 2:
        h = (np.arange(n) + rng.integers(0, spread)).astype(np.int64)
    else:
        h = rng.permutation(n_host)[:n].astype(np.int64)
    return h, rng.permutation(n_dev)[:n].astype(np.int64)


def _block_first_pools(L: int, C: int, piece: int, B: int, n_host: int, n_dev: int,
                       rng: np.random.Generator) -> tuple[HostPool, np.ndarray, np.ndarray]:
    """A block-first pool of random ``piece``-byte pieces (its bytes as a NumPy view) and random L1 pages
    ``[L * C, n_dev, piece]``."""
    layout = KVLayout(L, 1, piece // 2, "float16", 1, "mla" if C == 1 else "mha")  # pieces of `piece` bytes
    pool = HostPool(layout, n_host, "block_first", pin_memory=False, block_pages=B)
    host = pool.buffer.view(torch.uint8).reshape(-1).numpy()
    host[:] = rng.integers(0, 256, host.size, dtype=np.uint8)
    return pool, host, rng.integers(0, 256, (L * C, n_dev, piece), dtype=np.uint8)


def _expected_block_first(pool: HostPool, host0: np.ndarray, dev0: np.ndarray, h: np.ndarray, d: np.ndarray,
                          to_host: bool) -> np.ndarray:
    """What a transfer of host pages ``h`` <-> L1 pages ``d`` must leave: the pool's bytes (backups,
    from ``host0``) or the L1 pages (loads, from ``dev0``), by the pool's own piece accessors."""
    L, C = pool.layout.num_layers, pool.layout.kv_count
    piece = dev0.shape[-1]
    if to_host:
        pw = HostPool(pool.layout, pool.num_pages, "block_first", pin_memory=False, block_pages=pool.block_pages)
        pw.buffer.view(torch.uint8).reshape(-1).numpy()[:] = host0
        for i in range(len(h)):
            for lc in range(L * C):
                pw.write_pieces(lc // C, lc % C, torch.tensor([int(h[i])]),
                                torch.from_numpy(dev0[lc, d[i]]).view(1, 1, 1, piece))
        return pw.buffer.view(torch.uint8).reshape(-1).numpy()
    want = dev0.copy()  # a load leaves the pool as it was (host0)
    for i in range(len(h)):
        for lc in range(L * C):
            want[lc, d[i]] = pool.read_pieces(lc // C, lc % C, torch.tensor([int(h[i])])).reshape(-1).numpy()
    return want


def _simulate_lc(L: int, C: int, piece: int, B: int, n_host: int, n_dev: int, h: np.ndarray, d: np.ndarray,
                 g: int, slot: int, to_host: bool, rng: np.random.Generator,
                 ramp: tuple[int, int] = (0, 0)) -> tuple[np.ndarray, np.ndarray, int]:
    """A staged transfer of a block-first pool through :func:`plan_group_lc` and the kernel's lc-major
    slot addressing (``launch_staged(..., lc_major=True)``); returns (got, expected, copies)."""
    pool, host, dev = _block_first_pools(L, C, piece, B, n_host, n_dev, rng)
    ps, lcs = pool.piece_strides
    host0, dev0 = host.copy(), dev.copy()
    order = np.argsort(h)
    h, d = h[order], d[order]
    keys = pool.host_keys(h)
    stage_base = 1 << 40
    staging = np.zeros(slot, dtype=np.uint8)
    copies = 0
    for l0 in range(0, L, g):
        ng = min(g, L - l0)
        for ch in plan_group_lc(0, ps * piece, lcs * piece, piece, C, keys, l0, ng, slot, to_host, *ramp):
            plan = with_slot_base(ch.plan, stage_base, to_host)
            m = ch.i1 - ch.i0
            base = stage_base - l0 * C * m * piece  # the kernel: slot page p, lc -> base + p*piece + lc*m*piece
            cells = [(p, lc, base + p * piece + lc * m * piece - stage_base)
                     for p in range(m) for lc in range(l0 * C, (l0 + ng) * C)]
            _play_chunk(plan, cells, d[ch.i0:ch.i1], staging, stage_base, host, dev, to_host)
            copies += plan.n_copies
    return (host if to_host else dev), _expected_block_first(pool, host0, dev0, h, d, to_host), copies


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 4), C=st.integers(1, 2), piece=st.sampled_from([2, 16, 48]), n=st.integers(1, 14),
       B=st.sampled_from([1, 2, 4, 8]), g=st.integers(1, 4), pages_per_slot=st.integers(1, 5),
       to_host=st.booleans(), seed=st.integers(0, 2**16), ramp=st.tuples(st.integers(0, 3), st.integers(0, 3)))
def test_lc_major_staging_moves_every_piece(L: int, C: int, piece: int, n: int, B: int, g: int, pages_per_slot: int,
                                           to_host: bool, seed: int, ramp: tuple[int, int]) -> None:
    """Loads and backups of a block-first pool through lc-major chunks land exactly the right pieces, and
    touch nothing else; runs of consecutive pages in a block become one copy per (layer, K/V)."""
    rng = np.random.default_rng(seed)
    g = min(g, L)
    n_host, n_dev = n + 5, n + 2
    h, d = _transfer_pages(n, n_host, n_dev, seed, 5, rng)
    slot = pages_per_slot * g * C * piece
    got, want, copies = _simulate_lc(L, C, piece, B, n_host, n_dev, h, d, g, slot, to_host, rng, ramp)
    assert np.array_equal(got, want)
    if seed % 2 and pages_per_slot >= n and ramp == (0, 0):  # one chunk per group: a copy per (lc, block)
        event("copy count checked")
        blocks = len({(int(x) // B) for x in h})
        assert copies == L * C * (1 if L * C == 1 else blocks)  # one layer's blocks abut each other


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 4), C=st.integers(1, 2), piece=st.sampled_from([2, 16, 48]), n=st.integers(1, 14),
       B=st.sampled_from([1, 2, 4, 8]), g=st.integers(1, 4), spare_pages=st.integers(0, 3),
       first=st.integers(0, 4), to_host=st.booleans(), seed=st.integers(0, 2**16))
def test_lc_major_consecutive_pages_are_one_copy_per_layer_and_block(L: int, C: int, piece: int, n: int, B: int,
                                                                    g: int, spare_pages: int, first: int,
                                                                    to_host: bool, seed: int) -> None:
    """No ramp and a slot holding every page: each layer group is one chunk, and a run of consecutive host
    pages is one copy per (layer, K/V, block), one per (layer, K/V) in all where blocks abut (one lc).
    The pieces land exactly as well."""
    rng = np.random.default_rng(seed)
    g = min(g, L)
    n_host, n_dev = n + 5, n + 2
    h = np.arange(first, first + n, dtype=np.int64)
    d = rng.permutation(n_dev)[:n].astype(np.int64)
    slot = (n + spare_pages) * g * C * piece  # pages_per_slot >= n
    got, want, copies = _simulate_lc(L, C, piece, B, n_host, n_dev, h, d, g, slot, to_host, rng, (0, 0))
    assert np.array_equal(got, want)
    blocks = len({int(x) // B for x in h})
    event(f"copy count checked, blocks spanned: {'1' if blocks == 1 else '2+'}")
    assert copies == L * C * (1 if L * C == 1 else blocks)


def test_lc_major_runs_are_one_copy_per_layer_and_block() -> None:
    """32 layers, 4 KiB pieces, blocks of 16: 64 consecutive pages load as 4 copies of 64 KiB per (layer,
    K/V), and a one-layer chunk's slot is [K pages][V pages]."""
    piece, B = 4 << 10, 16
    keys = HostPool(KVLayout(32, 8, 128, "float16", 2), 128, "block_first", pin_memory=False,
                    block_pages=B).host_keys(np.arange(16, 80))
    chunks = plan_group_lc(0, piece, B * piece, piece, 2, keys, 5, 1, 16 << 20, False)
    assert len(chunks) == 1 and chunks[0].plan.n_copies == 8
    assert set(chunks[0].plan.size.tolist()) == {B * piece}
    assert sorted(chunks[0].plan.dst.tolist()) == [i * B * piece for i in range(8)]
    with pytest.raises(ValueError, match="piece-contiguous"):
        plan_group_lc(0, 2 * piece, piece, piece, 2, keys, 0, 1, 1 << 20, False)
    with pytest.raises(ValueError, match="do not fit"):
        plan_group_lc(0, piece, B * piece, piece, 2, keys, 0, 2, 3 * piece, False)


@pytest.mark.parametrize("to_host", [False, True])
def test_shifted_lc_major_chunks_equal_planning_each_layer(to_host: bool) -> None:
    """A layer-wise load plans its runs once and shifts them: the same copies as planning every layer."""
    piece, B, L, C = 4 << 10, 16, 6, 2
    pool = HostPool(KVLayout(L, 8, 128, "float16", 2), 200, "block_first", pin_memory=False, block_pages=B)
    keys = pool.host_keys(np.sort(np.random.default_rng(1).permutation(200)[:90]))
    args = (1 << 30, piece, B * piece, piece, C)
    base = plan_group_lc(*args, keys, 0, 1, 40 * C * piece, to_host, 0, 2)
    for layer in range(L):
        want = plan_group_lc(*args, keys, layer, 1, 40 * C * piece, to_host, 0, 2)
        got = shift_layers(base, layer, C, B * piece, to_host)
        assert [(c.i0, c.i1) for c in got] == [(c.i0, c.i1) for c in want]
        for a, b in zip(got, want, strict=True):
            assert all(np.array_equal(x, y) for x, y in zip(a.plan, b.plan, strict=True))



def _simulate_blocks(L: int, C: int, piece: int, B: int, n_host: int, n_dev: int, h: np.ndarray, d: np.ndarray,
                     g: int, slot: int, to_host: bool, rng: np.random.Generator,
                     ramp: tuple[int, int] = (0, 0)) -> tuple[np.ndarray, np.ndarray, list[list[StagedChunk]]]:
    """A staged transfer of a block-first pool through :func:`plan_group_blocks` and the kernel's
    addressing of the slot (key ``slot_keys[i]``, page stride ``piece``, (layer, K/V) stride ``B *
    piece``); returns (got, expected, the chunks of each group)."""
    pool, host, dev = _block_first_pools(L, C, piece, B, n_host, n_dev, rng)
    host0, dev0 = host.copy(), dev.copy()
    order = np.argsort(h, kind="stable")
    h, d = h[order], d[order]
    stage_base = 1 << 40
    staging = np.full(slot, 7, dtype=np.uint8)
    groups = []
    for l0 in range(0, L, g):
        ng = min(g, L - l0)
        chunks = plan_group_blocks(0, piece, C, L, B, h, l0, ng, slot, to_host, *ramp)
        assert chunks is not None
        groups.append(chunks)
        for ch in chunks:
            assert ch.slot_keys is not None and len(ch.slot_keys) == ch.i1 - ch.i0
            plan = with_slot_base(ch.plan, stage_base, to_host)
            cells = [(p, lc, (int(ch.slot_keys[p]) * piece + (lc - l0 * C) * B * piece))
                     for p in range(ch.i1 - ch.i0) for lc in range(l0 * C, (l0 + ng) * C)]
            assert all(a >= 0 and a + piece <= slot for _, _, a in cells)
            _play_chunk(plan, cells, d[ch.i0:ch.i1], staging, stage_base, host, dev, to_host)
    return (host if to_host else dev), _expected_block_first(pool, host0, dev0, h, d, to_host), groups


@settings(max_examples=80, deadline=None)
@given(L=st.integers(1, 4), C=st.integers(1, 2), piece=st.sampled_from([2, 16, 48]), n=st.integers(1, 30),
       B=st.sampled_from([1, 2, 4, 8]), g=st.integers(1, 4), blocks_per_slot=st.integers(1, 4),
       to_host=st.booleans(), seed=st.integers(0, 2**16), ramp=st.tuples(st.integers(0, 3), st.integers(0, 3)))
def test_block_mirrored_staging_moves_every_piece(L: int, C: int, piece: int, n: int, B: int, g: int,
                                                  blocks_per_slot: int, to_host: bool, seed: int,
                                                  ramp: tuple[int, int]) -> None:
    """Loads and backups of a block-first pool through block-mirrored chunks land exactly the right pieces
    and touch nothing else, whatever the runs, ramps and slot sizes; every chunk fits its slot."""
    rng = np.random.default_rng(seed)
    g = min(g, L)
    n_host, n_dev = n + 9, n + 2
    h, d = _transfer_pages(n, n_host, n_dev, seed, 9, rng)
    slot = blocks_per_slot * g * C * B * piece
    got, want, groups = _simulate_blocks(L, C, piece, B, n_host, n_dev, h, d, g, slot, to_host, rng, ramp)
    assert np.array_equal(got, want)
    for chunks in groups:
        assert chunks[0].i0 == 0 and chunks[-1].i1 == n
        assert all(a.i1 == b.i0 for a, b in itertools.pairwise(chunks))


def test_whole_blocks_are_one_copy() -> None:
    """32 layers, 4 KiB pieces, blocks of 16: a backup of 3 whole consecutive blocks and 5 pages of a
    fourth is 1 copy of 12 MiB plus 64 (layers x K/V) copies of the 5-page run; one layer of the same
    pages loads as 3 copies of 128 KiB (K and V of a block are adjacent) plus 2."""
    piece, B, L, C = 4 << 10, 16, 32, 2
    h = np.arange(16, 16 + 3 * B + 5, dtype=np.int64)
    chunks = plan_group_blocks(0, piece, C, L, B, h, 0, L, 16 << 20, True)
    assert chunks is not None and len(chunks) == 1
    sizes = sorted(chunks[0].plan.size.tolist())
    assert sizes == [5 * piece] * (L * C) + [3 * L * C * B * piece]
    layer = plan_group_blocks(0, piece, C, L, B, h, 7, 1, 16 << 20, False)
    assert layer is not None
    assert sorted(layer[0].plan.size.tolist()) == [5 * piece] * 2 + [2 * B * piece] * 3
    assert plan_group_blocks(0, piece, C, L, B, h, 0, L, L * C * B * piece - 1, True) is None


@pytest.mark.parametrize("to_host", [False, True])
def test_shifted_block_chunks_equal_planning_each_layer(to_host: bool) -> None:
    piece, B, L, C = 4 << 10, 16, 6, 2
    h = np.sort(np.random.default_rng(4).permutation(300)[:170]).astype(np.int64)
    base = plan_group_blocks(1 << 30, piece, C, L, B, h, 0, 1, 8 * C * B * piece, to_host, 0, 2)
    assert base is not None
    for layer in range(L):
        want = plan_group_blocks(1 << 30, piece, C, L, B, h, layer, 1, 8 * C * B * piece, to_host, 0, 2)
        assert want is not None
        got = shift_layers(base, layer, C, B * piece, to_host)
        for a, b in zip(got, want, strict=True):
            assert (a.i0, a.i1) == (b.i0, b.i1)
            assert a.slot_keys is not None and b.slot_keys is not None
            assert np.array_equal(a.slot_keys, b.slot_keys)
            assert all(np.array_equal(x, y) for x, y in zip(a.plan, b.plan, strict=True))


def test_partial_blocks_are_packed_into_bins() -> None:
    """Scattered pages (one per block) share bins instead of taking a block-sized bin each: 16 pages of
    16 different blocks of 16 fit one bin, so one layer of them loads through one chunk of a one-bin slot,
    one copy per page and (K, V); a whole block between them keeps a bin of its own."""
    piece, B, L, C = 2, 16, 4, 2
    h = np.arange(16, dtype=np.int64) * B + 3  # page 3 of blocks 0..15
    bin_bytes = C * B * piece
    chunks = plan_group_blocks(0, piece, C, L, B, h, 0, 1, bin_bytes, False)
    assert chunks is not None and len(chunks) == 1
    assert chunks[0].slot_keys is not None and chunks[0].slot_keys.tolist() == list(range(16))
    assert chunks[0].plan.n_copies == 16 * C
    with_whole = np.sort(np.concatenate([h, np.arange(16 * B, 17 * B)]))  # block 16 whole
    chunks = plan_group_blocks(0, piece, C, L, B, with_whole, 0, 1, 2 * bin_bytes, False)
    assert chunks is not None and len(chunks) == 1
    keys = chunks[0].slot_keys
    assert keys is not None and keys[:16].tolist() == list(range(16))
    assert keys[16:].tolist() == [C * B + k for k in range(B)]  # the whole block: bin 1, in place
    assert sorted(chunks[0].plan.size.tolist()) == [piece] * (16 * C) + [C * B * piece]
