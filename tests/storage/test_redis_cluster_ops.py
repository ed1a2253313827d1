"""The Redis Cluster L3 store through real cluster operations while the backend is under load: a master
SIGKILLed and its replica promoted, and slots migrated between masters (``ASK`` while a slot's keys are
split over two nodes, ``MOVED`` once it has moved). Nothing raises out of the backend, no page is ever
read back with bytes other than those written to its key, the counters account for every failure, and
once the cluster settles every page reads back from its new home. A Cluster that is down (``CLUSTERDOWN``)
is a counted store failure."""

from __future__ import annotations

import time

import pytest
import redis

from hicache.pool import HostPool
from hicache.storage.base import StorageBackend, StorageStats
from hicache.storage.redis_backend import RedisBackend
from hicache.storage.redis_local import LocalRedis, LocalRedisCluster
from storage.cluster_ops import (
    CheckedLoad,
    SlotMover,
    cluster_state,
    join,
    keys_in_slots,
    role,
    slot_owner_port,
    wait_replicated,
)
from storage.conftest import make_pool, needs_redis, page_keys

pytestmark = [pytest.mark.redis, needs_redis]

OPTS = {"timeout_s": 1.0, "connect_timeout_s": 0.2, "retry_attempts": 3, "retry_base_s": 0.01,
        "breaker_base_s": 0.05, "breaker_max_s": 0.5}


def _slot_ranges(client: redis.Redis, port: int) -> list[tuple[int, int]]:
    return [(int(r[0]), int(r[1])) for r in client.execute_command("CLUSTER", "SLOTS") if int(r[2][1]) == port]


def _read_all(b: StorageBackend, src: HostPool, keys: list[bytes], src_pages: list[int]) -> tuple[int, list[int]]:
    """batch_get of ``keys`` (written from ``src_pages`` of ``src``) into host pages in reverse order:
    (pages returned, positions whose bytes differ from those written)."""
    dst = make_pool(len(keys), seed=None)
    where = list(range(len(keys) - 1, -1, -1))
    got = b.batch_get(keys, dst, where)
    return got, [i for i in range(got) if dst.page_bytes(where[i]) != src.page_bytes(src_pages[i])]


def _delta(a: StorageStats, b: StorageStats) -> StorageStats:
    return StorageStats(*(getattr(b, f) - getattr(a, f) for f in
                          ("gets", "get_misses", "sets", "bytes_read", "bytes_written", "corrupt_pages", "errors")))


def test_master_killed_under_load_fails_over_without_a_wrong_page(open_backend, prefix) -> None:
    """SIGKILL a master while two threads read, write and probe: calls only ever miss or store nothing
    (counted), never raise or return foreign bytes; within 15 s the backend follows the promoted replica,
    reads back every page written (and replicated) before the kill, stores new pages on the failed
    master's slots, and its breaker is closed again."""
    with LocalRedisCluster(3, replicas=1, node_timeout_ms=500) as cl:
        b = open_backend(cl.url, prefix=prefix, **OPTS)
        assert isinstance(b, RedisBackend)
        src = make_pool(96, seed=23)
        old = page_keys(48, "before-kill")
        assert b.batch_set(old, src, list(range(48))) == 48
        masters = [n for n in cl.nodes if role(n)[0] == "master"]
        victim = masters[0]
        heir = next(n for n in cl.nodes if role(n) == ("slave", victim.port))
        for m in masters:
            c = m.client()
            wait_replicated(c)
            c.close()
        vc = victim.client()
        assert vc.dbsize() > 0  # the victim holds some of the pages
        victim_slots = [lo for lo, _ in _slot_ranges(vc, victim.port)]
        vc.close()
        on_victim = keys_in_slots(b, [s + i for s in victim_slots for i in range(4)], 1, "after-kill")
        before = b.stats()
        main = {"asked": 0, "got": 0, "stored": 0}

        with CheckedLoad(b, src, old) as load:
            load.wait_rounds(2)
            victim.kill()
            deadline = time.monotonic() + 15
            while role(heir)[0] != "master":
                assert time.monotonic() < deadline, "the replica was not promoted"
                time.sleep(0.05)
            while True:  # until the backend reads every old page and stores on the failed master's slots
                assert time.monotonic() < deadline, "the backend did not follow the new master within 15 s"
                got, wrong = _read_all(b, src, old, list(range(48)))
                assert wrong == []
                stored = b.batch_set(on_victim, src, list(range(48, 48 + len(on_victim))))
                main["asked"] += 48
                main["got"] += got
                main["stored"] += stored
                if got == 48 and stored == len(on_victim):
                    break
                time.sleep(0.05)
            load.wait_rounds(3)  # and the load runs on the new topology
        report = load.report

        assert report.raised == [] and report.wrong_pages == []
        assert report.short_old_reads > 0  # the kill was felt: these reads failed...
        s = _delta(before, b.stats())
        assert s.errors >= report.short_old_reads  # ...and each failure was counted
        assert s.gets + s.get_misses == report.get_pages + main["asked"]  # every page asked is a hit or a miss
        assert s.gets == report.got_pages + main["got"]
        assert s.sets == report.stored_pages + main["stored"]
        assert s.corrupt_pages == 0
        assert not b._breaker.is_open
        got, wrong = _read_all(b, src, on_victim, list(range(48, 48 + len(on_victim))))
        assert (got, wrong) == (len(on_victim), [])
        hc = heir.client()
        assert all(hc.exists(b.redis_key(k)) for k in on_victim)  # stored on the promoted replica
        hc.close()


