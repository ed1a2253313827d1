"""Pools (allocators, layouts, integrity) and the CPU transfer engine (per-layer readiness, bytes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.layout import KVLayout
from hicache.pool import DevicePool, HostPool, PageAllocator, default_block_pages
from hicache.transfer import create_engine
from hicache.transfer.base import sorted_unique


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=60))
def test_allocator_conserves_pages(ops: list[tuple[bool, int]]) -> None:
    a = PageAllocator(32)
    held: list[np.ndarray] = []
    for is_alloc, n in ops:
        if is_alloc:
            got = a.alloc(n)
            if got is None:
                assert n > a.free_pages
            else:
                assert len(got) == n
                held.append(got)
        elif held:
            a.free(held.pop(n % len(held)))
        a.check_integrity()
        out = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
        assert len(np.unique(out)) == len(out) == a.used_pages


def test_allocator_rejects_double_free_and_out_of_range() -> None:
    a = PageAllocator(4)
    p = a.alloc(2)
    assert p is not None
    a.free(p)
    with pytest.raises(ValueError, match="double free"):
        a.free(p)
    with pytest.raises(ValueError, match="out of range"):
        a.free(np.array([4]))
    a.check_integrity()


def test_layout_bytes() -> None:
    llama8b = KVLayout(32, 8, 128, "bfloat16", 1)
    assert llama8b.bytes_per_token == 128 * 1024  # 128 KiB per token
    mla = KVLayout(61, 1, 576, "bfloat16", 64, "mla")
    assert mla.kv_count == 1 and mla.bytes_per_page == 61 * 64 * 576 * 2
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVLayout(2, 2, 4, "bfloat16", 4, "mla")
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(2, 2, 4, "float64", 4)


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "block_first"])
@pytest.mark.parametrize("attention,heads", [("mha", 2), ("mla", 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "float8_e4m3fn"])
def test_cpu_transfer_round_trip(host_layout: str, attention: str, heads: int, dtype: str) -> None:
    layout = KVLayout(3, heads, 5, dtype, 3, attention)  # odd sizes on purpose
    dev = DevicePool(layout, 10)
    # block-first: blocks of 4 pages, the last one partly past the pool's 13 pages
    host = HostPool(layout, 13, host_layout, block_pages=4)  # type: ignore[arg-type]
    eng = create_engine("cpu", dev, host)
    try:
        g = torch.Generator().manual_seed(0)
        for layer in dev.kv:
            for t in layer:
                t.view(torch.uint8).copy_(torch.randint(0, 100, t.view(torch.uint8).shape, generator=g).to(torch.uint8))
        src = np.array([7, 2, 9, 0])
        dst = np.array([12, 3, 5, 1])
        eng.backup(src, dst).wait()
        for i, (s, d) in enumerate(zip(src, dst, strict=True)):
            page = host.page_bytes(int(d))
            expect = torch.stack([torch.stack([dev.kv[lay][c][s] for c in range(layout.kv_count)])
                                  for lay in range(3)])
            assert page == expect.view(torch.uint8).numpy().tobytes(), i
        back = np.array([4, 6, 8, 3])
        h = eng.load(dst, back)
        for layer in range(3):
            h.wait_layer(layer)
            for c in range(layout.kv_count):
                b8 = dev.kv[layer][c].view(torch.uint8)
                assert torch.equal(b8[torch.from_numpy(back)], b8[torch.from_numpy(src)])
        assert h.done()
    finally:
        eng.close()


def test_transfer_rejects_bad_indices_and_copies_nothing() -> None:
    """Every rejected load / backup raises ``ValueError`` and leaves both pools byte-for-byte as they were,
    also once the engine's worker has drained its queue (a copy queued despite the error would show)."""
    layout = KVLayout(2, 1, 2, "float32", 2)
    dev, host = DevicePool(layout, 4), HostPool(layout, 4)
    g = torch.Generator().manual_seed(11)

    def fill(t: torch.Tensor) -> None:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.int32, generator=g).to(torch.uint8))

    for layer in dev.kv:
        for t in layer:
            fill(t)
    fill(host.buffer)
    dev_before = [[t.clone() for t in layer] for layer in dev.kv]
    host_before = host.buffer.clone()
    # sanity: random, non-zero content, and device and host pages differ, so any stray copy would show
    assert torch.count_nonzero(host_before.view(torch.uint8)) > 0
    assert host.page_bytes(0) != b"".join(dev_before[lay][0][0].view(torch.uint8).numpy().tobytes()
                                          for lay in range(2))

    def assert_unchanged(what: str) -> None:
        for lay in range(layout.num_layers):
            for c in range(layout.kv_count):
                assert torch.equal(dev.kv[lay][c].view(torch.uint8), dev_before[lay][c].view(torch.uint8)), what
        assert torch.equal(host.buffer.view(torch.uint8), host_before.view(torch.uint8)), what

    eng = create_engine("cpu", dev, host)
    closed = False
    try:
        bad: list[tuple[str, str, np.ndarray, np.ndarray]] = [
            ("load", "out of range", np.array([0, 4]), np.array([0, 1])),   # host source past the pool
            ("load", "out of range", np.array([0, 1]), np.array([3, 4])),   # device destination past it
            ("load", "out of range", np.array([-1, 1]), np.array([0, 1])),  # negative
            ("load", "duplicate", np.array([0, 1]), np.array([2, 2])),
            ("load", "shape", np.array([0, 1]), np.array([2])),
            ("backup", "shape", np.array([0]), np.array([0, 1])),
            ("backup", "out of range", np.array([0, 1]), np.array([1, 4])),
            ("backup", "out of range", np.array([5, 1]), np.array([0, 1])),
            ("backup", "duplicate", np.array([0, 1, 2]), np.array([3, 1, 3])),
        ]
        for op, match, src, dst in bad:
            with pytest.raises(ValueError, match=match):
                getattr(eng, op)(src, dst)
            assert_unchanged(f"{op} {src} -> {dst}")
        eng.close()  # drains the worker's queue before it stops
        closed = True
        assert_unchanged("after close")
        with pytest.raises(ValueError, match="unknown"):
            create_engine("nope", dev, host)
    finally:
        if not closed:
            eng.close()


