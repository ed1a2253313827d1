"""Redis specifics against real redis-server processes: Cluster spread, AUTH/ACL, TTL, a store that dies."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from hicache.storage.redis_backend import RedisBackend
from hicache.storage.redis_local import LocalRedis
from storage.conftest import make_pool, needs_redis, page_keys, pages_equal

pytestmark = [pytest.mark.redis, needs_redis]

FAST_FAIL = {"timeout_s": 0.5, "connect_timeout_s": 0.2, "retry_attempts": 2, "retry_base_s": 0.005,
             "breaker_base_s": 0.05, "breaker_max_s": 0.2}


def test_cluster_spreads_one_request_over_all_masters(redis_cluster, open_backend, prefix) -> None:
    b = open_backend(redis_cluster.url, prefix=prefix)
    assert isinstance(b, RedisBackend)
    keys = page_keys(96, "spread")  # one request's chain of pages
    src, dst = make_pool(96, seed=5), make_pool(96, seed=None)
    assert b.batch_set(keys, src, list(range(96))) == 96
    counts = b.key_counts()
    assert len(counts) == 3 and all(c >= 16 for c in counts.values()), counts
    assert sum(counts.values()) == 96
    assert b.batch_exists(keys) == 96
    assert b.batch_get(keys, dst, list(range(96))) == 96
    assert pages_equal(src, dst, list(range(96)), list(range(96)))
    assert b.clear() == 96
    assert b.batch_exists(keys) == 0


def test_acl_user_and_password_from_url(open_backend) -> None:
    with LocalRedis(password="adminpw") as r:
        admin = r.client()
        admin.execute_command("ACL", "SETUSER", "kv", "on", ">s3cr%t", "~hc:*", "+@all")
        keys = page_keys(4, "acl")
        src, dst = make_pool(4, seed=6), make_pool(4, seed=None)
        good = open_backend(f"redis://kv:s3cr%25t@127.0.0.1:{r.port}/0?prefix=hc:")
        assert good.batch_set(keys, src, [0, 1, 2, 3]) == 4
        assert good.batch_get(keys, dst, [0, 1, 2, 3]) == 4
        assert pages_equal(src, dst, [0, 1, 2, 3], [0, 1, 2, 3])
        assert admin.exists(b"hc:{" + keys[0].hex().encode() + b"}") == 1
        # Wrong password / a prefix the ACL forbids: errors are counted, nothing raises, nothing is served.
        bad = open_backend(f"redis://kv:wrong@127.0.0.1:{r.port}/0?prefix=hc:", **FAST_FAIL)
        assert bad.batch_exists(keys) == 0 and bad.batch_get(keys, dst, [0, 1, 2, 3]) == 0
        assert bad.stats().errors >= 1
        denied = open_backend(f"redis://kv:s3cr%25t@127.0.0.1:{r.port}/0?prefix=other:", **FAST_FAIL)
        assert denied.batch_set(keys, src, [0, 1, 2, 3]) == 0
        assert denied.stats().errors >= 1
        admin.close()


def test_ttl_applies_and_reads_push_it_out(redis_single, open_backend, prefix) -> None:
    b = open_backend(redis_single.url, prefix=prefix, ttl_s=30)
    keys = page_keys(3, "ttl")
    assert b.batch_set(keys, make_pool(3), [0, 1, 2]) == 3
    c = redis_single.client()
    rk = b.redis_key(keys[0])
    assert 0 < c.pttl(rk) <= 30_000
    c.pexpire(rk, 5_000)
    assert b.batch_get(keys, make_pool(3, seed=None), [0, 1, 2]) == 3
    assert c.pttl(rk) > 5_000  # GETEX refreshed it
    c.close()


def test_store_killed_mid_run_raises_nothing_and_comes_back(open_backend) -> None:
    r = LocalRedis().start()
    try:
        b = open_backend(r.url, **FAST_FAIL)
        keys = page_keys(64, "kill")
        src, dst = make_pool(64, seed=7), make_pool(64, seed=None)
        assert b.batch_set(keys, src, list(range(64))) == 64
        stop = threading.Event()
        raised: list[BaseException] = []

        def hammer() -> None:
            while not stop.is_set():
                try:
                    b.batch_get(keys, make_pool(64, seed=None), list(range(64)))
                    b.batch_exists(keys)
                    b.batch_set(keys[:8], src, list(range(8)))
                except BaseException as e:  # the contract: never
                    raised.append(e)

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        r.kill()  # SIGKILL while batches are in flight
        time.sleep(0.4)
        assert b.batch_exists(keys) == 0
        assert b.batch_get(keys, dst, list(range(64))) == 0
        assert b.batch_set(keys, src, list(range(64))) == 0
        errors_down = b.stats().errors
        assert errors_down >= 1
        r.start()  # same port, empty store (no persistence)
        deadline = time.monotonic() + 5
        while b.batch_set(keys, src, list(range(64))) != 64:
            assert time.monotonic() < deadline, "L3 did not come back after the store restarted"
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join()
        assert raised == []
        assert b.batch_exists(keys) == 64
        assert b.batch_get(keys, dst, list(range(64))) == 64
        assert pages_equal(src, dst, list(range(64)), list(range(64)))
    finally:
        r.stop()


def test_unreachable_store_fails_fast_after_first_error(open_backend) -> None:
    from hicache.storage.redis_local import free_port
    b = open_backend(f"redis://127.0.0.1:{free_port()}/0", **{**FAST_FAIL, "breaker_base_s": 5, "breaker_max_s": 5})
    keys = page_keys(8, "down")
    t0 = time.perf_counter()
    for _ in range(50):
        assert b.batch_exists(keys) == 0
    assert time.perf_counter() - t0 < 1.0  # the breaker keeps requests off a dead store
    st = b.stats()
    assert st.errors == 50 and st.extra.get("breaker_skips", 0) == 49


def test_sentinel_url_finds_the_master(open_backend, prefix) -> None:
    from hicache.storage.redis_local import LocalSentinel
    with LocalRedis(password="pw") as r, LocalSentinel(r, "kv") as s:
        url = s.url.replace("redis+sentinel://", "redis+sentinel://:pw@")
        b = open_backend(url, prefix=prefix)
        keys = page_keys(8, "sentinel")
        src, dst = make_pool(8, seed=13), make_pool(8, seed=None)
        assert b.batch_set(keys, src, list(range(8))) == 8
        assert b.batch_get(keys, dst, list(range(8))) == 8
        assert pages_equal(src, dst, list(range(8)), list(range(8)))
        c = r.client()
        assert c.exists(b.redis_key(keys[0])) == 1  # it went to the master the sentinel named
        c.close()


def _serves_after_failover(b, keys: list[bytes], n_old: int, src, dst, deadline: float) -> None:  # type: ignore[no-untyped-def]
    """The first ``n_old`` pages (written before the failover) read back once the backend follows the new
    master -- until then reads are misses, not errors -- and the rest are stored and read back after it."""
    old, new = list(range(n_old)), list(range(n_old, len(keys)))
    got = 0
    while got != n_old:
        assert time.monotonic() < deadline, "the store did not fail over, or the backend did not follow"
        got = b.batch_get(keys[:n_old], dst, old)
        time.sleep(0.05)
    assert pages_equal(src, dst, old, old)
    assert b.batch_set(keys[n_old:], src, new) == len(new)
    assert b.batch_get(keys[n_old:], dst, new) == len(new)
    assert pages_equal(src, dst, new, new)


def _wait_replicated(client: redis.Redis, timeout_s: float = 30.0) -> None:
    """Until a replica acknowledged every write so far (a replica's first sync can take seconds on a busy
    machine; one WAIT is bounded by the client's socket timeout)."""
    deadline = time.monotonic() + timeout_s
    while client.execute_command("WAIT", 1, 2000) != 1:
        assert time.monotonic() < deadline, "no replica acknowledged the writes"

def test_sentinel_failover_keeps_pages_and_serving(open_backend, prefix) -> None:
    """SIGKILL the master: the Sentinel promotes the replica, the backend follows it, the pages written
    before the failover (replicated) are still read back, and new pages are stored on the new master."""
    from hicache.storage.redis_local import LocalSentinel
    with LocalRedis(password="pw") as m, \
            LocalRedis(password="pw", extra=("--replicaof", "127.0.0.1", str(m.port), "--masterauth", "pw")) as rep, \
            LocalSentinel(m, "kv", {"down-after-milliseconds": "300", "failover-timeout": "3000"}) as s:
        b = open_backend(s.url.replace("redis+sentinel://", "redis+sentinel://:pw@"), prefix=prefix, **FAST_FAIL)
        keys = page_keys(16, "failover")
        src, dst = make_pool(32, seed=17), make_pool(32, seed=None)
        assert b.batch_set(keys[:8], src, list(range(8))) == 8
        mc = m.client()
        _wait_replicated(mc)  # the replica has them
        mc.close()
        m.kill()
        rc = rep.client()
        deadline = time.monotonic() + 20
        while rc.info("replication")["role"] != "master":
            assert time.monotonic() < deadline, "the sentinel did not promote the replica"
            time.sleep(0.1)
        rc.close()
        _serves_after_failover(b, keys, 8, src, dst, deadline)
        rc = rep.client()
        assert rc.exists(b.redis_key(keys[15])) == 1  # written to the promoted replica
        rc.close()


def test_cluster_failover_keeps_pages_and_serving(open_backend, prefix) -> None:
    """A 3-master Cluster with a replica each: SIGKILL a master, its replica takes over its slots, the
    backend follows the new slot map, and every page written before (replicated) still reads back."""
    from hicache.storage.redis_local import LocalRedisCluster
    with LocalRedisCluster(3, replicas=1) as cl:  # nodes fail over after 2 s unreachable
        b = open_backend(cl.url, prefix=prefix, **FAST_FAIL)
        keys = page_keys(48, "cluster-failover")
        src, dst = make_pool(64, seed=19), make_pool(64, seed=None)
        assert b.batch_set(keys[:32], src, list(range(32))) == 32
        def role(n: LocalRedis) -> bytes:
            c = n.client()
            try:
                return c.execute_command("ROLE")[0]
            finally:
                c.close()

        victim = next(n for n in cl.nodes if role(n) == b"master")
        vc = victim.client()
        _wait_replicated(vc)
        held = vc.dbsize()
        vc.close()
        assert held > 0  # the victim holds some of the pages
        victim.kill()
        _serves_after_failover(b, keys, 32, src, dst, time.monotonic() + 30)


def _make_certs(d) -> tuple[str, str, str]:  # type: ignore[no-untyped-def]
    import subprocess
    ca_key, ca, key, csr, crt = (str(d / n) for n in ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt"))
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", ca_key,
        "-out", ca, "-days", "1", "-subj", "/CN=hicache-test-ca")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", csr,
        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1")
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", crt, "-days", "1",
        "-extfile", str(ext))
    return ca, crt, key