def test_slots_migrated_under_load_follow_ask_and_moved(open_backend, prefix) -> None:
    """Slots holding pages move from one master to another while two threads read and write: a slot
    half migrated answers ``ASK`` for the keys already moved (and for new ones), a moved slot ``MOVED``;
    the backend follows both within the call -- a batch over every master returns every page in its own
    host page, writes land, nothing is counted as an error -- and afterwards every page reads back from
    its new home."""
    with LocalRedisCluster(3) as cl:
        b = open_backend(cl.url, prefix=prefix, **OPTS)
        assert isinstance(b, RedisBackend)
        clients = {n.port: n.client() for n in cl.nodes}
        try:
            src_port, dst_port = cl.nodes[0].port, cl.nodes[1].port
            lo, _ = _slot_ranges(clients[src_port], src_port)[0]
            moving = list(range(lo, lo + 24))
            moved_keys = keys_in_slots(b, moving, 2, "moving")  # 48 pages, 2 per slot
            staying = page_keys(24, "staying")
            old = [k for pair in zip(moved_keys[::2], moved_keys[1::2], staying, strict=True) for k in pair]
            n = len(old)
            src = make_pool(128, seed=29)
            pages = list(range(n))
            assert b.batch_set(old, src, pages) == n
            assert len(b.key_counts()) == 3  # the batch spans every master
            before = b.stats()
            mover = SlotMover(clients, src_port, dst_port)

            # a slot half migrated: one of its pages on each node
            s0 = moving[0]
            mover.begin(s0)
            mover.migrate([b.redis_key(moved_keys[0])])
            assert _read_all(b, src, old, pages) == (n, [])
            assert b.batch_exists(old) == n
            new_in_s0 = keys_in_slots(b, [s0], 1, "new-while-migrating")
            assert b.batch_set(new_in_s0, src, [n]) == 1  # not on the source: ASK to the importing node
            every, every_pages = old + new_in_s0, [*pages, n]
            assert _read_all(b, src, every, every_pages) == (n + 1, [])

            # that slot and 8 more move while the backend looks away: one batch meets MOVED for all 9
            mover.migrate_all(s0)
            mover.finish(s0)
            for s in moving[1:9]:
                mover.move(s)
            mover.wait_settled(moving[:9])
            assert _read_all(b, src, every, every_pages) == (n + 1, [])
            assert b.batch_exists(old) == n
            assert _delta(before, b.stats()).errors == 0

            # the rest moves under load
            with CheckedLoad(b, src, old, fresh_salt="fresh") as load:
                load.wait_rounds(1)
                for s in moving[9:]:
                    mover.move(s)
                mover.wait_settled(moving)
                load.wait_rounds(2)
            r = load.report
            assert r.raised == [] and r.wrong_pages == []
            assert (r.short_old_reads, r.short_fresh_reads, r.short_sets) == (0, 0, 0)

            assert all(slot_owner_port(clients[dst_port], s) == dst_port for s in moving)
            assert all(clients[dst_port].exists(b.redis_key(k)) for k in moved_keys + new_in_s0)
            assert not any(clients[src_port].execute_command("CLUSTER", "COUNTKEYSINSLOT", s) for s in moving)
            assert _read_all(b, src, every, every_pages) == (n + 1, [])
            s = _delta(before, b.stats())
            assert (s.errors, s.corrupt_pages) == (0, 0)
            assert not b._breaker.is_open
        finally:
            for c in clients.values():
                c.close()