def test_host_page_bytes_round_trip_and_size_check() -> None:
    layout = KVLayout(2, 2, 3, "float16", 2)
    for hl in ("page_first", "layer_first", "block_first"):
        host = HostPool(layout, 3, hl)  # type: ignore[arg-type]
        data = bytes(range(256)) * (layout.bytes_per_page // 256) + bytes(layout.bytes_per_page % 256)
        host.write_page_bytes(1, data)
        assert host.page_bytes(1) == data
        with pytest.raises(ValueError, match="bytes"):
            host.write_page_bytes(0, data[:-2])


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "block_first"])
def test_host_keys_address_every_piece(host_layout: str) -> None:
    """``host_keys`` and ``piece_strides`` locate each (page, layer, K/V) piece in the flat buffer, which is
    how the copy planners and kernels address it."""
    layout = KVLayout(3, 2, 4, "float16", 2)
    host = HostPool(layout, 11, host_layout, block_pages=4)  # type: ignore[arg-type]
    flat = host.buffer.view(torch.uint8).reshape(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(3))
               .to(torch.uint8))
    piece = layout.bytes_per_layer_piece
    ps, lcs = host.piece_strides
    pages = np.arange(11)
    keys = host.host_keys(pages)
    for layer in range(3):
        for c in range(2):
            got = host.read_pieces(layer, c, torch.from_numpy(pages)).reshape(11, -1)
            for h in pages:
                off = (int(keys[h]) * ps + (layer * 2 + c) * lcs) * piece
                assert torch.equal(got[h], flat[off:off + piece]), (h, layer, c)
            page = host.page_bytes(5)
            i = (layer * 2 + c) * piece
            assert page[i:i + piece] == got[5].numpy().tobytes()
    if host_layout == "block_first":
        assert host.block_pages == 4 and host.num_blocks == 3
        assert keys[4] - keys[3] != 1 and keys[5] - keys[4] == 1  # consecutive within a block only
        with pytest.raises(ValueError, match="block-first"):
            host.layer_view(0, 0)


def test_default_block_pages_reach_the_run_size() -> None:
    assert default_block_pages(4096) == 16
    assert default_block_pages(1000) == 64  # capped
    assert default_block_pages(1 << 20) == 1
    layout = KVLayout(2, 1, 64, "bfloat16", 16)  # 2 KiB pieces
    assert HostPool(layout, 100, "block_first").block_pages == 32


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=50), max_size=80))
def test_sorted_unique_matches_numpy(values: list[int]) -> None:
    a = np.array(values, dtype=np.int64)
    assert np.array_equal(sorted_unique(a), np.unique(a))


def test_allocator_hands_freed_runs_back_as_runs() -> None:
    """Block-first L2 relies on runs of consecutive pages: a fresh pool hands out consecutive pages, and
    a freed allocation comes back whole, in order, to the next one of its size (the free list is a stack)."""
    a = PageAllocator(64)
    first = a.alloc(20)
    second = a.alloc(12)
    assert first is not None and second is not None
    assert np.array_equal(first, np.arange(20)) and np.array_equal(second, np.arange(20, 32))
    a.free(first)
    again = a.alloc(20)
    assert again is not None and np.array_equal(again, np.arange(20))
    a.free(second)
    a.free(again)
    both = a.alloc(32)  # the two freed runs, each still in order
    assert both is not None and sorted(both.tolist()) == list(range(32))
    assert np.count_nonzero(np.diff(both) != 1) <= 1
    a.check_integrity()


