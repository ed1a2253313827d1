"""Staged-path planning (pure NumPy, runs anywhere): DMA runs into a staging slot, then the kernel's
slot addressing, reproduce the page-first host pieces exactly."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.transfer.staged import chunk_sizes, group_layers, plan_group, with_slot_base


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
