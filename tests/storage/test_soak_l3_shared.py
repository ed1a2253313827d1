"""Soak of one L3 store shared by several nodes while it is being damaged: a hit never hands a wrong page.

Two worker processes (spawned; :mod:`storage.l3soak`), each with a cache of its own -- L1 and L2 of a few
tens of pages, one page-first and one layer-first L2, one writing compressed frames (``zstd``) and one
plain frames, ``write_through`` -- point at the same store: a
directory (file store), a redis-server, a Redis Cluster. Their engine threads replay shared documents
followed by shared or private questions under two tenants, so the same page keys are written by both
processes at once and read back by the other one, while their maintenance threads keep clearing L1/L2 so
requests go to L3. Meanwhile the test process damages the store: bits flipped in payloads and in the
header's key, frames truncated, replaced with the frame of another page or with a valid frame of another
model's namespace or (Redis) with a value of another type, pages deleted (and, for the file store, whole
directories); the store is wiped once, and the redis-server is killed and started again.

Checked:

* every page a hit hands over (L1, L2, and L3 -- often written by the other process) holds exactly the
  model's K/V for its tenant and token prefix; no worker thread fails or hangs;
* after the faults stop and the store was wiped, pages computed again land in the store and the other
  process reads them back as L3 hits;
* damage done now to known pages (one kind per document) is a miss at exactly that page, counted in
  ``hicache_storage_corrupt_pages_total`` of the reader (a deleted page is a plain miss, not counted), and
  the reader's recomputed pages repair the store: the first process hits the whole documents again.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from hicache.storage import StorageBackend
from hicache.storage.redis_local import LocalRedis
from storage.conftest import make_pool, needs_redis, page_keys, pages_equal
from storage.l3soak import CORRUPTING, PROMPTS, TENANTS, Faults, FileFaults, RedisFaults, WorkerProc, inject

SOAK_S = 4.0
SEED = 1234
HOST_LAYOUTS = ("page_first", "layer_first")  # worker i's L2 layout: frames are shared across both
COMPRESSION = ("zstd", "none")  # worker i's storage.compression: each reads the other's frames
FAST_FAIL = {"timeout_s": 2.0, "connect_timeout_s": 0.5, "retry_attempts": 2, "retry_base_s": 0.005,
             "breaker_base_s": 0.05, "breaker_max_s": 0.2}

# Known damage after the soak: (kind, document, tenant, page, page whose frame is copied (other_page /
# other_tenant): (document, tenant, page)); each (document, tenant) at most once.
PLAN: list[tuple[str, int, str, int, tuple[int, str, int] | None]] = [
    ("flip_payload", 0, "", 1, None),
    ("flip_key", 1, "acme", 2, None),
    ("truncate", 2, "", 1, None),
    ("other_page", 3, "acme", 1, (0, "acme", 0)),
    ("other_tenant", 4, "", 2, (4, "acme", 2)),  # the same tokens' page under the other tenant
    ("other_namespace", 5, "acme", 1, None),  # this very key and payload, framed for another model
    ("delete", 0, "acme", 2, None),
    ("wrong_type", 1, "", 2, None),  # Redis only: a list where the page's string was
]


@dataclass
class Store:
    url: str
    options: dict[str, Any]
    faults: Faults
    worker_options: tuple[dict[str, Any], ...] = ({}, {})  # more options per worker
    once: dict[float, Callable[[], None]] = field(default_factory=dict)  # fraction of the soak -> extra fault


@contextmanager
def open_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Store]:
    if kind == "file":
        root = tmp_path / "l3"
        root.mkdir()
        faults = FileFaults(root)
        yield Store(f"file://{root}", {}, faults, once={0.6: faults.wipe})
    elif kind == "redis":  # a server of its own: it is killed and started again
        with LocalRedis() as server:
            client = server.client()
            rfaults = RedisFaults(client, "hicache:")

            def restart() -> None:
                server.kill()
                time.sleep(0.3)
                server.start()
                rfaults.log.note("restart")

            def flushall() -> None:
                try:
                    client.flushall()
                    rfaults.log.note("flushall")
                except redis.RedisError:
                    pass

            try:
                yield Store(server.url, dict(FAST_FAIL), rfaults, once={0.3: restart, 0.6: flushall})
            finally:
                client.close()
    elif kind == "cluster":  # the session's cluster, under a prefix of this test's own
        cluster = request.getfixturevalue("redis_cluster")
        prefix = f"soak{uuid.uuid4().hex[:8]}:"
        rc = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port, socket_timeout=5)
        try:
            cfaults = RedisFaults(rc, prefix)
            yield Store(cluster.url, {**FAST_FAIL, "prefix": prefix}, cfaults, once={0.6: cfaults.wipe})
            cfaults.wipe()
        finally:
            rc.close()
    else:
        raise AssertionError(kind)


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProc]]:
    ws = [WorkerProc(i) for i in range(2)]
    try:
        for w in ws:
            w.send("ping")
        for w in ws:
            w.result(timeout_s=120)
        yield ws
    finally:
        for w in ws:
            w.stop()


def by_doc(served: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(s["doc"], s["tenant"]): s for s in served}


def soak(workers: list[WorkerProc], store: Store) -> None:
    for w in workers:
        w.send("soak", seconds=SOAK_S, seed=SEED)
    inject(store.faults, SOAK_S, random.Random(SEED), store.once)
    tallies = [w.result(timeout_s=SOAK_S + 120) for w in workers]
    errors = [e for t in tallies for e in t["errors"]]
    assert not errors, "\n".join(errors)
    log = store.faults.log
    summary = "; ".join(
        f"worker {i}: {t['requests']} requests, verified hits L1 {t['verified_l1']} / L2 {t['verified_l2']} / "
        f"L3 {t['verified_l3']} pages ({t['verified_foreign']} written by the other process), {t['computed']} "
        f"computed, {t['full']} full, {t['clears']} clears; store: {t['corrupt_pages']} damaged pages refused, "
        f"{t['store_errors']} errors, {t['sets']} pages written" for i, t in enumerate(tallies))
    summary += f"; faults: {log.counts}"
    print(summary)
    for t in tallies:
        assert t["requests"] >= 20 and t["verified_l3"] >= 10, summary
        assert t["metric_corrupt"] == t["corrupt_pages"], summary  # the metric says what the store saw
    assert sum(t["verified_foreign"] for t in tallies) >= 10, summary
    assert log.corrupting >= 20, summary
    assert sum(t["corrupt_pages"] for t in tallies) >= 1, summary  # damage was read, and refused


def recover(workers: list[WorkerProc], store: Store) -> None:
    w0, w1 = workers
    store.faults.wipe()  # the faults' last word: an empty store (wiped by an operator, FLUSHALL, a clear)
    first = w0.call("serve_docs")
    for s in first:
        assert s["l3_exists_after"] == s["pages"], (
            f"worker 0 computed document {s['doc']} (tenant {s['tenant']!r}) again after the store was wiped; "
            f"the store holds {s['l3_exists_after']} of its {s['pages']} pages: {s}")
    for s in w1.call("serve_docs"):
        assert s["l3_match"] == s["pages"] and s["l3_loaded"] == s["pages"], (
            f"worker 1: document {s['doc']} (tenant {s['tenant']!r}) that worker 0 wrote is not a whole L3 hit: "
            f"{s}")

    # known damage, then worker 1 reads every document again
    keys = {k: [bytes.fromhex(h) for h in s["keys"]] for k, s in by_doc(first).items()}
    rng = random.Random(SEED)
    plan = [p for p in PLAN if p[0] in (*store.faults.kinds, "other_tenant")]
    for kind, doc, tenant, page, other in plan:
        src = keys[(other[0], other[1])][other[2]] if other else None
        assert store.faults.damage(keys[(doc, tenant)][page], kind, rng, src), (kind, doc, tenant, page)
    before = w1.call("stats")
    second = by_doc(w1.call("serve_docs"))
    after = w1.call("stats")
    damaged = {(doc, tenant): (kind, page) for kind, doc, tenant, page, _ in plan}
    for key, s in second.items():
        kind, page = damaged.get(key, ("", s["pages"]))
        assert s["l3_loaded"] == page, f"worker 1: {kind or 'undamaged'} document {key}: {s}"
        assert s["l3_match"] == (page if kind == "delete" else s["pages"]), f"worker 1: {kind} document {key}: {s}"
        assert s["l3_exists_after"] == s["pages"], f"worker 1 did not repair document {key}: {s}"
    refused = sum(kind in CORRUPTING for kind, *_ in plan)
    assert after["corrupt_pages"] - before["corrupt_pages"] == refused, (
        f"worker 1's store counted {after['corrupt_pages'] - before['corrupt_pages']} damaged pages; {refused} of "
        f"the pages it read were damaged ({[p[0] for p in plan if p[0] in CORRUPTING]}): {before} -> {after}")
    assert after["metric_corrupt"] - before["metric_corrupt"] == refused, (before, after)
    assert after["metric_misses"] > before["metric_misses"], (before, after)

    # what worker 1 recomputed is worker 0's again
    for s in w0.call("serve_docs"):
        assert s["l3_loaded"] == s["pages"], f"worker 0: document {s['doc']} (tenant {s['tenant']!r}): {s}"


STORES = [
    pytest.param("file", id="file"),
    pytest.param("redis", id="redis", marks=[pytest.mark.redis, needs_redis]),
    pytest.param("cluster", id="cluster", marks=[pytest.mark.redis, needs_redis]),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", STORES)
def test_shared_l3_under_damage_never_serves_a_wrong_page(kind: str, workers: list[WorkerProc], tmp_path: Path,
                                                          request: pytest.FixtureRequest) -> None:
    assert len(PROMPTS.docs) * len(TENANTS) >= len(PLAN)
    with open_store(kind, tmp_path, request) as store:
        for w, layout, more, codec in zip(workers, HOST_LAYOUTS, store.worker_options, COMPRESSION, strict=True):
            w.call("open", url=store.url, options={**store.options, **more}, host_layout=layout, compression=codec)
        try:
            soak(workers, store)
            recover(workers, store)
            zstd = workers[0].call("stats")  # it stored compressed frames among the plain ones of worker 1
            assert 0 < zstd["stored_bytes_written"] < zstd["bytes_written"], zstd
        finally:
            for w in workers:
                w.call("close")


def test_file_store_node_writes_again_after_another_node_wiped_the_store(
        tmp_path: Path, open_backend: Callable[..., StorageBackend]) -> None:
    """The soak's wipe, made deterministic: two nodes share a file store; one of them clears it (or an
    operator empties the directory). The other one's next writes of the same pages must land: it must not
    trust its memory of the directories it had made."""
    url = f"file://{tmp_path / 'l3'}"
    a, b = open_backend(url), open_backend(url)
    pool, keys, idx = make_pool(4), page_keys(4, "wiped"), [0, 1, 2, 3]
    assert a.batch_set(keys, pool, idx) == 4
    b.clear()
    assert b.batch_exists(keys) == 0
    assert a.batch_set(keys, pool, idx) == 4
    got = make_pool(4, seed=None)
    assert b.batch_get(keys, got, idx) == 4 and pages_equal(pool, got, idx, idx)
    assert a.stats().errors == 0 and a.stats().sets == 8


@needs_redis
@pytest.mark.redis
def test_redis_value_of_another_type_at_a_page_key_is_a_damaged_page(
        redis_single: LocalRedis, prefix: str, open_backend: Callable[..., StorageBackend]) -> None:
    """The soak's ``wrong_type`` fault, made deterministic: a list where a page's string was (another
    application's key, a foreign writer) is a damaged page like a string of the wrong size -- a miss, counted
    in ``corrupt_pages`` and deleted, so the store stops claiming the page exists."""
    b = open_backend(redis_single.url, prefix=prefix)
    pool, keys, idx = make_pool(4), page_keys(4, "wrong-type"), [0, 1, 2, 3]
    assert b.batch_set(keys, pool, idx) == 4
    client = redis_single.client()
    rk = b.redis_key(keys[2])  # type: ignore[attr-defined]
    client.delete(rk)
    client.rpush(rk, b"not a page")
    got = make_pool(4, seed=None)
    assert b.batch_get(keys, got, idx) == 2 and pages_equal(pool, got, [0, 1], [0, 1])
    assert b.stats().corrupt_pages == 1 and b.stats().errors == 0
    assert b.batch_exists(keys) == 2  # deleted: no longer claimed as a hit
    assert b.batch_set(keys, pool, idx) == 4 and b.batch_get(keys, got, idx) == 4
    client.close()
