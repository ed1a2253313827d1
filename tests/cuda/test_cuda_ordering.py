"""CUDA transfer engine on a GPU: streams and events. A layer is visible after ``wait_layer``; transfers
wait for the compute that writes or reads their pages and for each other, and land in order.

Skipped without a CUDA GPU or CuPy (collection imports neither CuPy nor a CUDA build of torch).
"""

import threading

import numpy as np
import pytest
import torch

from cudahelpers import (
    BIG,
    SLEEP_CYCLES,
    SMALL,
    backend_kw,
    expect_backup,
    expect_load,
    host_bytes,
    indices,
    load_checked_layer_by_layer,
    pools,
    rand_bytes,
    small_engine,
    snapshot,
    two_loads_behind,
)
from hicache.layout import KVLayout
from hicache.transfer import create_engine

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")


@pytest.mark.parametrize(("io_backend", "layer_signal", "expect_signal"),
                         [("kernel", "auto", "flags"), ("kernel", "events", "events"), ("copy_engine", "auto", None),
                          ("staged", "auto", None), ("staged_resident", "auto", None)])
def test_layer_visible_after_wait_layer(io_backend: str, layer_signal: str, expect_signal: str | None) -> None:
    """Compute queued after wait_layer(i) sees layer i; the host never blocks; the handle polls."""
    n = 64
    dev, host = pools(BIG, n, n, "page_first", seed=5)
    eng = create_engine("cuda", dev, host, layer_signal=layer_signal, **backend_kw(io_backend))
    try:
        if expect_signal is not None:
            assert eng.layer_signal == expect_signal  # type: ignore[attr-defined]
        d, h = indices(n, n, n, seed=6)
        for row in dev.kv:
            for t in row:
                t.view(torch.uint8).fill_(0xA5)  # poison
        torch.cuda.synchronize()
        before = snapshot(dev)
        handle = eng.load(h, d)
        assert not handle.done()  # 512 MiB cannot have landed yet; done() returned without blocking
        snaps = []
        for layer in range(BIG.num_layers):
            handle.wait_layer(layer)
            snaps.append([t.view(torch.uint8).clone() for t in dev.kv[layer]])  # queued on the compute stream
        assert not handle.done()  # wait_layer did not block the host
        torch.cuda.synchronize()
        expect = expect_load(before, host, d, h, {(x, c) for x in range(BIG.num_layers) for c in range(2)})
        for layer in range(BIG.num_layers):
            for c in range(2):
                assert torch.equal(snaps[layer][c].cpu(), expect[layer][c]), (layer, c)
    finally:
        eng.close()


def test_flag_loads_in_sequence_and_from_another_thread() -> None:
    """Back-to-back single-launch loads: each handle's layers (old ones too) gate compute correctly,
    also when wait_layer is called from a thread that has not touched CUDA yet."""

    layout = KVLayout(4, 8, 128, "bfloat16", 64)  # 128 KiB pieces
    n = 32
    dev, host = pools(layout, 3 * n, 3 * n, "layer_first", seed=20)
    eng = create_engine("cuda", dev, host, io_backend="kernel")
    try:
        assert eng.layer_signal == "flags"  # type: ignore[attr-defined]
        rng = np.random.default_rng(21)
        before = snapshot(dev)
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
            expect = expect_load(before, host, d, h, every)
            i = 0
            for layer in range(layout.num_layers):
                for c in range(2):
                    assert torch.equal(out[j][i], expect[layer][c][torch.from_numpy(d)]), (j, layer, c)
                    i += 1
    finally:
        eng.close()


