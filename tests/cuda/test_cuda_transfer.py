"""CUDA transfer engine on a GPU: every path against torch indexing, for every layout, element size and
host layout; the choices of ``auto``; a large pool registered in place; the cache through L2.

Skipped without a CUDA GPU or CuPy (collection imports neither CuPy nor a CUDA build of torch).
"""


import numpy as np
import pytest
import torch

from cudahelpers import (
    IDS,
    LAYOUTS,
    backend_kw,
    check_backup,
    expect_backup,
    expect_load,
    host_bytes,
    indices,
    load_checked_layer_by_layer,
    pools,
    rand_bytes,
    snapshot,
)
from hicache.layout import KVLayout
from hicache.pool import DevicePool, HostPool
from hicache.transfer import create_engine

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")


@pytest.mark.parametrize("io_backend", ["kernel", "copy_engine", "staged", "staged_resident", "staged_lc"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "block_first"])
@pytest.mark.parametrize(("layout", "width"), LAYOUTS, ids=IDS)
def test_load_and_backup_match_torch(layout: KVLayout, width: int, host_layout: str, io_backend: str) -> None:
    n_dev, n_host, n = 37, 41, 23
    dev, host = pools(layout, n_dev, n_host, host_layout, seed=1)
    kw = backend_kw(io_backend)
    if io_backend.startswith("staged"):
        if host_layout != "page_first" and io_backend == "staged_resident":
            with pytest.raises(ValueError, match="page_first"):
                create_engine("cuda", dev, host, **kw)
            return
        # slots of 3 whole pages: many chunks per transfer, both slots reused across groups
        kw |= {"staging_bytes": 4 * 3 * layout.num_layers * layout.kv_count * layout.bytes_per_layer_piece,
               "ce_min_copy_bytes": 2 * layout.bytes_per_layer_piece}
    eng = create_engine("cuda", dev, host, **kw)
    try:
        if io_backend == "kernel":
            assert eng.kernel.width == width
        L, C = layout.num_layers, layout.kv_count
        every = {(layer, c) for layer in range(L) for c in range(C)}
        # load: layer by layer
        d, h = indices(n, n_dev, n_host, seed=2)
        if host_layout == "block_first":  # a run of consecutive pages across blocks, as allocated
            h = np.random.default_rng(2).permutation(np.arange(5, 5 + n)).astype(np.int64)
        before = snapshot(dev)
        handle = eng.load(h, d)
        handle.wait()
        assert handle.done()
        expect = expect_load(before, host, d, h, every)
        got = snapshot(dev)
        for layer in range(L):
            for c in range(C):
                assert torch.equal(got[layer][c], expect[layer][c]), (layer, c)
        # backup: every layer at once, to other host pages
        d, h = indices(n, n_dev, n_host, seed=3)
        hb = host_bytes(host).clone()
        dsnap = snapshot(dev)
        handle = eng.backup(d, h)
        handle.wait()
        assert handle.done()
        assert torch.equal(host_bytes(host), expect_backup(hb, host.block_pages, dsnap, d, h, every))
    finally:
        eng.close()


@pytest.mark.parametrize("block_staging", ["mirror", "lc_major"])
@pytest.mark.parametrize(("layout", "width"), LAYOUTS[:3] + LAYOUTS[-1:], ids=IDS[:3] + IDS[-1:])
def test_block_first_staging_with_whole_blocks(layout: KVLayout, width: int, block_staging: str) -> None:
    """Staged transfers of a block-first pool (blocks of 4) over runs that cover whole blocks and parts
    of others, with slots of several whole blocks: layer-wise and whole loads, and backups, equal torch's."""
    n_dev, n_host = 61, 64
    dev, host = pools(layout, n_dev, n_host, "block_first", seed=5)
    L, C = layout.num_layers, layout.kv_count
    block = L * C * 4 * layout.bytes_per_layer_piece
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=16 * 3 * block,
                        backup_slots=16, block_staging=block_staging)
    assert eng.block_mirror == (block_staging == "mirror")
    every = {(layer, c) for layer in range(L) for c in range(C)}
    runs = np.concatenate([np.arange(2, 19), np.arange(24, 29), np.arange(31, 52)]).astype(np.int64)
    try:
        for k, layer_wise in enumerate((True, False)):
            rng = np.random.default_rng(10 + k)
            h = rng.permutation(runs)
            d = rng.permutation(n_dev)[:len(h)].astype(np.int64)
            before = snapshot(dev)
            handle = eng.load(h, d, layer_wise=layer_wise)
            handle.wait()
            expect = expect_load(before, host, d, h, every)
            got = snapshot(dev)
            for layer in range(L):
                for c in range(C):
                    assert torch.equal(got[layer][c], expect[layer][c]), (layer_wise, layer, c)
        check_backup(eng, dev, host, np.concatenate([runs[:30], [60, 62]]), n_dev, 12, every)
    finally:
        eng.close()