@pytest.mark.skipif(__import__("shutil").which("openssl") is None, reason="openssl is not installed")
def test_tls_url_round_trip(tmp_path, open_backend, prefix) -> None:
    from hicache.storage.redis_local import free_port
    ca, crt, key = _make_certs(tmp_path)
    tls_port = free_port()
    extra = ("--tls-port", str(tls_port), "--tls-cert-file", crt, "--tls-key-file", key, "--tls-ca-cert-file", ca,
             "--tls-auth-clients", "no")
    try:
        r = LocalRedis(extra=extra).start()
    except RuntimeError as e:  # a redis-server built without TLS
        pytest.skip(f"redis-server without TLS support: {e}")
    try:
        b = open_backend(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}", prefix=prefix)
        keys = page_keys(16, "tls")
        src, dst = make_pool(16, seed=14), make_pool(16, seed=None)
        assert b.batch_set(keys, src, list(range(16))) == 16
        assert b.batch_get(keys, dst, list(range(16))) == 16
        assert pages_equal(src, dst, list(range(16)), list(range(16)))
        untrusted = open_backend(f"rediss://127.0.0.1:{tls_port}/0", prefix=prefix, **FAST_FAIL)
        assert untrusted.batch_exists(keys) == 0 and untrusted.stats().errors == 1  # unknown CA: refused
    finally:
        r.stop()


