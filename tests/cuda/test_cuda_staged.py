"""CUDA transfer engine on a GPU: the staged path. Staggered, whole and headed loads; scatter lanes;
loads queued behind busy SMs; the resident kernel; deferred submission; a fresh process's first batches.

Skipped without a CUDA GPU or CuPy (collection imports neither CuPy nor a CUDA build of torch).
"""

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from cudahelpers import (
    SLEEP_CYCLES,
    expect_backup,
    expect_load,
    host_bytes,
    indices,
    load_checked_layer_by_layer,
    pools,
    snapshot,
    two_loads_behind,
)
from hicache.layout import KVLayout
from hicache.transfer import create_engine

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")


@pytest.mark.parametrize("kernel", ["per_chunk", "resident"])
@pytest.mark.parametrize("ways", [1, 2, 4])
def test_staggered_staged_load_layer_by_layer(ways: int, kernel: str) -> None:
    """A load of 4 KiB pieces in two groups of 8 layers, staggered ``ways`` ways: each layer holds the
    host data once its wait returns, and layers become ready in ``2 * ways`` steps (per-chunk kernels:
    one event per step; resident: one flag per layer and one completion event)."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces: 8 layers make a 64 KiB run per page
    n = 512  # parts of at least 128 pages
    dev, host = pools(layout, n + 64, n + 32, "page_first", seed=21, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", stagger_ways=ways, staged_kernel=kernel)
    try:
        d, h = indices(n, n + 64, n + 32, seed=22)
        handle = load_checked_layer_by_layer(eng, dev, host, d, h)
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
    dev, host = pools(layout, 2 * n, 2 * n, "page_first", seed=64, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staged_kernel=kernel, load_head_layers=2)
    try:
        d, h = indices(n, 2 * n, 2 * n, seed=65)
        L = layout.num_layers
        before = snapshot(dev)
        torch.cuda._sleep(SLEEP_CYCLES)
        handle = eng.load(h, d, layer_wise=False)
        snaps = []
        for layer in range(L):
            handle.wait_layer(layer)
            snaps.append([t.view(torch.uint8).clone() for t in dev.kv[layer]])
        torch.cuda.synchronize()
        want = expect_load(before, host, d, h, {(x, c) for x in range(L) for c in range(2)})
        for layer in range(L):
            for c in range(2):
                assert torch.equal(snaps[layer][c].cpu(), want[layer][c]), (layer, c)
        assert len({id(e) for e in handle.events}) == 1  # type: ignore[attr-defined]
        if kernel == "per_chunk":
            d2, h2 = indices(n, 2 * n, 2 * n, seed=66)
            layered = load_checked_layer_by_layer(eng, dev, host, d2, h2)
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
    dev, host = pools(layout, 2 * n, 2 * n, "page_first", seed=60, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", load_head_layers=head)
    try:
        d, h = indices(n, 2 * n, 2 * n, seed=61)
        handle = load_checked_layer_by_layer(eng, dev, host, d, h)
        ev = handle.events  # type: ignore[attr-defined]
        k = min(head, layout.num_layers - 1)
        assert len({id(e) for e in ev[:k]}) == k and not {id(e) for e in ev[:k]} & {id(e) for e in ev[k:]}
        d2 = d[: n // 2]
        h1, h2 = h[: n // 2], h[n // 2:]
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = expect_load(snapshot(dev), host, d2, h2, every)
        head_stream, _ = eng._head_copier()  # type: ignore[attr-defined]
        two_loads_behind(head_stream, eng, dev, (h1, d2), (h2, d2), want)
    finally:
        eng.close()
    small = KVLayout(4, 2, 64, "bfloat16", 16)  # 4 layers of 4 KiB pieces: one group of whole pages
    dev, host = pools(small, 64, 64, "page_first", seed=62, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", load_head_layers=head)
    try:
        d, h = indices(64, 64, 64, seed=63)
        handle = load_checked_layer_by_layer(eng, dev, host, d, h)
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
    dev, host = pools(layout, 5 * n, 5 * n, "page_first", seed=40, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staged_kernel=kernel, staging_bytes=4 << 20)
    try:
        rng = np.random.default_rng(41)
        pairs = [(np.arange(k * n, (k + 1) * n, dtype=np.int64), rng.permutation(5 * n)[:n].astype(np.int64))
                 for k in range(4)]
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = snapshot(dev)
        for d, h in pairs:  # device pages are disjoint: each load's expectation, from the host as it is now
            want = expect_load(want, host, d, h, every)
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
    dev, host = pools(layout, 64, 192, "block_first", seed=60, block_pages=16)
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
        want = expect_load(snapshot(dev), host, d, loads[-1][0], every)
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
        got = snapshot(dev)
        for layer in range(layout.num_layers):
            for c in range(layout.kv_count):
                assert torch.equal(got[layer][c], want[layer][c]), (layer, c)
    finally:
        eng.close()


def test_staged_load_leaves_the_load_stream_free_while_its_scatters_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged load whose scatters are held on every lane (as when compute keeps the SMs): the next
    staged load's DMAs run meanwhile, since the load stream does not wait for the held scatters, and a
    copy-engine load into the same device pages, queued after both, still lands after the held ones."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces: two groups of 8 layers, one chunk each
    n = 8
    dev, host = pools(layout, 4 * n, 4 * n, "page_first", seed=57, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=8 << 20, stage_lanes=2)
    try:
        perm = np.random.default_rng(58).permutation(4 * n).astype(np.int64)
        d1, d2 = perm[:n], perm[n:2 * n]
        h1, h2, h3 = (np.arange(k * n, (k + 1) * n, dtype=np.int64) for k in range(3))
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = expect_load(expect_load(snapshot(dev), host, d2, h2, every), host, d1, h3, every)
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


@pytest.mark.parametrize("wrap", [False, True])
def test_resident_staged_transfers_back_to_back(wrap: bool) -> None:
    """Loads and backups queued back to back on the resident staged path, with slots reused within and
    across transfers (and, with ``wrap``, the flag numbering restarting on the way): every load gates
    compute layer by layer on the right data, every backup lands, nothing waits forever."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces
    n = 256
    dev, host = pools(layout, 4 * n, 4 * n, "page_first", seed=30, pin=True)
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
            load_checked_layer_by_layer(eng, dev, host, d, h)
            d2, h2 = rng.permutation(4 * n)[:n].astype(np.int64), rng.permutation(4 * n)[:n].astype(np.int64)
            hb = host_bytes(host).clone()
            dsnap = snapshot(dev)
            backs = [eng.backup(d2[i::2], h2[i::2]) for i in range(2)]
            for b in backs:
                b.wait()
            every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
            assert torch.equal(host_bytes(host), expect_backup(hb, host.block_pages, dsnap, d2, h2, every))
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
    dev, host = pools(layout, 2 * n, 2 * n, "page_first", seed=40, pin=True)
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
        d, h = indices(n, 2 * n, 2 * n, seed=41)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                eng.backup(d, h) if to_host else eng.load(h, d)
        finally:
            monkeypatch.undo()
        eng.synchronize()  # would hang on a kernel still waiting for its flags
        load_checked_layer_by_layer(eng, dev, host, d, h)
        hb = host_bytes(host).clone()
        dsnap = snapshot(dev)
        d2, h2 = indices(n, 2 * n, 2 * n, seed=42)
        eng.backup(d2, h2).wait()
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        assert torch.equal(host_bytes(host), expect_backup(hb, host.block_pages, dsnap, d2, h2, every))
    finally:
        eng.close()


