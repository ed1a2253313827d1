"""L3 writes that failed are tried again while their pages are on L2: an outage of the store ends with the
store holding every page written meanwhile, byte for byte; the retries back off, never block a submitter,
and are bounded (the oldest given up first, counted)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from hicache.cache import HiCache
from hicache.pool import HostPool
from hicache.storage.base import StorageContext
from hicache.storage.memory import MemoryBackend
from hicache.storage.redis_local import LocalRedis
from hicache.storage.writeback import Writeback
from kvhelpers import commit_fresh, kv_equal, read_kv, small_config
from storage.conftest import LAYOUT, NS, make_pool, needs_redis, page_keys

FAST_FAIL = {"timeout_s": 0.5, "connect_timeout_s": 0.2, "retry_attempts": 1, "breaker_base_s": 0.05,
             "breaker_max_s": 0.2}


class FlakyStore(MemoryBackend):
    """An in-process store that takes nothing while ``down`` is set (as a store that is unreachable: every
    write stores no page)."""

    def __init__(self, ctx: StorageContext | None = None) -> None:
        super().__init__("memory://", ctx or StorageContext(NS, LAYOUT))
        self.down = threading.Event()
        self.set_calls = 0
        self.take = 0  # while down: pages of each write it still stores (a write that fails part way)

    def batch_set(self, keys: Sequence[bytes], host_pool: HostPool, host_indices: Sequence[int]) -> int:
        self.set_calls += 1
        if self.down.is_set():
            n = min(self.take, len(keys))
            return super().batch_set(keys[:n], host_pool, host_indices[:n]) if n else 0
        return super().batch_set(keys, host_pool, host_indices)


def test_pages_written_while_the_store_is_down_reach_it_once_it_is_back() -> None:
    store, pool = FlakyStore(), make_pool(64, seed=3)
    wb = Writeback(store, pool, max_pages=100, batch_pages=4)
    keys = page_keys(24, "outage")
    done: list[int] = []
    store.down.set()
    for j in range(8):
        assert wb.submit(keys[3 * j : 3 * j + 3], np.arange(3 * j, 3 * j + 3), done.append)
    rep = wb.flush(5)
    assert (rep.written_pages, rep.failed_pages, rep.dropped_pages) == (0, 24, 0) and not rep.complete
    assert done == [] and wb.queued_pages == wb.retrying_pages == 24  # still the caller's, pinned on L2
    store.down.clear()
    rep = wb.flush(5)
    assert rep.complete and rep.written_pages == 24, rep
    assert sorted(done) == [3] * 8  # each submission ends once, with every page written
    assert store.batch_exists(keys) == 24
    got = make_pool(64, seed=None)
    assert store.batch_get(keys, got, list(range(24))) == 24
    assert all(got.page_bytes(i) == pool.page_bytes(i) for i in range(24))
    assert wb.retry_dropped == 0
    wb.close()


def test_a_write_that_fails_part_way_retries_only_the_pages_not_stored() -> None:
    store, pool = FlakyStore(), make_pool(64, seed=7)
    wb = Writeback(store, pool, max_pages=100, batch_pages=4)
    keys = page_keys(10, "partial")
    done: list[int] = []
    store.down.set()
    store.take = 1  # of each batch of 4, the first page lands
    assert wb.submit(keys[:6], np.arange(6), done.append)
    assert wb.submit(keys[6:], np.arange(6, 10), done.append)
    rep = wb.flush(5)
    assert rep.written_pages >= 3 and rep.written_pages + rep.failed_pages == 10
    store.down.clear()
    rep = wb.flush(5)
    assert rep.complete and rep.written_pages == 10 and sorted(done) == [4, 6]
    assert store.batch_exists(keys) == 10
    got = make_pool(64, seed=None)
    assert store.batch_get(keys, got, list(range(10))) == 10
    assert all(got.page_bytes(i) == pool.page_bytes(i) for i in range(10))
    wb.close()


def test_retries_resume_by_themselves_and_back_off_meanwhile() -> None:
    """No flush needed: the writer tries again on its own, each page after a backoff that doubles, so a
    store down for a second sees a handful of writes, not a loop of them."""
    store, pool = FlakyStore(), make_pool(64, seed=4)
    wb = Writeback(store, pool, max_pages=100, batch_pages=8)
    keys = page_keys(6, "backoff")
    done: list[int] = []
    store.down.set()
    assert wb.submit(keys, np.arange(6), done.append)
    time.sleep(1.0)
    calls_down = store.set_calls
    assert 2 <= calls_down <= 10, calls_down  # 0.05, 0.1, 0.2, 0.4 s ... apart
    store.down.clear()
    deadline = time.monotonic() + 5
    while not done:
        assert time.monotonic() < deadline, "the retry did not come"
        time.sleep(0.01)
    assert done == [6] and store.batch_exists(keys) == 6 and wb.report().complete
    wb.close()


def test_the_retry_queue_is_bounded_and_gives_up_the_oldest_first() -> None:
    store, pool = FlakyStore(), make_pool(64, seed=5)
    dropped: list[int] = []
    wb = Writeback(store, pool, max_pages=100, batch_pages=2, retry_pages=4, on_retry_dropped=dropped.append)
    keys = page_keys(6, "bound")
    done: dict[str, int] = {}
    store.down.set()
    for j, name in enumerate("abc"):
        assert wb.submit(keys[2 * j : 2 * j + 2], np.arange(2 * j, 2 * j + 2),
                         lambda n, name=name: done.__setitem__(name, n))
        rep = wb.flush(5)  # one submission at a time: "a" is the oldest
    assert dropped == [2] and wb.retry_dropped == 2 and wb.retrying_pages == 4
    assert (rep.failed_pages, rep.pending_pages) == (6, 0)  # given up (2) + waiting (4)
    store.down.clear()
    rep = wb.flush(5)
    assert done == {"a": 0, "b": 2, "c": 2}  # "a" was handed back unwritten, the others written
    assert (rep.written_pages, rep.failed_pages) == (4, 2)
    assert store.batch_exists(keys[2:]) == 4 and store.batch_exists(keys[:2]) == 0
    wb.close()


def test_a_store_that_is_down_never_blocks_a_submitter() -> None:
    """Pages waiting for a retry are not in the queue: ``block`` waits only for queued pages."""
    store, pool = FlakyStore(), make_pool(64, seed=6)
    wb = Writeback(store, pool, max_pages=4, batch_pages=4, when_full="block", block_timeout_s=5, retry_pages=16)
    keys = page_keys(16, "noblock")
    store.down.set()
    t0 = time.monotonic()
    for j in range(4):
        assert wb.submit(keys[4 * j : 4 * j + 4], np.arange(4 * j, 4 * j + 4), lambda n: None)
        wb.flush(5)
    assert time.monotonic() - t0 < 3 and wb.retrying_pages == 16
    store.down.clear()
    assert wb.flush(5).complete
    wb.close()


def _config(url: str, options: dict[str, Any]) -> Any:
    # L2 holds every page of the outage (and twice that, so the retry queue, at most half of it, does too)
    return small_config(cache={"write_policy": "write_through", "l1_tokens": 4 * 128, "l2_tokens": 4 * 256},
                        storage={"url": url, "options": options})


def test_pages_given_up_are_counted_and_leave_l2_evictable() -> None:
    cfg = _config("memory://", {})
    store = FlakyStore(StorageContext(cfg.namespace().digest, cfg.layout.to_layout()))
    cache = HiCache(cfg, storage=store)
    assert cache.writeback is not None
    cache.writeback._retry_max = 8  # a small retry queue: 3 prompts of 4 pages overflow it
    try:
        store.down.set()
        for i in range(3):
            commit_fresh(cache, list(range(100 * i + 1, 100 * i + 17)), seed=i)
            cache.flush(5)
        assert cache.metrics.registry.get_sample_value("hicache_writeback_retry_dropped_pages_total") == 4
        assert cache.stats()["writeback_queue_pages"] == 8
        cache.check_integrity()
        assert cache.evict(l1_pages=64, l2_pages=64)[1] == 4  # the given-up prompt is no longer pinned
    finally:
        cache.close()


@pytest.mark.redis
@needs_redis
def test_redis_killed_and_restarted_ends_with_every_page_in_redis() -> None:
    """The outage of the issue: Redis killed, 40 prompts committed while it is gone (every L3 write fails),
    Redis back empty on the same port: the writeback tries them again and Redis ends with all of them,
    byte for byte (read back through the cache from L3 alone), nothing given up."""
    r = LocalRedis().start()
    cache = HiCache(_config(r.url, FAST_FAIL))
    try:
        prompts = [list(range(1000 * p + 1, 1000 * p + 9)) for p in range(40)]  # 2 pages each
        r.kill()
        kvs = [commit_fresh(cache, t, seed=p) for p, t in enumerate(prompts)]
        rep = cache.flush(5)
        assert rep is not None and rep.written_pages == 0 and rep.failed_pages == 80
        r.start()  # empty: no persistence
        deadline = time.monotonic() + 15
        while not (rep := cache.flush(5)).complete:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, f"L3 not complete after the store came back: {rep}"
            time.sleep(0.05)
        assert rep is not None and rep.written_pages == 80
        assert len(r.client().keys("*")) == 80
        assert cache.metrics.registry.get_sample_value("hicache_writeback_retry_dropped_pages_total") == 0
        cache.evict(l1_pages=128, l2_pages=256)
        for tokens, kv in zip(prompts, kvs, strict=True):
            req = cache.match(tokens)
            assert (req.l1_pages, req.l2_pages, req.l3_pages) == (0, 0, 2)
            assert cache.prefetch(req) == 2
            load = cache.load_back(req)
            load.wait()
            assert kv_equal(read_kv(cache, load.device_indices), kv)
            cache.release(req)
        cache.check_integrity()
    finally:
        cache.close()
        r.stop()
