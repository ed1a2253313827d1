"""CUDA transfer engine on a GPU: kernels and copy engine against torch indexing, streams and events.

Skipped without a CUDA GPU or CuPy (collection imports neither CuPy nor a CUDA build of torch).
"""

import time
from typing import Any

import numpy as np
import pytest
import torch

from hicache.layout import KVLayout
from hicache.pool import DevicePool, HostPool
from hicache.transfer import create_engine

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")

SLEEP_CYCLES = 100_000_000  # ~50 ms of torch.cuda._sleep on a ~2 GHz GPU

# (layout, expected vector width): piece bytes chosen to exercise every kernel width
LAYOUTS = [
    (KVLayout(3, 2, 64, "bfloat16", 16), 16),  # MHA, 4 KiB pieces
    (KVLayout(2, 1, 576, "bfloat16", 3, "mla"), 16),  # MLA latent, odd page size
    (KVLayout(2, 2, 16, "float8_e4m3fn", 5), 16),  # 1-byte elements, 160-byte pieces
    (KVLayout(2, 2, 2, "float16", 1), 8),  # 8-byte pieces
    (KVLayout(2, 1, 3, "float32", 7), 4),  # 4-byte elements, 84-byte pieces
    (KVLayout(2, 3, 7, "float16", 5), 2),  # 2-byte elements, 210-byte pieces
    (KVLayout(3, 1, 5, "uint8", 3), 1),  # 15-byte pieces: byte kernel
]
IDS = ["mha-bf16", "mla-bf16-p3", "fp8-p5", "fp16-w8", "fp32-p7", "fp16-w2", "u8-w1"]


def _rand_bytes(t: torch.Tensor, gen: torch.Generator) -> None:
    b = t.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))


def _pools(layout: KVLayout, n_dev: int, n_host: int, host_layout: str, seed: int = 0,
           pin: bool | None = None, block_pages: int = 4) -> tuple[DevicePool, HostPool]:
    gen = torch.Generator().manual_seed(seed)
    dev = DevicePool(layout, n_dev, "cuda")
    host = HostPool(layout, n_host, host_layout, pin_memory=pin, block_pages=block_pages)  # block-first only
    _rand_bytes(host.buffer, gen)
    for row in dev.kv:
        for t in row:
            cpu = torch.empty(t.shape, dtype=t.dtype)
            _rand_bytes(cpu, gen)
            t.copy_(cpu)
    torch.cuda.synchronize()
    return dev, host


def _snapshot(dev: DevicePool) -> list[list[torch.Tensor]]:
    return [[t.view(torch.uint8).cpu() for t in row] for row in dev.kv]


def _host_bytes(host: HostPool) -> torch.Tensor:
    """The pool as bytes ``[P / B, L, C, B, S, H, D * element size]`` (every layout)."""
    return host.blocks.view(torch.uint8)


def _expect_load(dev_before, host: HostPool, d: np.ndarray, h: np.ndarray, slots: set[tuple[int, int]]):
    out = [[t.clone() for t in row] for row in dev_before]
    for layer, c in slots:
        out[layer][c][torch.from_numpy(d)] = host.read_pieces(layer, c, torch.from_numpy(h))
    return out