def test_allocator_index_checks_refuse_out_of_range() -> None:
    a = PageAllocator(8)
    got = a.alloc(3)
    assert got is not None and a.is_allocated(got).all()
    assert a.is_allocated(np.arange(8)).sum() == 3
    for bad in ([-1], [8], [0, 9]):
        with pytest.raises(IndexError, match="out of range"):
            a.is_allocated(np.array(bad))
    a.check_integrity()


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "block_first"])
def test_host_pool_larger_than_memory_is_refused_before_allocating(host_layout: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool over what the host can spare raises HostMemoryError (a MemoryError) with the bytes asked for,
    before its allocator or its buffer exist; a block-first pool counts its whole last block."""
    import hicache.pool as pool_mod

    layout = KVLayout(2, 1, 64, "bfloat16", 16)  # 8 KiB pages
    monkeypatch.setattr(pool_mod, "available_host_memory", lambda: 10 * layout.bytes_per_page)
    made: list[int] = []
    monkeypatch.setattr(pool_mod, "PageAllocator", lambda n: made.append(n))
    with pytest.raises(pool_mod.HostMemoryError) as e:
        HostPool(layout, 11, host_layout, block_pages=4)  # type: ignore[arg-type]
    need = (12 if host_layout == "block_first" else 11) * layout.bytes_per_page
    assert isinstance(e.value, MemoryError) and (e.value.needed, e.value.available) == (need, 10 * 8192)
    assert f"({need} bytes) asked for" in str(e.value) and made == []
    monkeypatch.setattr(pool_mod, "PageAllocator", PageAllocator)
    assert HostPool(layout, 10, "page_first").nbytes == 10 * 8192  # what fits is allocated as before


def test_host_pool_allocation_failure_is_a_host_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the memory check passes (or cannot be made) but the allocation fails, the same error comes
    with the allocator's reason."""
    import hicache.pool as pool_mod

    real_empty = torch.empty

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        if "pin_memory" not in kwargs:  # not the pool's buffer (the layout sizes its dtype with one)
            return real_empty(*args, **kwargs)  # type: ignore[call-overload,no-any-return]
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory\nmore detail")

    monkeypatch.setattr(pool_mod, "available_host_memory", lambda: None)
    monkeypatch.setattr(pool_mod.torch, "empty", refuse)
    with pytest.raises(pool_mod.HostMemoryError, match=r"the allocation failed \(DefaultCPUAllocator: can't "
                                                       r"allocate memory\)$"):
        HostPool(KVLayout(2, 1, 64, "bfloat16", 16), 4)


def test_meminfo_available_counts_the_page_cache(tmp_path: Path) -> None:
    """MemAvailable when the kernel reports it; before Linux 3.14 it does not, and free memory alone would
    count the reclaimable page cache as taken (and refuse an L2 that fits): the file cache and the
    reclaimable slab are added to it instead."""
    from hicache.pool import _meminfo_available

    f = tmp_path / "meminfo"
    rest = ("MemFree:         1000 kB\nBuffers:          50 kB\nCached:         20000 kB\nShmem:   300 kB\n"
            "Active(file):    8000 kB\nInactive(file):  11000 kB\nSReclaimable:     400 kB\n")
    f.write_text("MemTotal:       64000 kB\n" + rest + "MemAvailable:   19000 kB\n")
    assert _meminfo_available(str(f)) == 19000 * 1024
    f.write_text("MemTotal:       64000 kB\n" + rest)
    assert _meminfo_available(str(f)) == (1000 + 8000 + 11000 + 400) * 1024
    f.write_text("MemTotal:       64000 kB\n")
    assert _meminfo_available(str(f)) is None
    assert _meminfo_available(str(tmp_path / "missing")) is None


def test_cgroup_headroom(tmp_path: Path) -> None:
    """The memory a cgroup still grants: limit - usage + inactive file cache, the tightest of the process's
    cgroup and its ancestors; none without a limit. cgroup v2 and v1's memory controller."""
    from hicache.pool import _cgroup_headroom

    v2 = tmp_path / "v2"
    leaf = v2 / "kubepods" / "pod1"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("1000000\n")
    (leaf / "memory.current").write_text("600000\n")
    (leaf / "memory.stat").write_text("anon 500000\ninactive_file 50000\nactive_file 7\n")
    (v2 / "kubepods" / "memory.max").write_text("max\n")
    (v2 / "kubepods" / "memory.current").write_text("600000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1\n")
    assert _cgroup_headroom(str(proc), str(v2)) == 1000000 - 600000 + 50000
    (v2 / "kubepods" / "memory.max").write_text("700000\n")  # a tighter parent wins
    assert _cgroup_headroom(str(proc), str(v2)) == 100000
    proc.write_text("0::/elsewhere\n")  # a host path not mounted here: only the mount root counts
    assert _cgroup_headroom(str(proc), str(v2)) is None

    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (v1 / "memory" / "memory.usage_in_bytes").write_text("5\n")
    proc.write_text("9:name=systemd:/\n4:memory:/\n0::/\n")
    assert _cgroup_headroom(str(proc), str(v1)) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text("4096\n")
    (v1 / "memory" / "memory.stat").write_text("inactive_file 1\ntotal_inactive_file 100\n")
    assert _cgroup_headroom(str(proc), str(v1)) == 4096 - 5 + 100
    assert _cgroup_headroom(str(tmp_path / "missing"), str(v1)) is None