@pytest.mark.parametrize("io_backend", ["kernel", "copy_engine", "staged", "staged_resident"])
def test_backup_waits_for_compute_writer(io_backend: str) -> None:
    """A backup submitted right after the compute stream writes the pages copies the new values."""
    layout = SMALL
    dev, host, eng = small_engine(io_backend, seed=7)
    try:
        d, h = indices(8, 16, 16, seed=8)
        gen = torch.Generator().manual_seed(9)
        new = []
        for row in dev.kv:
            for t in row:
                x = torch.empty((8, *t.shape[1:]), dtype=t.dtype)
                rand_bytes(x, gen)
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
    dev, host, eng = small_engine(io_backend, seed=30)
    try:
        d, h = indices(8, 16, 16, seed=31)
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
    dev, host = pools(BIG, 2 * n, n, "page_first", seed=10)
    eng = create_engine("cuda", dev, host, **backend_kw(io_backend))
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
    dev, host = pools(layout, 2 * n, 2 * n, "layer_first", seed=21)
    eng = create_engine("cuda", dev, host, io_backend="copy_engine", backup_streams=streams)
    try:
        assert len(eng._backup_lanes) == streams - 1
        d, h = indices(n, n, 2 * n, seed=22)
        every = {(layer, c) for layer in range(layout.num_layers) for c in range(2)}
        hb = host_bytes(host).clone()
        dsnap = snapshot(dev)
        torch.cuda._sleep(SLEEP_CYCLES)  # the backup queues behind compute; the load behind the backup
        back = eng.backup(d, h)
        load = eng.load(h, np.arange(n, 2 * n, dtype=np.int64))
        assert not back.done()
        load.wait()
        assert back.done()
        assert torch.equal(host_bytes(host), expect_backup(hb, host.block_pages, dsnap, d, h, every))
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
    dev, host = pools(layout, n_load + n_back, n_load + n_back, "page_first", seed=14, pin=True)
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


@pytest.mark.parametrize("lanes", [1, 3, 8])
def test_staged_loads_into_the_same_pages_land_in_order(lanes: int) -> None:
    """Two staged loads of different host pages into the same device pages, queued back to back, the
    first one's first scatter held up on its lane (as when a GEMM keeps the SMs) while the second's
    would run on another: the device pages end with the second load's data. Lanes run a transfer's
    scatters side by side, never one transfer's past the other's."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces: two groups of 8 layers, one chunk each
    n = 8
    dev, host = pools(layout, 4 * n, 4 * n, "page_first", seed=50, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=4 << 20, stage_lanes=lanes)
    try:
        d = np.random.default_rng(51).permutation(4 * n)[:n].astype(np.int64)
        h1, h2 = np.arange(n, dtype=np.int64), np.arange(2 * n, 3 * n, dtype=np.int64)
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = expect_load(snapshot(dev), host, d, h2, every)
        st = eng._stager(False)  # type: ignore[attr-defined]
        assert len(st.lanes) == min(lanes, st.n_slots)
        # slot 0's lane held: the first load's layers 0-7 scatter late
        two_loads_behind(st.lanes[0], eng, dev, (h1, d), (h2, d), want)
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
    dev, host = pools(layout, 2 * n + 1, 4 * n, "page_first", seed=54, pin=True)
    # 4 MiB of staging: load slots of 1 MiB (16 pages of a group), several chunks per group
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=4 << 20, stage_lanes=4,
                        load_streams=streams, stagger_ways=1)
    try:
        d = np.random.default_rng(55).permutation(2 * n + 1).astype(np.int64)
        d1, d2 = d[1:n + 1], d[:n + 1]
        h1 = np.arange(2 * n, 3 * n, dtype=np.int64)
        h2 = np.arange(0, n + 1, dtype=np.int64)  # page 0 shifts every chunk boundary by one page
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = expect_load(expect_load(snapshot(dev), host, d1, h1, every), host, d2, h2, every)
        held = eng._dma_streams(eng.load_stream, to_host=False).all[1 % streams]  # type: ignore[attr-defined]
        two_loads_behind(held, eng, dev, (h1, d1), (h2, d2), want)  # the first load's chunk 1 lands late
        h = np.random.default_rng(56).permutation(4 * n)[:n].astype(np.int64)
        load_checked_layer_by_layer(eng, dev, host, d1, h)
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
    dev, host = pools(layout, 4 * n, 4 * n, "page_first", seed=52, pin=True)
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
        hb = host_bytes(host).clone()
        want = expect_backup(hb, host.block_pages, snapshot(dev), d2, h2, every)
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
        assert torch.equal(host_bytes(host), want)
    finally:
        eng.close()