def test_mirrored_backup_of_blocks_larger_than_a_slot() -> None:
    """A block of every layer outgrows the backup slot (a deep model's blocks do): the backup goes in
    groups of layers whose bins fit, still through mirrored slots, and equals torch's."""
    layout = KVLayout(4, 2, 64, "bfloat16", 16)  # 4 KiB pieces
    n_dev, n_host = 61, 64
    dev, host = pools(layout, n_dev, n_host, "block_first", seed=8, block_pages=16)
    L, C, piece, B = layout.num_layers, layout.kv_count, layout.bytes_per_layer_piece, host.block_pages
    assert B == 16
    slot = 4 * L * C * piece  # four whole pages, a quarter of a block
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=16 * slot, backup_slots=16)
    try:
        st = eng._stager(True)
        assert st.slot_bytes < L * C * B * piece  # a block of every layer does not fit
        shapes = eng._backup_shapes(st)
        assert len(shapes) > 1 and all(g * C * B * piece <= st.slot_bytes for g, _, _ in shapes)
        every = {(layer, c) for layer in range(L) for c in range(C)}
        check_backup(eng, dev, host, np.concatenate([np.arange(0, 40), [45, 50, 63]]), n_dev, 14, every)
    finally:
        eng.close()


@pytest.mark.parametrize("launch", ["driver", "cupy"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "block_first"])
@pytest.mark.parametrize(("layout", "width"), LAYOUTS[:3] + LAYOUTS[-1:], ids=IDS[:3] + IDS[-1:])
def test_kernel_one_layer_and_all_layers(layout: KVLayout, width: int, host_layout: str, launch: str) -> None:
    """The raw kernel for one slot range and for all slots, both directions, launched through the driver
    API (the default) and through CuPy (the fallback)."""
    n_dev, n_host, n = 29, 31, 19
    dev, host = pools(layout, n_dev, n_host, host_layout, seed=4)
    eng = create_engine("cuda", dev, host, io_backend="kernel", blocks=3, threads=128)
    if launch == "driver":
        assert eng.kernel.launches_by_driver, eng.kernel.driver_error
    else:
        eng.kernel._launcher = None
    try:
        L, C = layout.num_layers, layout.kv_count
        stream = torch.cuda.current_stream()
        for lc_begin, n_lc in [(0, L * C), ((L - 1) * C, C), (1, 1)]:
            slots = {divmod(lc, C) for lc in range(lc_begin, lc_begin + n_lc)}
            for to_host in (False, True):
                d, h = indices(n, n_dev, n_host, seed=lc_begin * 7 + n_lc + int(to_host))
                idx = torch.from_numpy(np.stack([d, host.host_keys(h)])).cuda()  # kernels address host keys
                before_dev, before_host = snapshot(dev), host_bytes(host).clone()
                eng.kernel.launch(stream.cuda_stream, idx.data_ptr(), idx.data_ptr() + n * 8, n, lc_begin, n_lc,
                                  to_host)
                torch.cuda.synchronize()
                if to_host:
                    ref = expect_backup(before_host, host.block_pages, before_dev, d, h, slots)
                    assert torch.equal(host_bytes(host), ref)
                else:
                    ref_dev = expect_load(before_dev, host, d, h, slots)
                    got = snapshot(dev)
                    assert all(torch.equal(got[x][y], ref_dev[x][y]) for x in range(L) for y in range(C))
    finally:
        eng.close()