def test_more_concurrent_operations_than_connections_wait_instead_of_failing(redis_single, open_backend,
                                                                             prefix) -> None:
    b = open_backend(redis_single.url, prefix=prefix, max_connections=2)
    keys, src = page_keys(32, "conc"), make_pool(32, seed=15)
    assert b.batch_set(keys, src, list(range(32))) == 32
    short: list[int] = []

    def reader() -> None:
        for _ in range(20):
            dst = make_pool(32, seed=None)
            n = b.batch_get(keys, dst, list(range(32)))
            if n != 32 or not pages_equal(src, dst, list(range(32)), list(range(32))):
                short.append(n)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert short == [] and b.stats().errors == 0


def _wait_for_slot_owner(clients: dict, slot: int, port: int, timeout_s: float = 10.0) -> None:
    """Until every node's CLUSTER SLOTS gives ``slot`` to the node on ``port``."""
    import time

    def owner(c) -> int | None:
        for row in c.execute_command("CLUSTER", "SLOTS"):
            if int(row[0]) <= slot <= int(row[1]):
                return int(row[2][1])
        return None

    deadline = time.monotonic() + timeout_s
    while any(owner(c) != port for c in clients.values()):
        assert time.monotonic() < deadline, f"slot {slot} did not settle on port {port}"
        time.sleep(0.05)