def test_slots_moved_to_a_new_master_follow_ask_to_a_node_no_slot_map_lists(open_backend, prefix) -> None:
    """The Cluster grows: an empty master joins and imports its first slots. While the first is half
    migrated, ``ASK`` names a node that owns no slot, so no ``CLUSTER SLOTS`` lists it; the backend
    connects to it and follows, then follows ``MOVED`` to it; nothing fails and the pages end up there."""
    with LocalRedisCluster(3) as cl, LocalRedis(cluster=True) as new:
        b = open_backend(cl.url, prefix=prefix, **OPTS)
        assert isinstance(b, RedisBackend)
        clients = {n.port: n.client() for n in cl.nodes}
        try:
            src_port = cl.nodes[0].port
            lo, _ = _slot_ranges(clients[src_port], src_port)[0]
            moving = list(range(lo, lo + 4))
            keys = keys_in_slots(b, moving, 2, "to-new") + page_keys(16, "elsewhere")
            n = len(keys)
            src = make_pool(n + 1, seed=37)
            assert b.batch_set(keys, src, list(range(n))) == n
            clients[new.port] = join(new, clients)
            mover = SlotMover(clients, src_port, new.port)
            mover.begin(moving[0])
            mover.migrate([b.redis_key(keys[0])])
            assert _read_all(b, src, keys, list(range(n))) == (n, [])
            fresh = keys_in_slots(b, [moving[0]], 1, "fresh-to-new")
            assert b.batch_set(fresh, src, [n]) == 1
            mover.migrate_all(moving[0])
            mover.finish(moving[0])
            for s in moving[1:]:
                mover.move(s)
            mover.wait_settled(moving)
            assert _read_all(b, src, keys + fresh, [*range(n), n]) == (n + 1, [])
            assert b.stats().errors == 0
            assert sum(clients[new.port].execute_command("CLUSTER", "COUNTKEYSINSLOT", s) for s in moving) == 9
        finally:
            for c in clients.values():
                c.close()


def test_cluster_down_is_a_counted_failure_and_passes(open_backend, prefix) -> None:
    """A slot served by no master puts the Cluster in ``fail`` state: every key answers ``CLUSTERDOWN``.
    That is a store failure -- counted, retried, the breaker opened -- not a quiet miss;
    once the slot is served again the pages read back."""
    with LocalRedisCluster(3) as cl:
        b = open_backend(cl.url, prefix=prefix, **OPTS)
        assert isinstance(b, RedisBackend)
        clients = {n.port: n.client() for n in cl.nodes}
        try:
            keys = page_keys(24, "down")
            src = make_pool(24, seed=31)
            assert b.batch_set(keys, src, list(range(24))) == 24
            slot = b._nodes.cluster().keyslot(b.redis_key(keys[0]))
            owner = next(p for p, c in clients.items() if slot_owner_port(c, slot) == p)
            for c in clients.values():
                c.execute_command("CLUSTER", "DELSLOTS", slot)
            deadline = time.monotonic() + 10
            while any(cluster_state(c) != "fail" for c in clients.values()):
                assert time.monotonic() < deadline, "the cluster did not go down"
                time.sleep(0.02)
            before = b.stats()
            assert _read_all(b, src, keys, list(range(24))) == (0, [])
            assert b.batch_set(keys, src, list(range(24))) == 0
            s = _delta(before, b.stats())
            assert s.errors >= 2 and s.get_misses == 24
            assert b._breaker.is_open

            clients[owner].execute_command("CLUSTER", "ADDSLOTS", slot)
            deadline = time.monotonic() + 10
            while _read_all(b, src, keys, list(range(24))) != (24, []):
                assert time.monotonic() < deadline, "the backend did not come back with the cluster"
                time.sleep(0.05)
            assert not b._breaker.is_open
        finally:
            for c in clients.values():
                c.close()


@pytest.mark.parametrize("reply", [
    "MOVED 7 127.0.0.1:7000", "ASK 7 127.0.0.1:7000", "TRYAGAIN Multiple keys request during rehashing of slot",
    "CLUSTERDOWN The cluster is down", "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is 'no'.",
    "READONLY You can't write against a read only replica.", "LOADING Redis is loading the dataset in memory",
    "BUSY Redis is busy running a script."])
def test_transient_replies_are_transient(reply: str) -> None:
    """A reply as it came off the wire is a transient store error, and a redirection is one."""
    from hicache.storage.redis_nodes import is_transient, redirection
    from hicache.storage.resp import ReplyError

    assert is_transient(ReplyError(reply))
    r = redirection(ReplyError(reply))
    if reply.split(" ")[0] in ("MOVED", "ASK"):
        assert r is not None and (r.slot_id, r.host, r.port) == (7, "127.0.0.1", 7000)
        assert isinstance(r, redis.exceptions.MovedError) == reply.startswith("MOVED")
    else:
        assert r is None
    assert not is_transient(ReplyError("WRONGTYPE Operation against a key holding the wrong kind"))