def test_bad_input_copies_nothing() -> None:
    layout = KVLayout(2, 2, 8, "bfloat16", 4)
    dev, host = pools(layout, 8, 8, "page_first")
    eng = create_engine("cuda", dev, host, io_backend="kernel")
    try:
        before = snapshot(dev)
        with pytest.raises(ValueError):
            eng.load(np.array([0, 8]), np.array([1, 2]))
        with pytest.raises(ValueError):
            eng.load(np.array([0, 1]), np.array([2, 2]))
        torch.cuda.synchronize()
        got = snapshot(dev)
        assert all(torch.equal(a, b) for ra, rb in zip(got, before, strict=True) for a, b in zip(ra, rb, strict=True))
        with pytest.raises(ValueError, match="io_backend"):
            create_engine("cuda", dev, host, io_backend="dma")
        assert eng.load(np.zeros(0, np.int64), np.zeros(0, np.int64)).done()
    finally:
        eng.close()


def test_auto_picks_copy_engine_for_large_runs() -> None:
    layout = KVLayout(2, 8, 128, "bfloat16", 64)  # 128 KiB pieces
    dev, host = pools(layout, 64, 64, "layer_first", seed=12)
    eng = create_engine("cuda", dev, host, io_backend="auto", ce_min_copy_bytes=1 << 20)
    try:
        run = np.arange(16, dtype=np.int64)  # 16 consecutive pages: 2 MiB copies
        assert eng.choose_backend(run, run + 8) == "copy_engine"
        scattered = np.arange(0, 32, 2, dtype=np.int64)
        assert eng.choose_backend(scattered, scattered) == "kernel"
        before = snapshot(dev)
        handle = eng.load(run + 8, run)
        assert handle.backend == "copy_engine"  # type: ignore[attr-defined]
        handle.wait()
        expect = expect_load(before, host, run, run + 8, {(x, c) for x in range(2) for c in range(2)})
        got = snapshot(dev)
        assert all(torch.equal(got[x][c], expect[x][c]) for x in range(2) for c in range(2))
    finally:
        eng.close()