@pytest.mark.parametrize("host_layout", ["page_first", "block_first"])
def test_layer_wise_staged_load_submits_its_later_units_from_the_waits(host_layout: str) -> None:
    """A layer-wise staged load submits in ``load`` only the units up to layer ``submit_ahead``; each
    ``wait_layer(i)`` submits those up to ``i + submit_ahead`` and the compute queued after it sees layer
    ``i``; a backup of the same device pages queued while units are still unsubmitted submits them
    first and reads what the load wrote; a whole load submits everything at once."""
    layout = KVLayout(16, 2, 64, "bfloat16", 16)  # 4 KiB pieces
    n = 96
    dev, host = pools(layout, 2 * n, 3 * n, host_layout, seed=70, pin=True, block_pages=16)
    # page-first: groups of one layer (4 parts each); block-first: one unit per layer
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=8 << 20, submit_ahead=2,
                        ce_min_copy_bytes=8 << 10)
    try:
        rng = np.random.default_rng(71)
        d = rng.permutation(2 * n)[:n].astype(np.int64)
        h = np.arange(n, 2 * n, dtype=np.int64)  # consecutive host pages: block-first stages them lc-major
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = expect_load(snapshot(dev), host, d, h, every)
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
        want2 = expect_load(snapshot(dev), host, d, h2, every)
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
        got = snapshot(dev)
        for layer in range(layout.num_layers):
            for k in range(2):
                assert torch.equal(got[layer][k], want2[layer][k]), (layer, k)
    finally:
        eng.close()


