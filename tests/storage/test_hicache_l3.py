"""L3 through the cache: evicted pages come back from every backend byte for byte; damage is counted in
the cache's metrics; a store that dies and returns never breaks a request."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from hicache.cache import HiCache
from hicache.storage.redis_backend import RedisBackend
from hicache.storage.redis_local import LocalRedis
from kvhelpers import commit_fresh, kv_equal, read_kv, serve, small_config, write_kv
from storage.conftest import BACKENDS, needs_redis

FAST_FAIL = {"timeout_s": 0.5, "connect_timeout_s": 0.2, "retry_attempts": 2, "retry_base_s": 0.005,
             "breaker_base_s": 0.05, "breaker_max_s": 0.2}


def cache_for(url: str, options: dict[str, Any], **storage: Any) -> HiCache:
    cfg = small_config(cache={"write_policy": "write_through"},
                       storage={"url": url, "options": options, **storage})
    return HiCache(cfg)


def metric(cache: HiCache, name: str, **labels: str) -> float:
    return cache.metrics.registry.get_sample_value(name, labels or None) or 0.0


@pytest.mark.parametrize("backend_url", [p for p in BACKENDS if p.id != "memory"], indirect=True)
def test_evicted_pages_come_back_from_l3_byte_identical(backend_url) -> None:
    url, opts = backend_url
    cache = cache_for(url, opts)
    try:
        tokens = list(range(1, 33))  # 8 pages
        kv = commit_fresh(cache, tokens, seed=21)
        rep = cache.flush(10)
        assert rep is not None and rep.complete and rep.written_pages == 8
        cache.evict(l1_pages=8, l2_pages=8)
        req = cache.match(tokens)
        assert (req.l1_pages, req.l2_pages, req.l3_pages) == (0, 0, 8)
        assert cache.prefetch(req) == 8
        load = cache.load_back(req)
        load.wait()
        assert (load.l2_pages, load.l3_pages) == (8, 8)
        assert kv_equal(read_kv(cache, load.device_indices), kv)
        cache.check_integrity([req])
        cache.release(req)
        cache.check_integrity()
        assert metric(cache, "hicache_hit_tokens_total", tier="l3") == 32
        assert metric(cache, "hicache_prefetch_tokens_total") == 32
    finally:
        cache.close()


@pytest.mark.redis
@needs_redis
def test_damaged_page_in_redis_is_a_miss_counted_in_metrics(redis_single, prefix) -> None:
    cache = cache_for(redis_single.url, {"prefix": prefix})
    try:
        tokens = list(range(500, 532))
        kv = commit_fresh(cache, tokens, seed=22)
        cache.flush(10)
        cache.evict(l1_pages=8, l2_pages=8)
        store = cache.storage
        assert isinstance(store, RedisBackend)
        c = redis_single.client()
        req0 = cache.match(tokens)
        rk = store.redis_key(req0.keys[5])
        cache.release(req0)
        v = c.getrange(rk, 200, 200)
        c.setrange(rk, 200, bytes([v[0] ^ 0x01]))  # one bit, inside the payload
        c.close()
        req = cache.match(tokens)
        assert req.l3_pages == 8  # exists cannot know; the read verifies
        cache.prefetch(req)
        load = cache.load_back(req)
        load.wait()
        assert load.l3_pages == 5  # pages 0-4 only: the damaged page 5 and everything after it are misses
        assert kv_equal(read_kv(cache, load.device_indices), [[t[:5] for t in layer] for layer in kv])
        cache.release(req)
        cache.check_integrity()
        cache.stats()  # folds backend counters into metrics
        assert metric(cache, "hicache_storage_corrupt_pages_total") == 1
    finally:
        cache.close()


@pytest.mark.redis
@needs_redis
def test_redis_dying_mid_run_never_breaks_a_request_and_l3_returns() -> None:
    r = LocalRedis().start()
    cache = cache_for(r.url, FAST_FAIL, prefetch_policy="timeout", prefetch_timeout_base_s=0.5)
    try:
        docs = [list(range(1000 * d, 1000 * d + 32)) for d in range(7)]
        for i, d in enumerate(docs[:3]):
            commit_fresh(cache, d, seed=30 + i)
        cache.flush(10)
        r.kill()  # the store dies
        for i, d in enumerate(docs[:6]):  # serving goes on: L1/L2 hits for the first docs, misses elsewhere
            req, load = serve(cache, [*d, 7, 7, 7, 7], seed=40 + i)
            if i < 3:
                assert req.l1_pages + req.l2_pages == 8
            cache.release(req)
        cache.flush(5)
        cache.evict(l1_pages=64, l2_pages=64)
        req = cache.match(docs[0])
        assert req.l3_pages == 0  # L3 gone: a miss, not an error
        cache.prefetch(req)
        cache.load_back(req).wait()
        cache.release(req)
        cache.check_integrity()
        cache.stats()
        assert metric(cache, "hicache_storage_errors_total") >= 1

        r.start()  # back (empty: no persistence); docs[6] is new (what the outage served waits on L2
        # for its retry, tests/storage/test_writeback_retry.py)
        time.sleep(0.3)  # past the breaker's cooldown
        kv = commit_fresh(cache, docs[6], seed=50)
        deadline = time.monotonic() + 5
        while True:
            rep = cache.flush(5)
            req = cache.match(docs[6], l3=False)
            cache.release(req)
            if rep is not None and cache.storage is not None and cache.storage.batch_exists(req.keys) == 8:
                break
            assert time.monotonic() < deadline, "writes did not resume after the store came back"
            commit_fresh(cache, docs[6], seed=50)
            time.sleep(0.05)
        cache.evict(l1_pages=64, l2_pages=64)
        req = cache.match(docs[6])
        assert req.l3_pages == 8
        cache.prefetch(req)
        load = cache.load_back(req)
        load.wait()
        assert load.l3_pages == 8 and kv_equal(read_kv(cache, load.device_indices), kv)
        cache.release(req)
        cache.check_integrity()
    finally:
        cache.close()
        r.stop()


def test_prefetch_bytes_in_flight_are_bounded_and_release_cancels(tmp_path) -> None:
    from hicache.layout import KVLayout
    url = f"file://{tmp_path}"
    lay = small_config().layout.to_layout()
    assert isinstance(lay, KVLayout)
    cache = cache_for(url, {}, prefetch_max_inflight_bytes=8 * lay.bytes_per_page)
    try:
        a, b = list(range(1, 33)), list(range(101, 133))
        commit_fresh(cache, a, seed=60)
        commit_fresh(cache, b, seed=61)
        cache.flush(10)
        cache.evict(l1_pages=64, l2_pages=64)
        ra, rb = cache.match(a), cache.match(b)
        assert ra.l3_pages == rb.l3_pages == 8
        assert cache.prefetch(ra) == 8
        assert cache.prefetch(rb) == 0  # would exceed the bound: refused and counted
        assert metric(cache, "hicache_prefetch_aborted_total") == 1
        used = cache.host_pool.allocator.used_pages
        cache.check_integrity([ra, rb])
        cache.release(ra)  # the request goes away mid-prefetch: its host pages come back
        assert cache.host_pool.allocator.used_pages == used - 8
        assert cache.prefetch(rb) == 8  # room again
        load = cache.load_back(rb)
        load.wait()
        assert load.l3_pages == 8
        cache.release(rb)
        cache.check_integrity()
        # no L2 page leaked: the cancelled prefetch of a returned all of its pages, and the only pages
        # still allocated on L2 are b's 8, held by the tree
        assert cache.tree.host_pages == 8
        assert cache.host_pool.allocator.used_pages == cache.tree.host_pages == 8
        assert np.array_equal(np.sort(cache.tree.all_host_pages()), cache.host_pool.allocator.allocated())
        again = cache.match(b)
        assert (again.l1_pages, again.l3_pages) == (8, 0)  # b is cached again (on L1, backed by L2); a is not
        cache.release(again)
        gone = cache.match(a)
        assert (gone.l1_pages, gone.l2_pages, gone.l3_pages) == (0, 0, 8)
        cache.release(gone)
        cache.check_integrity()
    finally:
        cache.close()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies_bound_the_wait_and_keep_pools_whole(policy) -> None:
    from storage.test_prefetch_writeback import SlowStore

    cfg = small_config(cache={"write_policy": "write_through"},
                       storage={"prefetch_policy": policy, "io_batch_pages": 2, "prefetch_timeout_base_s": 0.1,
                                "prefetch_timeout_per_1k_tokens_s": 0.0, "prefetch_timeout_max_s": 0.1})
    from hicache.storage import StorageContext
    store = SlowStore(ctx=StorageContext(cfg.namespace().digest, cfg.layout.to_layout()))
    cache = HiCache(cfg, storage=store)
    try:
        tokens = list(range(1, 33))
        kv = commit_fresh(cache, tokens, seed=70)
        cache.flush(5)
        cache.evict(l1_pages=8, l2_pages=8)
        store.delay_s = 0.25  # 4 batches of 2 pages: 1 s for the whole run
        req = cache.match(tokens)
        assert cache.prefetch(req) == 8
        t0 = time.perf_counter()
        load = cache.load_back(req)
        waited = time.perf_counter() - t0
        load.wait()
        n = load.l3_pages
        if policy == "wait_complete":
            assert n == 8
        elif policy == "timeout":
            assert n < 8 and waited < 0.1 + 0.25 + 0.3  # the bound plus at most the batch in flight (+ slack)
        else:
            assert n <= 2 and waited < 0.25 + 0.3  # takes what landed, waits only for the batch in flight
        assert kv_equal(read_kv(cache, load.device_indices), [[t[:n] for t in layer] for layer in kv])
        cache.check_integrity([req])
        cache.release(req)
        cache.check_integrity()
    finally:
        cache.close()


def test_l3_counters_are_current_at_every_scrape() -> None:
    """The L3 traffic counters and the writeback gauge follow the backend at scrape time, even when the
    cache itself is idle (the writes finish in the background after the request's last call)."""
    cache = cache_for("memory://", {})
    try:
        tokens = list(range(1, 33))  # 8 pages
        commit_fresh(cache, tokens, seed=5)
        rep = cache.flush(10)  # waits for the writes; updates no metric itself
        assert rep is not None and rep.complete and rep.written_pages == 8
        page_bytes = cache.layout.bytes_per_page
        assert metric(cache, "hicache_storage_pages_written_total") == 8
        assert metric(cache, "hicache_storage_written_bytes_total") == 8 * page_bytes
        assert metric(cache, "hicache_writeback_queue_pages") == 0
        cache.evict(l1_pages=8, l2_pages=8)
        req = cache.match(tokens + [99] * 8)  # 8 pages on L3, then 2 it never had
        assert req.l3_pages == 8
        assert cache.prefetch(req) == 8
        cache.load_back(req).wait()  # takes the prefetched pages
        cache.release(req)
        assert metric(cache, "hicache_storage_pages_read_total") == 8
        assert metric(cache, "hicache_storage_read_bytes_total") == 8 * page_bytes
        assert metric(cache, "hicache_storage_errors_total") == 0
        # latency: one exists per match that reached L3, one set per written batch, one get per read batch
        assert metric(cache, "hicache_storage_op_seconds_count", op="exists") >= 1
        assert metric(cache, "hicache_storage_op_seconds_count", op="set") >= 1
        assert metric(cache, "hicache_storage_op_seconds_count", op="get") == 1  # 8 pages: one batch
        assert metric(cache, "hicache_prefetch_seconds_count") == 1
        assert 0 < metric(cache, "hicache_prefetch_seconds_sum") < 10
    finally:
        cache.close()


def test_prefetch_runs_once_and_follows_a_shorter_commit() -> None:
    """A second prefetch of a request reads nothing more from the store; a request that committed fewer
    tokens than it matched prefetches only what its tokens still cover, and leaks no L2 page."""
    cache = cache_for("memory://", {})
    try:
        tokens = list(range(1, 33))  # 8 pages
        commit_fresh(cache, tokens, seed=22)
        assert cache.flush(10) is not None
        cache.evict(l1_pages=8, l2_pages=8)
        req = cache.match(tokens)
        assert req.l3_pages == 8
        assert cache.prefetch(req) == 8
        cache.load_back(req).wait()
        reads = metric(cache, "hicache_storage_pages_read_total")
        assert cache.prefetch(req) == 0  # once per request
        cache.load_back(req).wait()
        cache.stats()  # brings the storage counters up to date
        assert metric(cache, "hicache_storage_pages_read_total") == reads
        cache.release(req)

        cache.evict(l1_pages=8, l2_pages=8)
        req = cache.match(tokens)
        assert req.l3_pages == 8
        own = cache.alloc(req, 2)
        cache.commit(req, tokens[:8], own)  # computed the first 2 pages itself
        assert cache.prefetch(req) == 0  # its tokens are all on L1 now: nothing left to fetch
        cache.load_back(req).wait()
        cache.release(req)
        cache.check_integrity()
        cache.flush(10)  # the commit's write_through backups and their L3 writes
        cache.clear()
        assert cache.host_pool.allocator.used_pages == 0 and cache.device_pool.allocator.used_pages == 0
    finally:
        cache.close()


@pytest.mark.redis
@needs_redis
def test_close_keeps_to_its_grace_and_reports_what_the_store_holds(redis_single, prefix) -> None:
    """A store slower than the shutdown grace: close abandons the queue after the grace (no second
    flush), and its report counts exactly the pages that reached the store."""
    cache = cache_for(redis_single.url, {"prefix": prefix, "timeout_s": 10}, io_batch_pages=2)
    cache.config.serve.shutdown_grace_s = 0.2
    client = redis_single.client()
    client.execute_command("CLIENT", "PAUSE", "1500", "WRITE")  # writes wait 1.5 s from now
    t0 = time.monotonic()
    try:
        for i in range(3):  # 12 pages: six batches of two
            commit_fresh(cache, list(range(100 * i + 1, 100 * i + 17)), seed=i)
    finally:
        rep = cache.close()
    took = time.monotonic() - t0
    assert rep is not None and not rep.complete
    stored = len(client.keys(f"{prefix}*"))
    assert rep.written_pages == stored < 12 and rep.written_pages + rep.pending_pages + rep.failed_pages == 12
    assert took < 5.0, took  # the grace, then the one batch in flight (held by the pause)


@pytest.mark.parametrize("then", ["same", "other"])
def test_a_prefetch_outlived_by_a_shorter_commit_lands_only_on_its_own_tokens(then: str) -> None:
    """A request starts an L3 prefetch, then commits fewer tokens than it matched (and maybe other tokens
    after them) before its load_back finishes the fetch. Fetched pages whose keys are no longer the
    request's are freed, never inserted under its new tokens; the pools stay whole."""
    from hicache.storage import StorageContext
    from hicache.storage.memory import MemoryBackend

    cfg = small_config(cache={"write_policy": "write_back"},  # commits stay on L1 only
                       storage={"prefetch_policy": "wait_complete", "prefetch_threshold_tokens": 0})
    store = MemoryBackend("memory://", StorageContext(cfg.namespace().digest, cfg.layout.to_layout()))
    cache = HiCache(cfg, storage=store)
    try:
        prompt = list(range(1, 33))  # 8 pages
        kv = commit_fresh(cache, prompt, seed=71)
        cache.evict(l1_pages=8)  # write_back: to L2, then L3 by writeback
        cache.flush(5)
        cache.evict(l2_pages=8)
        req = cache.match(prompt)
        assert req.l3_pages == 8 and cache.prefetch(req) == 8
        cache.commit(req, prompt[:3], np.empty(0, dtype=np.int64))  # no full page: the request is empty now
        other = [t + 1000 for t in prompt] if then == "other" else prompt
        pages = cache.alloc(req, 8)
        other_kv = write_kv(cache, pages, 72)
        cache.commit(req, other, pages)
        load = cache.load_back(req)
        if load.handle is not None:
            load.wait()
        assert len(load.device_indices) == 8
        cache.release(req)
        cache.evict(l1_pages=8)  # what is cached of `other` now comes from L2 (or not at all)
        again = cache.match(other)
        load = cache.load_back(again)
        if load.handle is not None:
            load.wait()
        n = len(load.device_indices)
        want = kv if then == "same" else other_kv
        assert kv_equal(read_kv(cache, load.device_indices), [[t[:n] for t in row] for row in want])
        cache.release(again)
        cache.check_integrity()
        cache.clear()
        assert cache.host_pool.allocator.used_pages == 0 and cache.device_pool.allocator.used_pages == 0
        assert cache._prefetch_inflight_bytes == 0
    finally:
        cache.close()