def test_auto_picks_staged_for_small_pieces_where_host_runs_are_long() -> None:
    """4 KiB pieces: a page-first pool stages by groups of 8 layers (a 64 KiB run per page); a
    block-first pool (blocks of 16) stages runs of consecutive pages one layer at a time; scattered
    pages of a layer-first or block-first pool make 4 KiB copies, so the gather kernel moves them."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)
    cases = (("page_first", "staged", False), ("layer_first", "kernel", False), ("block_first", "kernel", False),
             ("block_first", "staged", True))
    for host_layout, expect, runs in cases:
        gen = torch.Generator().manual_seed(13)
        dev = DevicePool(layout, 48, "cuda")
        host = HostPool(layout, 64, host_layout, block_pages=16)  # type: ignore[arg-type]
        rand_bytes(host.buffer, gen)
        eng = create_engine("cuda", dev, host, io_backend="auto")
        try:
            d, h = indices(40, 48, 64, seed=14)
            if runs:
                h = np.arange(8, 48, dtype=np.int64)  # blocks 0-2: runs of 8, 16 and 16 pages
            assert eng.choose_backend(d, h) == expect, host_layout
            assert eng.load_lanes == (1 if host_layout != "page_first" else eng.stage_lanes)  # lc-major: one
            handle = load_checked_layer_by_layer(eng, dev, host, d, h)
            assert handle.backend == expect  # type: ignore[attr-defined]
            ev = handle.events  # type: ignore[attr-defined]
            if expect == "staged" and host_layout == "page_first":  # two groups of 8 (too few pages to stagger)
                assert ev[0] is ev[7] and ev[7] is not ev[8]
            elif expect == "staged":  # lc-major: one event per layer
                assert len({id(e) for e in ev}) == layout.num_layers
        finally:
            eng.close()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_large_pool_registered_in_place_and_released() -> None:
    """A 6 GiB unpinned host pool is page-locked in place (offsets past 4 GiB work) and released cleanly."""
    layout = KVLayout(4, 8, 128, "bfloat16", 64)  # 1 MiB pages
    n_host = 6144
    host = HostPool(layout, n_host, "page_first", pin_memory=False)
    dev = DevicePool(layout, 32, "cuda")
    eng = create_engine("cuda", dev, host, io_backend="kernel")
    try:
        assert eng.registered_host  # type: ignore[attr-defined]
        hp = np.concatenate([np.arange(n_host - 12, n_host), np.arange(4)]).astype(np.int64)  # past 4 GiB
        dp = np.random.default_rng(13).permutation(32)[:16].astype(np.int64)
        gen = torch.Generator().manual_seed(14)
        vals = torch.empty((16, *host.buffer.shape[1:]), dtype=host.buffer.dtype)
        rand_bytes(vals, gen)
        host.buffer[torch.from_numpy(hp)] = vals
        eng.load(hp, dp).wait()
        for layer in range(4):
            for c in range(2):
                assert torch.equal(dev.kv[layer][c][torch.from_numpy(dp)].cpu().view(torch.uint8),
                                   vals[:, layer, c].view(torch.uint8))
        hp2 = np.arange(n_host - 40, n_host - 24, dtype=np.int64)
        eng.backup(dp, hp2).wait()
        assert torch.equal(host.buffer[torch.from_numpy(hp2)].view(torch.uint8), vals.view(torch.uint8))
    finally:
        eng.close()
    assert not eng.registered_host  # type: ignore[attr-defined]
    ptr, nbytes = host.buffer.data_ptr(), host.buffer.numel() * host.buffer.element_size()
    cupy.cuda.runtime.hostRegister(ptr, nbytes, 0)  # fails if the engine had left it registered
    cupy.cuda.runtime.hostUnregister(ptr)
    rss = _rss_bytes()
    host.release()
    assert rss - _rss_bytes() > 5 * 2**30


@pytest.mark.parametrize("io_backend", ["kernel", "copy_engine", "staged", "auto", "staged_resident"])
def test_cache_round_trip_through_l2(io_backend: str) -> None:
    """HiCache on the GPU: commit (write-through backup), evict L1, match from L2, load back layer by layer."""
    from hicache.cache import HiCache
    from hicache.config import CacheConfig, HiCacheConfig, LayoutConfig

    cfg = HiCacheConfig(layout=LayoutConfig(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16),
                        cache=CacheConfig(device="cuda", l1_tokens=16 * 64, l2_tokens=16 * 128,
                                          write_policy="write_through",
                                          io_backend=backend_kw(io_backend)["io_backend"],
                                          transfer_options={"stagger_ways": 2, "staging_bytes": 1 << 20,
                                                            "staged_kernel": backend_kw(io_backend).get(
                                                                "staged_kernel", "per_chunk")}))
    cache = HiCache(cfg)
    try:
        assert cache.transfer.name == "cuda"
        assert (cache.transfer.stagger_ways, cache.transfer.staging_bytes) == (2, 1 << 20)  # type: ignore[attr-defined]
        tokens = np.arange(16 * 10, dtype=np.int64) + 1000
        req = cache.match(tokens)
        pages = cache.alloc(req, 10)
        gen = torch.Generator().manual_seed(0)
        written = []
        idx = torch.from_numpy(pages).cuda()
        for layer in range(4):
            row = []
            for c in range(2):
                x = torch.randn((10, 16, 2, 64), generator=gen).to(torch.bfloat16)
                cache.device_pool.kv[layer][c][idx] = x.cuda()  # compute-stream writes, then backup
                row.append(x)
            written.append(row)
        cache.commit(req, tokens, pages)
        cache.release(req)
        cache.flush()
        assert cache.evict(l1_pages=10)[0] == 10
        for layer in range(4):
            for c in range(2):
                cache.device_pool.kv[layer][c].fill_(7.0)
        req = cache.match(tokens)
        assert req.l2_pages == 10
        load = cache.load_back(req)
        assert load.l2_pages == 10
        dev = torch.from_numpy(load.device_indices).cuda()
        outs = []
        for layer in range(4):
            load.wait_layer(layer)
            outs.append([cache.device_pool.kv[layer][c].index_select(0, dev) for c in range(2)])
        for layer in range(4):
            for c in range(2):
                assert torch.equal(outs[layer][c].cpu(), written[layer][c]), (layer, c)
        cache.release(req)
        cache.check_integrity([])
    finally:
        cache.close()
