"""Redis Cluster operations for the storage tests: roles, replication, slot migration, and a checked load.

* :func:`role`, :func:`wait_replicated`, :func:`node_id`, :func:`cluster_state` -- what a node is, and
  until a replica has its master's writes; :func:`join` -- an empty master added to the Cluster.
* :func:`keys_in_slots` -- page keys whose Redis keys hash to chosen slots (a slot to migrate holds pages).
* :class:`SlotMover` -- a slot moved from one master to another by hand, step by step, as
  ``redis-cli --cluster reshard`` does it (``SETSLOT IMPORTING`` / ``MIGRATING``, ``MIGRATE`` the keys,
  ``SETSLOT NODE`` on the importing node first, then on the others), so a test can look at the cluster
  between the steps (keys of one slot split over two nodes: ``ASK``; a finished slot: ``MOVED``).
* :class:`CheckedLoad` -- threads issuing ``batch_set`` / ``batch_get`` / ``batch_exists`` through a
  backend, recording anything raised, any page read back with bytes other than those written, and the
  totals the backend's counters must account for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from hicache.pool import HostPool
from hicache.storage.base import StorageBackend
from hicache.storage.redis_local import LocalRedis
from storage.conftest import make_pool, page_keys


def role(node: LocalRedis) -> tuple[str, int | None]:
    """(``"master"`` | ``"slave"``, the master's port for a replica); ``("down", None)`` when it does not
    answer."""
    c = node.client()
    try:
        r = c.execute_command("ROLE")
    except redis.RedisError:
        return "down", None
    finally:
        c.close()
    kind = r[0].decode()
    return kind, (int(r[2]) if kind == "slave" else None)


def node_id(client: redis.Redis) -> str:
    nid = client.execute_command("CLUSTER", "MYID")
    return nid.decode() if isinstance(nid, bytes) else str(nid)


def wait_replicated(client: redis.Redis, timeout_s: float = 30.0) -> None:
    """Until a replica acknowledged every write the master took so far."""
    deadline = time.monotonic() + timeout_s
    while client.execute_command("WAIT", 1, 2000) != 1:
        if time.monotonic() > deadline:
            raise AssertionError("no replica acknowledged the writes")


def slot_owner_port(client: redis.Redis, slot: int) -> int | None:
    for row in client.execute_command("CLUSTER", "SLOTS"):
        if int(row[0]) <= slot <= int(row[1]):
            return int(row[2][1])
    return None


def cluster_state(client: redis.Redis) -> str:
    info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("cluster_state:"))


def join(new: LocalRedis, clients: dict[int, redis.Redis], timeout_s: float = 10.0) -> redis.Redis:
    """Add the empty cluster-enabled node ``new`` to the Cluster of ``clients`` (a master without slots,
    as ``redis-cli --cluster add-node`` leaves it); returns its client once every node knows it."""
    nc = new.client()
    nc.execute_command("CLUSTER", "MEET", "127.0.0.1", next(iter(clients)))
    everyone = [*clients.values(), nc]
    deadline = time.monotonic() + timeout_s
    while any(len(c.execute_command("CLUSTER", "NODES").splitlines()) != len(everyone) for c in everyone) \
            or cluster_state(nc) != "ok":
        if time.monotonic() > deadline:
            raise AssertionError(f"node {new.port} did not join the cluster")
        time.sleep(0.05)
    return nc


def keys_in_slots(backend: StorageBackend, slots: Sequence[int], per_slot: int, salt: str) -> list[bytes]:
    """``per_slot`` page keys for each of ``slots`` (in slot order), found by trying salted keys."""
    from redis.crc import key_slot

    redis_key = backend.redis_key  # type: ignore[attr-defined]
    want = {s: per_slot for s in slots}
    found: dict[int, list[bytes]] = {s: [] for s in slots}
    i = 0
    while any(want.values()):
        k = page_keys(1, f"{salt}/{i}")[0]
        i += 1
        s = key_slot(redis_key(k))
        if want.get(s):
            found[s].append(k)
            want[s] -= 1
    return [k for s in slots for k in found[s]]


class SlotMover:
    """Moves slots from the master on ``src`` to the master on ``dst``; ``clients`` is every master by port."""

    def __init__(self, clients: dict[int, redis.Redis], src: int, dst: int) -> None:
        self.clients, self.src, self.dst = clients, src, dst
        self.src_id, self.dst_id = node_id(clients[src]), node_id(clients[dst])

    def begin(self, slot: int) -> None:
        self.clients[self.dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.src_id)
        self.clients[self.src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.dst_id)

    def migrate(self, keys: Sequence[bytes]) -> None:
        if keys:
            self.clients[self.src].execute_command("MIGRATE", "127.0.0.1", self.dst, "", 0, 5000, "KEYS", *keys)

    def migrate_all(self, slot: int) -> int:
        n = 0
        while True:
            keys = self.clients[self.src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
            if not keys:
                return n
            self.migrate(keys)
            n += len(keys)

    def finish(self, slot: int) -> None:
        order = [self.dst, self.src] + [p for p in self.clients if p not in (self.src, self.dst)]
        for p in order:
            self.clients[p].execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.dst_id)

    def move(self, slot: int) -> int:
        self.begin(slot)
        n = self.migrate_all(slot)
        self.finish(slot)
        return n

    def wait_settled(self, slots: Sequence[int], timeout_s: float = 10.0) -> None:
        """Until every master's CLUSTER SLOTS gives each of ``slots`` to ``dst``."""
        deadline = time.monotonic() + timeout_s
        while any(slot_owner_port(c, s) != self.dst for c in self.clients.values() for s in slots):
            if time.monotonic() > deadline:
                raise AssertionError(f"slots {slots[0]}..{slots[-1]} did not settle on port {self.dst}")
            time.sleep(0.05)


@dataclass
class LoadReport:
    raised: list[str] = field(default_factory=list)  # anything that came out of the backend
    wrong_pages: list[str] = field(default_factory=list)  # a page read back with other bytes than written
    get_calls: int = 0
    get_pages: int = 0  # pages asked for
    got_pages: int = 0  # pages returned
    short_old_reads: int = 0  # reads of the pages stored before the load that came back short
    short_fresh_reads: int = 0  # reads of pages the load itself stored that came back short
    set_pages: int = 0  # pages asked to store
    stored_pages: int = 0  # pages stored
    short_sets: int = 0
    exists_calls: int = 0


class CheckedLoad:
    """``threads`` workers looping set (fresh keys) / get (the ``old`` keys, and fresh ones already stored)
    / exists over ``backend`` until :meth:`stop`. ``src`` holds page ``i``'s bytes for ``old[i]``; fresh
    keys are written from pages of ``src`` too. Reads land in a pool of the worker's own, at host pages
    in reverse order, so a page that lands in the wrong host page shows as wrong bytes."""

    def __init__(self, backend: StorageBackend, src: HostPool, old: list[bytes], threads: int = 2,
                 batch: int = 24, fresh_salt: str = "fresh") -> None:
        self.b, self.src, self.old = backend, src, old
        self._old_page = {k: i for i, k in enumerate(old)}
        self.batch = batch
        self.report = LoadReport()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fresh_salt = fresh_salt
        self.rounds = 0
        self._threads = [threading.Thread(target=self._work, args=(t,), daemon=True) for t in range(threads)]

    def __enter__(self) -> CheckedLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadReport:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
            if t.is_alive():
                self.report.raised.append("a load thread did not stop (hung in the backend)")
        return self.report

    def wait_rounds(self, n: int, timeout_s: float = 20.0) -> None:
        """Until every thread ran ``n`` more rounds (from now)."""
        target = self.rounds + n * len(self._threads)
        deadline = time.monotonic() + timeout_s
        while self.rounds < target:
            if time.monotonic() > deadline:
                raise AssertionError("the load made no progress")
            time.sleep(0.01)

    def _read(self, keys: list[bytes], pages: list[int], dst: HostPool, old: bool) -> None:
        n = len(keys)
        where = list(range(n - 1, -1, -1))  # host page of key i: n-1-i
        got = self.b.batch_get(keys, dst, where)
        bad = [i for i in range(got) if dst.page_bytes(where[i]) != self.src.page_bytes(pages[i])]
        with self._lock:
            r = self.report
            r.get_calls += 1
            r.get_pages += n
            r.got_pages += got
            r.short_old_reads += int(old and got < n)
            r.short_fresh_reads += int(not old and got < n)
            r.wrong_pages += [f"key {keys[i].hex()[:12]} (src page {pages[i]})" for i in bad]

    def _work(self, t: int) -> None:
        dst = make_pool(max(self.batch, len(self.old)), seed=None)
        stored: list[tuple[bytes, int]] = []  # fresh keys known stored, and their src page
        i = 0
        while not self._stop.is_set():
            try:
                fresh = page_keys(self.batch, f"{self._fresh_salt}/{t}/{i}")
                fpages = [(i * self.batch + j) % self.src.num_pages for j in range(self.batch)]
                n = self.b.batch_set(fresh, self.src, fpages)
                stored += list(zip(fresh[:n], fpages[:n], strict=True))
                with self._lock:
                    self.report.set_pages += self.batch
                    self.report.stored_pages += n
                    self.report.short_sets += int(n < self.batch)
                lo = (i * self.batch) % len(self.old)
                olds = (self.old + self.old)[lo : lo + self.batch]
                self._read(olds, [self._old_page[k] for k in olds], dst, old=True)
                if stored:
                    mine = stored[-self.batch :]
                    self._read([k for k, _ in mine], [p for _, p in mine], dst, old=False)
                self.b.batch_exists(self.old)
                with self._lock:
                    self.report.exists_calls += 1
            except Exception as e:  # the contract: nothing raises out of a backend
                with self._lock:
                    self.report.raised.append(f"{type(e).__name__}: {e}")
            i += 1
            with self._lock:
                self.rounds += 1
            time.sleep(0.001)  # while the breaker refuses at once, leave the CPU to the cluster