def _expect_backup(host_before: torch.Tensor, block_pages: int, dev_snap, d: np.ndarray, h: np.ndarray,
                   slots: set[tuple[int, int]]) -> torch.Tensor:
    """``host_before`` (:func:`_host_bytes`) with the pieces of device pages ``d`` written to host pages
    ``h``."""
    out = host_before.clone()
    ht = torch.from_numpy(h)
    for layer, c in slots:
        out[:, layer, c][ht // block_pages, ht % block_pages] = dev_snap[layer][c][torch.from_numpy(d)]
    return out


def _backend_kw(io_backend: str) -> dict[str, Any]:
    """Engine keywords of a test backend name: ``staged_resident`` is the staged path with its
    device-side copies in one resident kernel, ``staged_lc`` with lc-major slots for a block-first pool
    (instead of slots that mirror its blocks)."""
    if io_backend == "staged_resident":
        return {"io_backend": "staged", "staged_kernel": "resident"}
    if io_backend == "staged_lc":
        return {"io_backend": "staged", "block_staging": "lc_major"}
    return {"io_backend": io_backend}


def _indices(n: int, n_dev: int, n_host: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(n_dev)[:n].astype(np.int64), rng.permutation(n_host)[:n].astype(np.int64)


@pytest.mark.parametrize("io_backend", ["kernel", "copy_engine", "staged", "staged_resident", "staged_lc"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "block_first"])
@pytest.mark.parametrize(("layout", "width"), LAYOUTS, ids=IDS)
def test_load_and_backup_match_torch(layout: KVLayout, width: int, host_layout: str, io_backend: str) -> None:
    n_dev, n_host, n = 37, 41, 23
    dev, host = _pools(layout, n_dev, n_host, host_layout, seed=1)
    kw = _backend_kw(io_backend)
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
        d, h = _indices(n, n_dev, n_host, seed=2)
        if host_layout == "block_first":  # a run of consecutive pages across blocks, as allocated
            h = np.random.default_rng(2).permutation(np.arange(5, 5 + n)).astype(np.int64)
        before = _snapshot(dev)
        handle = eng.load(h, d)
        handle.wait()
        assert handle.done()
        expect = _expect_load(before, host, d, h, every)
        got = _snapshot(dev)
        for layer in range(L):
            for c in range(C):
                assert torch.equal(got[layer][c], expect[layer][c]), (layer, c)
        # backup: every layer at once, to other host pages
        d, h = _indices(n, n_dev, n_host, seed=3)
        hb = _host_bytes(host).clone()
        dsnap = _snapshot(dev)
        handle = eng.backup(d, h)
        handle.wait()
        assert handle.done()
        assert torch.equal(_host_bytes(host), _expect_backup(hb, host.block_pages, dsnap, d, h, every))
    finally:
        eng.close()


def _check_backup(eng: Any, dev: DevicePool, host: HostPool, pages: np.ndarray, n_dev: int, seed: int,
                  every: set[tuple[int, int]]) -> None:
    """Back ``pages`` (host pages, shuffled) up from random L1 pages; the host pool must equal torch's."""
    h = np.random.default_rng(seed).permutation(pages).astype(np.int64)
    d = np.random.default_rng(seed + 1).permutation(n_dev)[:len(h)].astype(np.int64)
    hb = _host_bytes(host).clone()
    dsnap = _snapshot(dev)
    eng.backup(d, h).wait()
    assert torch.equal(_host_bytes(host), _expect_backup(hb, host.block_pages, dsnap, d, h, every))


@pytest.mark.parametrize("block_staging", ["mirror", "lc_major"])
@pytest.mark.parametrize(("layout", "width"), LAYOUTS[:3] + LAYOUTS[-1:], ids=IDS[:3] + IDS[-1:])
def test_block_first_staging_with_whole_blocks(layout: KVLayout, width: int, block_staging: str) -> None:
    """Staged transfers of a block-first pool (blocks of 4) over runs that cover whole blocks and parts
    of others, with slots of several whole blocks: layer-wise and whole loads, and backups, equal torch's."""
    n_dev, n_host = 61, 64
    dev, host = _pools(layout, n_dev, n_host, "block_first", seed=5)
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
            before = _snapshot(dev)
            handle = eng.load(h, d, layer_wise=layer_wise)
            handle.wait()
            expect = _expect_load(before, host, d, h, every)
            got = _snapshot(dev)
            for layer in range(L):
                for c in range(C):
                    assert torch.equal(got[layer][c], expect[layer][c]), (layer_wise, layer, c)
        _check_backup(eng, dev, host, np.concatenate([runs[:30], [60, 62]]), n_dev, 12, every)
    finally:
        eng.close()


def test_mirrored_backup_of_blocks_larger_than_a_slot() -> None:
    """A block of every layer outgrows the backup slot (a deep model's blocks do): the backup goes in
    groups of layers whose bins fit, still through mirrored slots, and equals torch's."""
    layout = KVLayout(4, 2, 64, "bfloat16", 16)  # 4 KiB pieces
    n_dev, n_host = 61, 64
    dev, host = _pools(layout, n_dev, n_host, "block_first", seed=8, block_pages=16)
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
        _check_backup(eng, dev, host, np.concatenate([np.arange(0, 40), [45, 50, 63]]), n_dev, 14, every)
    finally:
        eng.close()


@pytest.mark.parametrize("launch", ["driver", "cupy"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "block_first"])
@pytest.mark.parametrize(("layout", "width"), LAYOUTS[:3] + LAYOUTS[-1:], ids=IDS[:3] + IDS[-1:])
def test_kernel_one_layer_and_all_layers(layout: KVLayout, width: int, host_layout: str, launch: str) -> None:
    """The raw kernel for one slot range and for all slots, both directions, launched through the driver
    API (the default) and through CuPy (the fallback)."""
    n_dev, n_host, n = 29, 31, 19
    dev, host = _pools(layout, n_dev, n_host, host_layout, seed=4)
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
                d, h = _indices(n, n_dev, n_host, seed=lc_begin * 7 + n_lc + int(to_host))
                idx = torch.from_numpy(np.stack([d, host.host_keys(h)])).cuda()  # kernels address host keys
                before_dev, before_host = _snapshot(dev), _host_bytes(host).clone()
                eng.kernel.launch(stream.cuda_stream, idx.data_ptr(), idx.data_ptr() + n * 8, n, lc_begin, n_lc,
                                  to_host)
                torch.cuda.synchronize()
                if to_host:
                    ref = _expect_backup(before_host, host.block_pages, before_dev, d, h, slots)
                    assert torch.equal(_host_bytes(host), ref)
                else:
                    ref_dev = _expect_load(before_dev, host, d, h, slots)
                    got = _snapshot(dev)
                    assert all(torch.equal(got[x][y], ref_dev[x][y]) for x in range(L) for y in range(C))
    finally:
        eng.close()


def test_bad_input_copies_nothing() -> None:
    layout = KVLayout(2, 2, 8, "bfloat16", 4)
    dev, host = _pools(layout, 8, 8, "page_first")
    eng = create_engine("cuda", dev, host, io_backend="kernel")
    try:
        before = _snapshot(dev)
        with pytest.raises(ValueError):
            eng.load(np.array([0, 8]), np.array([1, 2]))
        with pytest.raises(ValueError):
            eng.load(np.array([0, 1]), np.array([2, 2]))
        torch.cuda.synchronize()
        got = _snapshot(dev)
        assert all(torch.equal(a, b) for ra, rb in zip(got, before, strict=True) for a, b in zip(ra, rb, strict=True))
        with pytest.raises(ValueError, match="io_backend"):
            create_engine("cuda", dev, host, io_backend="dma")
        assert eng.load(np.zeros(0, np.int64), np.zeros(0, np.int64)).done()
    finally:
        eng.close()


BIG = KVLayout(8, 8, 128, "bfloat16", 256)  # 512 KiB pieces: 64 pages = 64 MiB per layer, ~1.2 ms at 55 GB/s


@pytest.mark.parametrize(("io_backend", "layer_signal", "expect_signal"),
                         [("kernel", "auto", "flags"), ("kernel", "events", "events"), ("copy_engine", "auto", None),
                          ("staged", "auto", None), ("staged_resident", "auto", None)])
def test_layer_visible_after_wait_layer(io_backend: str, layer_signal: str, expect_signal: str | None) -> None:
    """Compute queued after wait_layer(i) sees layer i; the host never blocks; the handle polls."""
    n = 64
    dev, host = _pools(BIG, n, n, "page_first", seed=5)
    eng = create_engine("cuda", dev, host, layer_signal=layer_signal, **_backend_kw(io_backend))
    try:
        if expect_signal is not None:
            assert eng.layer_signal == expect_signal  # type: ignore[attr-defined]
        d, h = _indices(n, n, n, seed=6)
        for row in dev.kv:
            for t in row:
                t.view(torch.uint8).fill_(0xA5)  # poison
        torch.cuda.synchronize()
        before = _snapshot(dev)
        handle = eng.load(h, d)
        assert not handle.done()  # 512 MiB cannot have landed yet; done() returned without blocking
        snaps = []
        for layer in range(BIG.num_layers):
            handle.wait_layer(layer)
            snaps.append([t.view(torch.uint8).clone() for t in dev.kv[layer]])  # queued on the compute stream
        assert not handle.done()  # wait_layer did not block the host
        torch.cuda.synchronize()
        expect = _expect_load(before, host, d, h, {(x, c) for x in range(BIG.num_layers) for c in range(2)})
        for layer in range(BIG.num_layers):
            for c in range(2):
                assert torch.equal(snaps[layer][c].cpu(), expect[layer][c]), (layer, c)
    finally:
        eng.close()


def test_flag_loads_in_sequence_and_from_another_thread() -> None:
    """Back-to-back single-launch loads: each handle's layers (old ones too) gate compute correctly,
    also when wait_layer is called from a thread that has not touched CUDA yet."""
    import threading

    layout = KVLayout(4, 8, 128, "bfloat16", 64)  # 128 KiB pieces
    n = 32
    dev, host = _pools(layout, 3 * n, 3 * n, "layer_first", seed=20)
    eng = create_engine("cuda", dev, host, io_backend="kernel")
    try:
        assert eng.layer_signal == "flags"  # type: ignore[attr-defined]
        rng = np.random.default_rng(21)
        before = _snapshot(dev)
        torch.cuda._sleep(SLEEP_CYCLES)  # loads start after this, so every wait below is a real stream wait
        jobs = []
        for j in range(3):
            d = np.arange(j * n, (j + 1) * n, dtype=np.int64)
            h = rng.permutation(3 * n)[:n].astype(np.int64)
            jobs.append((d, h, eng.load(h, d)))
        out: dict[int, list[torch.Tensor]] = {}

        def consume(j: int) -> None:
            d, _, handle = jobs[j]
            handle.wait_layer(0)  # first CUDA call of the thread
            dd = torch.from_numpy(d).cuda()
            snaps = []
            for layer in range(layout.num_layers):
                handle.wait_layer(layer)
                snaps.extend(t.index_select(0, dd).view(torch.uint8) for t in dev.kv[layer])
            torch.cuda.current_stream().synchronize()
            out[j] = [x.cpu() for x in snaps]

        assert not jobs[0][2].done()
        t = threading.Thread(target=consume, args=(0,))
        t.start()
        t.join()
        consume(2)
        consume(1)
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        for j, (d, h, _) in enumerate(jobs):
            expect = _expect_load(before, host, d, h, every)
            i = 0
            for layer in range(layout.num_layers):
                for c in range(2):
                    assert torch.equal(out[j][i], expect[layer][c][torch.from_numpy(d)]), (j, layer, c)
                    i += 1
    finally:
        eng.close()


SMALL = KVLayout(4, 2, 64, "bfloat16", 16)  # 4 KiB pieces


def _small_engine(io_backend: str, seed: int) -> tuple[DevicePool, HostPool, Any]:
    """16-page pools of ``SMALL`` (a page-first L2 for the staged paths) and an engine on them."""
    dev, host = _pools(SMALL, 16, 16, "page_first" if io_backend.startswith("staged") else "layer_first", seed=seed)
    return dev, host, create_engine("cuda", dev, host, **_backend_kw(io_backend))


@pytest.mark.parametrize("io_backend", ["kernel", "copy_engine", "staged", "staged_resident"])
def test_backup_waits_for_compute_writer(io_backend: str) -> None:
    """A backup submitted right after the compute stream writes the pages copies the new values."""
    layout = SMALL
    dev, host, eng = _small_engine(io_backend, seed=7)
    try:
        d, h = _indices(8, 16, 16, seed=8)
        gen = torch.Generator().manual_seed(9)
        new = []
        for row in dev.kv:
            for t in row:
                x = torch.empty((8, *t.shape[1:]), dtype=t.dtype)
                _rand_bytes(x, gen)
                new.append(x.cuda())
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # the writer is late
        i = 0
        dd = torch.from_numpy(d).cuda()
        for row in dev.kv:
            for t in row:
                t.index_copy_(0, dd, new[i])
                i += 1
        handle = eng.backup(d, h)  # no host synchronisation in between
        handle.wait()
        i = 0
        for layer in range(layout.num_layers):
            for c in range(2):
                got = host.layer_view(layer, c)[torch.from_numpy(h)]
                assert torch.equal(got.view(torch.uint8), new[i].cpu().view(torch.uint8)), (layer, c)
                i += 1
    finally:
        eng.close()


@pytest.mark.parametrize("io_backend", ["kernel", "copy_engine", "staged", "staged_resident"])
def test_load_waits_for_compute_reader(io_backend: str) -> None:
    """A load into pages the compute stream is still reading (late) leaves them alone until it has read."""
    layout = SMALL
    dev, host, eng = _small_engine(io_backend, seed=30)
    try:
        d, h = _indices(8, 16, 16, seed=31)
        dd = torch.from_numpy(d).cuda()
        old = [[t.index_select(0, dd).view(torch.uint8).cpu() for t in row] for row in dev.kv]
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # the reader is late
        read = [[t.index_select(0, dd) for t in row] for row in dev.kv]
        handle = eng.load(h, d)  # no host synchronisation in between
        handle.wait()
        torch.cuda.synchronize()
        for layer in range(layout.num_layers):
            for c in range(2):
                assert torch.equal(read[layer][c].view(torch.uint8).cpu(), old[layer][c]), (layer, c)
                got = dev.kv[layer][c][dd].view(torch.uint8).cpu()
                assert torch.equal(got, host.layer_view(layer, c)[torch.from_numpy(h)].view(torch.uint8))
    finally:
        eng.close()


@pytest.mark.parametrize("io_backend", ["kernel", "copy_engine", "staged", "staged_resident"])
def test_load_waits_for_backup_of_same_host_pages(io_backend: str) -> None:
    """Load of host pages a running backup is writing sees the backed-up data (cross-stream ordering)."""
    n = 64
    dev, host = _pools(BIG, 2 * n, n, "page_first", seed=10)
    eng = create_engine("cuda", dev, host, **_backend_kw(io_backend))
    try:
        a = np.arange(n, dtype=np.int64)
        b = np.arange(n, 2 * n, dtype=np.int64)
        hp = np.random.default_rng(11).permutation(n).astype(np.int64)
        src = [[t[:n].view(torch.uint8).cpu() for t in row] for row in dev.kv]
        back = eng.backup(a, hp)  # ~10 ms of D2H
        load = eng.load(hp, b)  # must not read hp before the backup wrote it
        load.wait()
        assert back.done()
        for layer in range(BIG.num_layers):
            for c in range(2):
                assert torch.equal(dev.kv[layer][c][n:].view(torch.uint8).cpu(), src[layer][c]), (layer, c)
    finally:
        eng.close()


@pytest.mark.parametrize("streams", [1, 2, 4, 7])
def test_copy_engine_backup_fanned_over_streams(streams: int) -> None:
    """A copy-engine backup split over several streams copies every piece once and completes, as seen
    by its handle and by a load of the same host pages submitted right after it, as one stream would."""
    layout = KVLayout(4, 2, 64, "bfloat16", 16)
    n = 96
    dev, host = _pools(layout, 2 * n, 2 * n, "layer_first", seed=21)
    eng = create_engine("cuda", dev, host, io_backend="copy_engine", backup_streams=streams)
    try:
        assert len(eng._backup_lanes) == streams - 1
        d, h = _indices(n, n, 2 * n, seed=22)
        every = {(layer, c) for layer in range(layout.num_layers) for c in range(2)}
        hb = _host_bytes(host).clone()
        dsnap = _snapshot(dev)
        torch.cuda._sleep(SLEEP_CYCLES)  # the backup queues behind compute; the load behind the backup
        back = eng.backup(d, h)
        load = eng.load(h, np.arange(n, 2 * n, dtype=np.int64))
        assert not back.done()
        load.wait()
        assert back.done()
        assert torch.equal(_host_bytes(host), _expect_backup(hb, host.block_pages, dsnap, d, h, every))
        for layer in range(layout.num_layers):
            for c in range(2):
                got = dev.kv[layer][c][n:].view(torch.uint8).cpu()
                assert torch.equal(got, dsnap[layer][c][torch.from_numpy(d)]), (layer, c)
    finally:
        eng.close()


@pytest.mark.parametrize("io_backend", ["kernel", "staged"])
def test_backup_starts_while_a_large_load_is_queued(io_backend: str) -> None:
    """A backup submitted behind a large copy-engine load finishes long before that load does.

    The backup's index array must not reach the GPU by a copy that queues behind the load's DMA (it would
    then start only once the whole load had drained), and it copies the right pages.
    """
    layout = KVLayout(4, 8, 128, "bfloat16", 64)  # 128 KiB pieces: the load is 4 x 2 x 128 KiB per page
    n_load, n_back = 512, 8  # 512 MiB load (about 10 ms at PCIe Gen5 rates), 8 MiB backup
    dev, host = _pools(layout, n_load + n_back, n_load + n_back, "page_first", seed=14, pin=True)
    big = create_engine("cuda", dev, host, io_backend="copy_engine")
    small = create_engine("cuda", dev, host, io_backend=io_backend)
    try:
        src = [[t[n_load:].view(torch.uint8).cpu() for t in row] for row in dev.kv]
        pages = np.arange(n_load, dtype=np.int64)
        back_dev = np.arange(n_load, n_load + n_back, dtype=np.int64)
        back_host = back_dev[::-1].copy()
        load = big.load(pages, pages)
        back = small.backup(back_dev, back_host)
        back.wait()
        assert not load.done(), "the backup waited for the whole load"
        load.wait()
        for layer in range(layout.num_layers):
            for c in range(2):
                got = host.buffer[torch.from_numpy(back_host), layer, c].view(torch.uint8).reshape(n_back, -1)
                assert torch.equal(got, src[layer][c].reshape(n_back, -1)), (layer, c)
    finally:
        small.close()
        big.close()


def test_auto_picks_copy_engine_for_large_runs() -> None:
    layout = KVLayout(2, 8, 128, "bfloat16", 64)  # 128 KiB pieces
    dev, host = _pools(layout, 64, 64, "layer_first", seed=12)
    eng = create_engine("cuda", dev, host, io_backend="auto", ce_min_copy_bytes=1 << 20)
    try:
        run = np.arange(16, dtype=np.int64)  # 16 consecutive pages: 2 MiB copies
        assert eng.choose_backend(run, run + 8) == "copy_engine"
        scattered = np.arange(0, 32, 2, dtype=np.int64)
        assert eng.choose_backend(scattered, scattered) == "kernel"
        before = _snapshot(dev)
        handle = eng.load(run + 8, run)
        assert handle.backend == "copy_engine"  # type: ignore[attr-defined]
        handle.wait()
        expect = _expect_load(before, host, run, run + 8, {(x, c) for x in range(2) for c in range(2)})
        got = _snapshot(dev)
        assert all(torch.equal(got[x][c], expect[x][c]) for x in range(2) for c in range(2))
    finally:
        eng.close()


def _load_checked_layer_by_layer(eng: Any, dev: DevicePool, host: HostPool, d: np.ndarray,
                                 h: np.ndarray) -> Any:
    """Load host pages ``h`` into device pages ``d`` behind a busy compute stream, snapshot each layer
    right after ``wait_layer`` returns, and check every snapshot against the host data; the handle."""
    L, C = dev.layout.num_layers, dev.layout.kv_count
    before = _snapshot(dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    handle = eng.load(h, d)
    snaps = []
    for layer in range(L):
        handle.wait_layer(layer)
        snaps.append([t.view(torch.uint8).clone() for t in dev.kv[layer]])
    torch.cuda.synchronize()
    want = _expect_load(before, host, d, h, {(x, c) for x in range(L) for c in range(C)})
    for layer in range(L):
        for c in range(C):
            assert torch.equal(snaps[layer][c].cpu(), want[layer][c]), (layer, c)
    return handle


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
        _rand_bytes(host.buffer, gen)
        eng = create_engine("cuda", dev, host, io_backend="auto")
        try:
            d, h = _indices(40, 48, 64, seed=14)
            if runs:
                h = np.arange(8, 48, dtype=np.int64)  # blocks 0-2: runs of 8, 16 and 16 pages
            assert eng.choose_backend(d, h) == expect, host_layout
            assert eng.load_lanes == (1 if host_layout != "page_first" else eng.stage_lanes)  # lc-major: one
            handle = _load_checked_layer_by_layer(eng, dev, host, d, h)
            assert handle.backend == expect  # type: ignore[attr-defined]
            ev = handle.events  # type: ignore[attr-defined]
            if expect == "staged" and host_layout == "page_first":  # two groups of 8 (too few pages to stagger)
                assert ev[0] is ev[7] and ev[7] is not ev[8]
            elif expect == "staged":  # lc-major: one event per layer
                assert len({id(e) for e in ev}) == layout.num_layers
        finally:
            eng.close()


@pytest.mark.parametrize("kernel", ["per_chunk", "resident"])
@pytest.mark.parametrize("ways", [1, 2, 4])
def test_staggered_staged_load_layer_by_layer(ways: int, kernel: str) -> None:
    """A load of 4 KiB pieces in two groups of 8 layers, staggered ``ways`` ways: each layer holds the
    host data once its wait returns, and layers become ready in ``2 * ways`` steps (per-chunk kernels:
    one event per step; resident: one flag per layer and one completion event)."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces: 8 layers make a 64 KiB run per page
    n = 512  # parts of at least 128 pages
    dev, host = _pools(layout, n + 64, n + 32, "page_first", seed=21, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", stagger_ways=ways, staged_kernel=kernel)
    try:
        d, h = _indices(n, n + 64, n + 32, seed=22)
        handle = _load_checked_layer_by_layer(eng, dev, host, d, h)
        steps = len({id(e) for e in handle.events})  # type: ignore[attr-defined]
        if kernel == "resident":
            assert steps == 1 and handle.flags is not None  # type: ignore[attr-defined]
        else:
            assert steps == 2 * ways, steps
    finally:
        eng.close()


@pytest.mark.parametrize("kernel", ["per_chunk", "resident"])
def test_staged_whole_load_moves_whole_pages(kernel: str) -> None:
    """``layer_wise=False``: a staged load of several layer groups moves whole pages in one group, not
    staggered and with no head (every layer ready at once), and lands the same data; the default load
    of the same engine is still staggered."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces: groups of 8 layers when layer-wise
    n = 512
    dev, host = _pools(layout, 2 * n, 2 * n, "page_first", seed=64, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staged_kernel=kernel, load_head_layers=2)
    try:
        d, h = _indices(n, 2 * n, 2 * n, seed=65)
        L = layout.num_layers
        before = _snapshot(dev)
        torch.cuda._sleep(SLEEP_CYCLES)
        handle = eng.load(h, d, layer_wise=False)
        snaps = []
        for layer in range(L):
            handle.wait_layer(layer)
            snaps.append([t.view(torch.uint8).clone() for t in dev.kv[layer]])
        torch.cuda.synchronize()
        want = _expect_load(before, host, d, h, {(x, c) for x in range(L) for c in range(2)})
        for layer in range(L):
            for c in range(2):
                assert torch.equal(snaps[layer][c].cpu(), want[layer][c]), (layer, c)
        assert len({id(e) for e in handle.events}) == 1  # type: ignore[attr-defined]
        if kernel == "per_chunk":
            d2, h2 = _indices(n, 2 * n, 2 * n, seed=66)
            layered = _load_checked_layer_by_layer(eng, dev, host, d2, h2)
            assert len({id(e) for e in layered.events}) > 2  # type: ignore[attr-defined]
    finally:
        eng.close()


@pytest.mark.parametrize("head", [1, 3, 40])
def test_staged_load_head_layers_by_kernel(head: int) -> None:
    """``load_head_layers``: a staged load's first layers come from the gather kernel, one event each,
    beside the staggered DMA of the rest (at most all layers but one). Every layer holds the host data
    once its wait returns; two loads into the same device pages, the first one's head held up, end with
    the second's data; a load of a single layer group has no head."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces: groups of 8 layers
    n = 512
    dev, host = _pools(layout, 2 * n, 2 * n, "page_first", seed=60, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", load_head_layers=head)
    try:
        d, h = _indices(n, 2 * n, 2 * n, seed=61)
        handle = _load_checked_layer_by_layer(eng, dev, host, d, h)
        ev = handle.events  # type: ignore[attr-defined]
        k = min(head, layout.num_layers - 1)
        assert len({id(e) for e in ev[:k]}) == k and not {id(e) for e in ev[:k]} & {id(e) for e in ev[k:]}
        d2 = d[: n // 2]
        h1, h2 = h[: n // 2], h[n // 2:]
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = _expect_load(_snapshot(dev), host, d2, h2, every)
        head_stream, _ = eng._head_copier()  # type: ignore[attr-defined]
        _two_loads_behind(head_stream, eng, dev, (h1, d2), (h2, d2), want)
    finally:
        eng.close()
    small = KVLayout(4, 2, 64, "bfloat16", 16)  # 4 layers of 4 KiB pieces: one group of whole pages
    dev, host = _pools(small, 64, 64, "page_first", seed=62, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", load_head_layers=head)
    try:
        d, h = _indices(64, 64, 64, seed=63)
        handle = _load_checked_layer_by_layer(eng, dev, host, d, h)
        assert len({id(e) for e in handle.events}) == 1  # type: ignore[attr-defined]
    finally:
        eng.close()


@pytest.mark.parametrize("kernel", ["per_chunk", "resident"])
def test_staged_loads_queued_back_to_back_while_scatters_wait(kernel: str) -> None:
    """Staged loads queued back to back with no host wait, while the stage stream is held up (as when a
    GEMM keeps the SMs), slots (4 of 1 MiB) reused within and across loads: each handle's layers gate
    compute on the right data. Then the first backup, from a compute stream still busy with those
    waits, of the last load's pages into host pages some loads read: it sees the loaded data (its
    stager's flags are set before its kernel or DMA reads them)."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces
    n = 128
    dev, host = _pools(layout, 5 * n, 5 * n, "page_first", seed=40, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staged_kernel=kernel, staging_bytes=4 << 20)
    try:
        rng = np.random.default_rng(41)
        pairs = [(np.arange(k * n, (k + 1) * n, dtype=np.int64), rng.permutation(5 * n)[:n].astype(np.int64))
                 for k in range(4)]
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = _snapshot(dev)
        for d, h in pairs:  # device pages are disjoint: each load's expectation, from the host as it is now
            want = _expect_load(want, host, d, h, every)
        st = eng._stager(False)  # type: ignore[attr-defined]
        with torch.cuda.stream(st.stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # the stage stream is late: scatters queue up
        handles = [eng.load(h, d) for d, h in pairs]
        snaps = []
        for handle in handles:
            per_layer = []
            for layer in range(layout.num_layers):
                handle.wait_layer(layer)
                per_layer.append([t.view(torch.uint8).clone() for t in dev.kv[layer]])
            snaps.append(per_layer)
        last_d, _ = pairs[-1]
        back_h = np.arange(n, dtype=np.int64)  # host pages some loads still read: the backup waits for them
        back = eng.backup(last_d, back_h)
        back.wait()
        torch.cuda.synchronize()
        for (d, _), per_layer in zip(pairs, snaps, strict=True):
            for layer in range(layout.num_layers):
                for c in range(2):
                    got = per_layer[layer][c].cpu()[torch.from_numpy(d)]
                    assert torch.equal(got, want[layer][c][torch.from_numpy(d)]), (layer, c)
        for layer in range(layout.num_layers):
            for c in range(2):
                stored = host.layer_view(layer, c)[torch.from_numpy(back_h)].view(torch.uint8)
                assert torch.equal(stored, want[layer][c][torch.from_numpy(last_d)]), (layer, c)
    finally:
        eng.close()


def test_block_first_whole_loads_scatter_on_every_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a block-first pool a layer-wise load scatters on one lane and a whole load on every lane; loads
    of both kinds queued back to back into the same device pages, reusing every slot on other lanes,
    leave the last one's data."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # the default lanes: several
    layout = KVLayout(4, 2, 64, "bfloat16", 16)  # 4 KiB pieces
    dev, host = _pools(layout, 64, 192, "block_first", seed=60, block_pages=16)
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=1 << 20)
    try:
        st = eng._stager(False)  # type: ignore[attr-defined]
        assert eng.load_lanes == 1 and len(st.lanes) > 1  # type: ignore[attr-defined]
        used: list[int] = []
        lane_of = st.lane

        def spy(slot: int, lanes: int | None = None) -> torch.cuda.Stream:
            stream = lane_of(slot, lanes)
            used.append(next(i for i, x in enumerate(st.lanes) if x is stream))
            return stream

        monkeypatch.setattr(st, "lane", spy)
        rng = np.random.default_rng(61)
        d = rng.permutation(64)[:56].astype(np.int64)
        loads = [(np.arange(0, 56), False), (np.arange(64, 120), True), (np.arange(128, 184), False)]
        every = {(x, c) for x in range(layout.num_layers) for c in range(layout.kv_count)}
        want = _expect_load(_snapshot(dev), host, d, loads[-1][0], every)
        torch.cuda._sleep(SLEEP_CYCLES)  # all three queued before any runs
        handles = []
        for h, layer_wise in loads:
            before = len(used)
            handles.append(eng.load(h.astype(np.int64), d, layer_wise=layer_wise))
            lanes = set(used[before:])
            assert len(used) - before > len(st.lanes)  # every slot used more than once in all
            assert lanes == ({0} if layer_wise else set(range(len(st.lanes)))), (layer_wise, lanes)
        for hd in handles:
            hd.wait()
        torch.cuda.synchronize()
        got = _snapshot(dev)
        for layer in range(layout.num_layers):
            for c in range(layout.kv_count):
                assert torch.equal(got[layer][c], want[layer][c]), (layer, c)
    finally:
        eng.close()


def _two_loads_behind(held: torch.cuda.Stream, eng: Any, dev: DevicePool, first: tuple[np.ndarray, np.ndarray],
                      second: tuple[np.ndarray, np.ndarray], want: list[list[torch.Tensor]]) -> None:
    """Hold ``held`` with a sleep, queue the loads ``first`` then ``second`` (host pages, device pages),
    wait for both, and check the device pool against ``want``."""
    with torch.cuda.stream(held):
        torch.cuda._sleep(SLEEP_CYCLES)
    a = eng.load(*first)
    b = eng.load(*second)
    b.wait()
    a.wait()
    torch.cuda.synchronize()
    for layer in range(dev.layout.num_layers):
        for c in range(dev.layout.kv_count):
            assert torch.equal(dev.kv[layer][c].view(torch.uint8).cpu(), want[layer][c]), (layer, c)


def test_staged_load_leaves_the_load_stream_free_while_its_scatters_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged load whose scatters are held on every lane (as when compute keeps the SMs): the next
    staged load's DMAs run meanwhile, since the load stream does not wait for the held scatters, and a
    copy-engine load into the same device pages, queued after both, still lands after the held ones."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces: two groups of 8 layers, one chunk each
    n = 8
    dev, host = _pools(layout, 4 * n, 4 * n, "page_first", seed=57, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=8 << 20, stage_lanes=2)
    try:
        perm = np.random.default_rng(58).permutation(4 * n).astype(np.int64)
        d1, d2 = perm[:n], perm[n:2 * n]
        h1, h2, h3 = (np.arange(k * n, (k + 1) * n, dtype=np.int64) for k in range(3))
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = _expect_load(_expect_load(_snapshot(dev), host, d2, h2, every), host, d1, h3, every)
        st = eng._stager(False)  # type: ignore[attr-defined]
        for lane in st.lanes:
            with torch.cuda.stream(lane):
                torch.cuda._sleep(4 * SLEEP_CYCLES)  # ~200 ms
        held = torch.cuda.Event()
        held.record(st.lanes[0])
        a = eng.load(h1, d1)
        b = eng.load(h2, d2)
        b.submit()  # type: ignore[attr-defined]  # every unit queued (a layer-wise load defers its later ones)
        dma_done = torch.cuda.Event()
        dma_done.record(eng.load_stream)  # after the second load's DMAs
        deadline = time.monotonic() + 5
        while not dma_done.query() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert dma_done.query() and not held.query(), "the load stream waited for held scatters"
        assert not a.done() and not b.done()
        monkeypatch.setattr(eng, "choose_backend", lambda *_: "copy_engine")
        c = eng.load(h3, d1)  # into the first load's pages: must land after its held scatters
        c.wait()
        assert held.query()
        a.wait()
        b.wait()
        torch.cuda.synchronize()
        for layer in range(layout.num_layers):
            for k in range(2):
                assert torch.equal(dev.kv[layer][k].view(torch.uint8).cpu(), want[layer][k]), (layer, k)
    finally:
        eng.close()


@pytest.mark.parametrize("lanes", [1, 3, 8])
def test_staged_loads_into_the_same_pages_land_in_order(lanes: int) -> None:
    """Two staged loads of different host pages into the same device pages, queued back to back, the
    first one's first scatter held up on its lane (as when a GEMM keeps the SMs) while the second's
    would run on another: the device pages end with the second load's data. Lanes run a transfer's
    scatters side by side, never one transfer's past the other's."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces: two groups of 8 layers, one chunk each
    n = 8
    dev, host = _pools(layout, 4 * n, 4 * n, "page_first", seed=50, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=4 << 20, stage_lanes=lanes)
    try:
        d = np.random.default_rng(51).permutation(4 * n)[:n].astype(np.int64)
        h1, h2 = np.arange(n, dtype=np.int64), np.arange(2 * n, 3 * n, dtype=np.int64)
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = _expect_load(_snapshot(dev), host, d, h2, every)
        st = eng._stager(False)  # type: ignore[attr-defined]
        assert len(st.lanes) == min(lanes, st.n_slots)
        # slot 0's lane held: the first load's layers 0-7 scatter late
        _two_loads_behind(st.lanes[0], eng, dev, (h1, d), (h2, d), want)
    finally:
        eng.close()


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_staged_loads_over_several_dma_streams_land_in_order(streams: int) -> None:
    """Two staged loads of different host pages into the same device pages, queued back to back, their
    chunks' DMAs spread over ``load_streams`` streams with different boundaries (the second has one
    more page, first in host order), the first one's second chunk held up on its stream: the device
    pages end with the second load's data, and every layer of each load is right once it is ready."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces: groups of 8 layers, 64 KiB runs
    n = 40
    dev, host = _pools(layout, 2 * n + 1, 4 * n, "page_first", seed=54, pin=True)
    # 4 MiB of staging: load slots of 1 MiB (16 pages of a group), several chunks per group
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=4 << 20, stage_lanes=4,
                        load_streams=streams, stagger_ways=1)
    try:
        d = np.random.default_rng(55).permutation(2 * n + 1).astype(np.int64)
        d1, d2 = d[1:n + 1], d[:n + 1]
        h1 = np.arange(2 * n, 3 * n, dtype=np.int64)
        h2 = np.arange(0, n + 1, dtype=np.int64)  # page 0 shifts every chunk boundary by one page
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = _expect_load(_expect_load(_snapshot(dev), host, d1, h1, every), host, d2, h2, every)
        held = eng._dma_streams(eng.load_stream, to_host=False).all[1 % streams]  # type: ignore[attr-defined]
        _two_loads_behind(held, eng, dev, (h1, d1), (h2, d2), want)  # the first load's chunk 1 lands late
        h = np.random.default_rng(56).permutation(4 * n)[:n].astype(np.int64)
        _load_checked_layer_by_layer(eng, dev, host, d1, h)
    finally:
        eng.close()


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_staged_backups_to_the_same_host_pages_land_in_order(streams: int) -> None:
    """Two staged backups of different device pages into the same host pages, queued back to back, their
    chunks' DMAs spread over ``backup_streams`` streams with different boundaries (the second has one
    more page, first in host order), the first one's second chunk held up on its stream: the host pages
    end with the second backup's data. Parallel DMA streams never let one backup's writes pass the
    other's."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces, 128 KiB pages
    n = 8
    dev, host = _pools(layout, 4 * n, 4 * n, "page_first", seed=52, pin=True)
    # 16 slots of 256 KiB (2 pages), gathers on 4 lanes, so no slot or held stream is shared by the two
    # backups' chunks: the first backup goes in chunks of pages 1 | 2 | 3 | 4 | 5-6 | 7-8, the second
    # 0 | 1 | 2 | 3 | 4-5 | 6-7 | 8, chunk k's DMA on stream k % streams
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=4 << 20, stage_lanes=8,
                        backup_slots=16, backup_streams=streams)
    try:
        rng = np.random.default_rng(53)
        perm = rng.permutation(4 * n).astype(np.int64)
        d1, d2 = perm[:n], perm[n:2 * n + 1]
        h1 = np.arange(1, n + 1, dtype=np.int64)
        h2 = np.arange(0, n + 1, dtype=np.int64)  # page 0 shifts every chunk boundary by one page
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        hb = _host_bytes(host).clone()
        want = _expect_backup(hb, host.block_pages, _snapshot(dev), d2, h2, every)
        held = eng._dma_streams(eng.backup_stream).all[1 % streams]  # type: ignore[attr-defined]
        with torch.cuda.stream(held):
            torch.cuda._sleep(SLEEP_CYCLES)  # the first backup's chunk 1 (host page 2) is written late
        st = eng._stager(True)  # type: ignore[attr-defined]
        assert (st.n_slots, st.slot_bytes, len(st.lanes)) == (16, 256 << 10, 4)
        first = eng.backup(d1, h1)
        second = eng.backup(d2, h2)
        second.wait()
        first.wait()
        torch.cuda.synchronize()
        assert torch.equal(_host_bytes(host), want)
    finally:
        eng.close()


@pytest.mark.parametrize("wrap", [False, True])
def test_resident_staged_transfers_back_to_back(wrap: bool) -> None:
    """Loads and backups queued back to back on the resident staged path, with slots reused within and
    across transfers (and, with ``wrap``, the flag numbering restarting on the way): every load gates
    compute layer by layer on the right data, every backup lands, nothing waits forever."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces
    n = 256
    dev, host = _pools(layout, 4 * n, 4 * n, "page_first", seed=30, pin=True)
    # 4 slots of 1 MiB: 8 pages of 128 KiB per backup chunk, 32 pages of 32 KiB per load chunk
    eng = create_engine("cuda", dev, host, io_backend="staged", staged_kernel="resident", staging_bytes=4 << 20,
                        ce_min_copy_bytes=32 << 10)
    try:
        rng = np.random.default_rng(31)
        for rnd in range(3):
            if wrap and rnd == 1:
                for st in eng._stagers.values():  # type: ignore[attr-defined]
                    st.chunk_seq = (1 << 31) - 5  # the next transfer restarts the numbering
            d = rng.permutation(4 * n)[:n].astype(np.int64)
            h = rng.permutation(4 * n)[:n].astype(np.int64)
            _load_checked_layer_by_layer(eng, dev, host, d, h)
            d2, h2 = rng.permutation(4 * n)[:n].astype(np.int64), rng.permutation(4 * n)[:n].astype(np.int64)
            hb = _host_bytes(host).clone()
            dsnap = _snapshot(dev)
            backs = [eng.backup(d2[i::2], h2[i::2]) for i in range(2)]
            for b in backs:
                b.wait()
            every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
            assert torch.equal(_host_bytes(host), _expect_backup(hb, host.block_pages, dsnap, d2, h2, every))
        if wrap:
            assert all(st.chunk_seq < 1 << 20 for st in eng._stagers.values())  # type: ignore[attr-defined]
    finally:
        eng.close()


@pytest.mark.parametrize("to_host", [False, True])
def test_resident_staged_failure_midway_releases_the_kernel(to_host: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resident staged transfer whose DMA submission fails partway raises, and the kernel already
    queued is released: the device does not hang, and the next transfers are correct."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces
    n = 256
    dev, host = _pools(layout, 2 * n, 2 * n, "page_first", seed=40, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staged_kernel="resident", staging_bytes=4 << 20,
                        ce_min_copy_bytes=32 << 10)
    try:
        rt = eng._rt  # type: ignore[attr-defined]
        real = rt.run
        calls = {"n": 0}

        def flaky(plan: Any, stream: int, *a: Any, **k: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected DMA failure")
            real(plan, stream, *a, **k)

        monkeypatch.setattr(rt, "run", flaky)  # the runtime is shared by every engine: undone below
        d, h = _indices(n, 2 * n, 2 * n, seed=41)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                eng.backup(d, h) if to_host else eng.load(h, d)
        finally:
            monkeypatch.undo()
        eng.synchronize()  # would hang on a kernel still waiting for its flags
        _load_checked_layer_by_layer(eng, dev, host, d, h)
        hb = _host_bytes(host).clone()
        dsnap = _snapshot(dev)
        d2, h2 = _indices(n, 2 * n, 2 * n, seed=42)
        eng.backup(d2, h2).wait()
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        assert torch.equal(_host_bytes(host), _expect_backup(hb, host.block_pages, dsnap, d2, h2, every))
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
        _rand_bytes(vals, gen)
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
                                          io_backend=_backend_kw(io_backend)["io_backend"],
                                          transfer_options={"stagger_ways": 2, "staging_bytes": 1 << 20,
                                                            "staged_kernel": _backend_kw(io_backend).get(
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


@pytest.mark.parametrize("host_layout", ["page_first", "block_first"])
def test_layer_wise_staged_load_submits_its_later_units_from_the_waits(host_layout: str) -> None:
    """A layer-wise staged load submits in ``load`` only the units up to layer ``submit_ahead``; each
    ``wait_layer(i)`` submits those up to ``i + submit_ahead`` and the compute queued after it sees layer
    ``i``; a backup of the same device pages queued while units are still unsubmitted submits them
    first and reads what the load wrote; a whole load submits everything at once."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces
    n = 96
    dev, host = _pools(layout, 2 * n, 3 * n, host_layout, seed=70, pin=True, block_pages=16)
    # page-first: groups of one layer (4 parts each); block-first: one unit per layer
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=8 << 20, submit_ahead=2,
                        ce_min_copy_bytes=8 << 10)
    try:
        rng = np.random.default_rng(71)
        d = rng.permutation(2 * n)[:n].astype(np.int64)
        h = np.arange(n, 2 * n, dtype=np.int64)  # consecutive host pages: block-first stages them lc-major
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = _expect_load(_snapshot(dev), host, d, h, every)
        torch.cuda._sleep(SLEEP_CYCLES)  # compute is busy: nothing below has run when it is checked
        handle = eng.load(h, d)
        total = handle.unsubmitted_steps  # type: ignore[attr-defined]
        assert total > 0, "the load deferred nothing"
        dd = torch.from_numpy(d).cuda()
        snaps = []
        left = []
        for layer in range(layout.num_layers):
            handle.wait_layer(layer)
            left.append(handle.unsubmitted_steps)  # type: ignore[attr-defined]
            snaps.append([t.index_select(0, dd).view(torch.uint8) for t in dev.kv[layer]])
        assert left == sorted(left, reverse=True) and left[0] > 0 and left[-1] == 0, left
        torch.cuda.synchronize()
        for layer in range(layout.num_layers):
            for c in range(2):
                assert torch.equal(snaps[layer][c].cpu(), want[layer][c][torch.from_numpy(d)]), (layer, c)

        # a backup of the pages a partly submitted load writes: the load is submitted whole first
        h2 = np.arange(0, n, dtype=np.int64)
        want2 = _expect_load(_snapshot(dev), host, d, h2, every)
        torch.cuda._sleep(SLEEP_CYCLES)
        handle = eng.load(h2, d)
        assert handle.unsubmitted_steps > 0  # type: ignore[attr-defined]
        hb = np.arange(2 * n, 3 * n, dtype=np.int64)
        back = eng.backup(d, hb)
        assert handle.unsubmitted_steps == 0  # type: ignore[attr-defined]
        back.wait()
        assert handle.done()
        for layer in range(layout.num_layers):
            for c in range(2):
                stored = host.read_pieces(layer, c, torch.from_numpy(hb)).view(torch.uint8)
                assert torch.equal(stored, want2[layer][c][torch.from_numpy(d)]), (layer, c)

        # synchronize() submits what is deferred; done() does too; a whole load defers nothing
        torch.cuda._sleep(SLEEP_CYCLES)
        a = eng.load(h, d)
        b = eng.load(h2, d, layer_wise=False)
        assert a.unsubmitted_steps == 0 and b.unsubmitted_steps == 0  # type: ignore[attr-defined]
        torch.cuda._sleep(SLEEP_CYCLES)
        c = eng.load(h, d)
        assert c.unsubmitted_steps > 0 and not c.done()  # type: ignore[attr-defined]
        assert c.unsubmitted_steps == 0  # type: ignore[attr-defined]
        eng.load(h2, d)
        eng.synchronize()
        got = _snapshot(dev)
        for layer in range(layout.num_layers):
            for k in range(2):
                assert torch.equal(got[layer][k], want2[layer][k]), (layer, k)
    finally:
        eng.close()


def test_deferred_units_submitted_from_a_fresh_thread() -> None:
    """The first staged load of an engine, its later units submitted by ``wait_layer`` calls from a
    thread that has not touched CUDA, runs (a deadline guards against a hang) and lands right."""
    import threading

    layout = KVLayout(8, 2, 64, "bfloat16", 16)
    n = 64
    dev, host = _pools(layout, n, n, "page_first", seed=72, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=8 << 20, submit_ahead=0,
                        ce_min_copy_bytes=8 << 10)
    try:
        d, h = _indices(n, n, n, seed=73)
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = _expect_load(_snapshot(dev), host, d, h, every)
        handle = eng.load(h, d)
        assert handle.unsubmitted_steps > 0  # type: ignore[attr-defined]
        finished = threading.Event()

        def consume() -> None:
            for layer in range(layout.num_layers):
                handle.wait_layer(layer)
            torch.cuda.current_stream().synchronize()
            finished.set()

        t = threading.Thread(target=consume, daemon=True)
        t.start()
        assert finished.wait(30), "the deferred units never ran"
        handle.wait()
        got = _snapshot(dev)
        for layer in range(layout.num_layers):
            for c in range(2):
                assert torch.equal(got[layer][c], want[layer][c]), (layer, c)
    finally:
        eng.close()


_FRESH_PROCESS = r"""
import sys, time
import numpy as np, torch
from hicache.layout import KVLayout
from hicache.pool import DevicePool, HostPool
from hicache.transfer import create_engine
from hicache.transfer.copy_engine import CopyPlan, CudaRuntime

def landed(ev, what):
    t = time.monotonic()
    while not ev.query():
        if time.monotonic() - t > 20:
            print(what, "never completed", flush=True)
            sys.exit(1)
        time.sleep(0.001)

# the first copies of the process: 600 scattered 16 KiB pieces, in as few runtime calls as the engine makes
host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
dev = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
rng = np.random.default_rng(0)
src = np.sort(host.data_ptr() + rng.permutation((1 << 30) >> 14)[:600].astype(np.uint64) * np.uint64(16384))
dst = dev.data_ptr() + np.arange(600, dtype=np.uint64) * np.uint64(16384)
stream = torch.cuda.Stream()
plan = CopyPlan(dst.astype(np.uint64), src.astype(np.uint64), np.full(600, 16384, dtype=np.uint64))
CudaRuntime.get().run(plan, stream.cuda_stream)
ev = torch.cuda.Event(); ev.record(stream)
landed(ev, "a batch of 600 copies of 16 KiB")
del host, dev

# a 600 MB layer-wise staged load of 4 KiB pieces (32 layers, page-first L2), whose chunks are such batches
layout = KVLayout(32, 2, 64, "bfloat16", 16)
n = 2400
dp, hp = DevicePool(layout, n, "cuda"), HostPool(layout, n, "page_first")
eng = create_engine("cuda", dp, hp, io_backend="staged")
d = rng.permutation(n).astype(np.int64)
h = rng.permutation(n).astype(np.int64)
handle = eng.load(h, d)
handle.submit()
landed(handle.events[-1], "a 600 MB staged load")
eng.close()
print("ok", flush=True)
"""


def test_the_first_large_batches_of_a_fresh_process_complete() -> None:
    """In a fresh process, the first batch of many small copies, and a 600 MB staged load made of such
    batches, complete (one runtime batch of 512+ copies of 16 KiB could hang its stream for good)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr[-2000:]