def test_moved_reply_parses() -> None:
    """A MOVED reply gives the slot and the new owner; other errors give None."""
    from hicache.storage.redis_nodes import moved as _moved
    from hicache.storage.resp import ReplyError

    m = _moved(ReplyError("MOVED 16246 127.0.0.1:47693"))
    assert m is not None and (m.slot_id, m.host, m.port) == (16246, "127.0.0.1", 47693)
    assert _moved(ReplyError("ASK 5 127.0.0.1:1")) is None
    assert _moved(ReplyError("MOVED nonsense")) is None
    assert _moved(ConnectionError("down")) is None
    assert _moved(None) is None


def test_cluster_follows_a_moved_slot(redis_cluster, open_backend, prefix) -> None:
    """A slot changes owner behind the client's back: the MOVED reply refreshes the map, the retry lands."""
    import redis as redis_py

    b = open_backend(redis_cluster.url, prefix=prefix)
    assert isinstance(b, RedisBackend)
    keys = page_keys(4, "moved")
    src, dst = make_pool(4, seed=16), make_pool(4, seed=None)
    assert b.batch_exists(keys) == 0  # builds the slot map
    rc = b._nodes.cluster()
    slot = rc.keyslot(b.redis_key(keys[0]))
    owner = rc.nodes_manager.get_node_from_slot(slot)
    clients = {n.port: redis_py.Redis(port=n.port) for n in redis_cluster.nodes}
    ids = {p: c.execute_command("CLUSTER", "MYID") for p, c in clients.items()}
    assert all(c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0 for c in clients.values())
    target = next(p for p in clients if p != owner.port)
    for c in clients.values():  # an empty slot can be reassigned directly
        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
    _wait_for_slot_owner(clients, slot, target)  # gossip settles the config epochs
    assert b.batch_set(keys, src, [0, 1, 2, 3]) == 4
    assert b.stats().extra.get("retries", 0) >= 1
    assert clients[target].exists(b.redis_key(keys[0])) == 1
    assert b.batch_get(keys, dst, [0, 1, 2, 3]) == 4
    assert pages_equal(src, dst, [0, 1, 2, 3], [0, 1, 2, 3])
    b.delete(keys)
    for c in clients.values():
        c.close()


def test_write_checksums_run_on_lower_priority_threads(redis_single, open_backend, prefix) -> None:
    """Writes' frame checksums run on their own background threads, which lower their priority; reads
    verify on the normal-priority hash threads."""
    import os
    import sys

    b = open_backend(f"redis://127.0.0.1:{redis_single.port}/0?prefix={prefix}&write_nice=7&hash_threads=4")
    keys, src, dst = page_keys(6, "nice"), make_pool(6, seed=9), make_pool(6, seed=None)
    assert b.batch_set(keys, src, list(range(6))) == 6
    assert b.batch_get(keys, dst, list(range(6))) == 6
    assert pages_equal(src, dst, list(range(6)), list(range(6)))
    threads = {t.name: t.native_id for t in threading.enumerate()}
    writers = [n for n in threads if n.startswith("hicache-redis-write-hash")]
    readers = [n for n in threads if n.startswith("hicache-redis-hash")]
    assert writers and len(writers) <= 2
    if sys.platform == "linux":
        me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert all(os.getpriority(os.PRIO_PROCESS, threads[n]) == min(19, me + 7) for n in writers)
        assert all(os.getpriority(os.PRIO_PROCESS, threads[n]) == me for n in readers)


def test_bad_write_nice_is_a_clear_error(redis_single) -> None:
    with pytest.raises(ValueError, match="write_nice"):
        RedisBackend(f"redis://127.0.0.1:{redis_single.port}/0", None, write_nice=25)  # type: ignore[arg-type]