def test_a_deferred_unit_failing_lets_what_was_queued_land_before_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer-wise load whose later unit fails while being submitted (a launch refused): the handle's
    ``wait`` raises the failure, ``done`` reports the transfer over without raising, and by then nothing
    queued before the failure writes the destination pages any more (their next owner's data stays); the
    engine still loads correctly afterwards."""
    layout = KVLayout(8, 2, 64, "bfloat16", 16)
    n = 64
    dev, host = pools(layout, n, 2 * n, "page_first", seed=74, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=8 << 20, submit_ahead=0,
                        ce_min_copy_bytes=8 << 10)
    real = eng._launch_stage  # type: ignore[attr-defined]
    calls = {"n": 0, "fail_at": -1}

    def launch(lane: torch.cuda.Stream, *args: Any, **kw: Any) -> None:
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected launch failure")
        if calls["n"] == 1:
            with torch.cuda.stream(lane):
                torch.cuda._sleep(4 * SLEEP_CYCLES)  # the first scatter lands late (~200 ms)
        real(lane, *args, **kw)

    try:
        d, h = indices(n, n, n, seed=75)
        monkeypatch.setattr(eng, "_launch_stage", launch)
        handle = eng.load(h, d)
        assert handle.unsubmitted_steps > 0 and calls["n"] >= 1  # type: ignore[attr-defined]
        calls["fail_at"] = calls["n"] + 2  # a later unit: one of its chunks is queued, the next one fails
        with pytest.raises(RuntimeError, match="injected"):
            handle.wait()
        # the pages go to their next owner, who writes them at once on the compute stream
        dd = torch.from_numpy(d).cuda()
        for row in dev.kv:
            for t in row:
                t.view(torch.uint8).index_fill_(0, dd, 0x5A)
        torch.cuda.synchronize()
        for layer, row in enumerate(dev.kv):
            for c, t in enumerate(row):
                assert bool((t.view(torch.uint8).index_select(0, dd) == 0x5A).all()), (layer, c)
        assert handle.done()  # over, and never raises
        with pytest.raises(RuntimeError, match="injected"):
            handle.wait_layer(layout.num_layers - 1)

        monkeypatch.setattr(eng, "_launch_stage", real)
        h2 = np.arange(n, 2 * n, dtype=np.int64)
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = expect_load(snapshot(dev), host, d, h2, every)
        eng.load(h2, d).wait()
        got = snapshot(dev)
        for layer in range(layout.num_layers):
            for c in range(2):
                assert torch.equal(got[layer][c], want[layer][c]), (layer, c)
    finally:
        eng.close()


def test_deferred_units_submitted_from_a_fresh_thread() -> None:
    """The first staged load of an engine, its later units submitted by ``wait_layer`` calls from a
    thread that has not touched CUDA, runs (a deadline guards against a hang) and lands right."""

    layout = KVLayout(8, 2, 64, "bfloat16", 16)
    n = 64
    dev, host = pools(layout, n, n, "page_first", seed=72, pin=True)
    eng = create_engine("cuda", dev, host, io_backend="staged", staging_bytes=8 << 20, submit_ahead=0,
                        ce_min_copy_bytes=8 << 10)
    try:
        d, h = indices(n, n, n, seed=73)
        every = {(x, c) for x in range(layout.num_layers) for c in range(2)}
        want = expect_load(snapshot(dev), host, d, h, every)
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
        got = snapshot(dev)
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
