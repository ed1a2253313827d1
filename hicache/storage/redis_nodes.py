"""Where a Redis L3 batch goes (:mod:`hicache.storage.redis_backend`): the store's nodes, one connection
per node call, and Cluster redirections.

A batch is a list of :class:`Item` (one page each). :meth:`RedisNodes.scatter` splits it per master (one
instance or a Sentinel's master: one part), runs a node call per part -- in parallel when there are
several, each on one connection borrowed from that node's redis-py pool -- and puts the per-page result
codes back in batch order.

Cluster redirections are followed within the call, page by page: a ``MOVED`` reply (the slot has a new
owner: a resharding, a failover) updates the slot map and the page is sent to the new owner; an ``ASK``
reply (the slot is being migrated) sends the page to the importing node once, preceded by ``ASKING``.
A page still redirected after ``MAX_REDIRECTS`` rounds fails the batch as a transient error (the caller
retries after :meth:`RedisNodes.refresh`). Redirections are counted in ``redirects`` (pages) and, as the
operation goes out again, in ``retries`` (rounds).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.cluster import ClusterNode, RedisCluster

from hicache.storage.resp import ReplyError, RespReader, pack

log = logging.getLogger(__name__)
T = TypeVar("T")

# Per-page result codes of a node call.
OK, MISS, CORRUPT, REDIRECT, NOSCRIPT, NEWER = 0, 1, 2, 3, 4, 5  # NEWER: a newer release's frame (a miss)
MAX_REDIRECTS = 5  # rounds of MOVED / ASK within one call before it fails as a transient error
TRANSIENT_REPLIES = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "MASTERDOWN", "READONLY", "BUSY")


def is_transient(e: BaseException) -> bool:
    """Errors worth a retry (and that mean the store, not the caller, is in trouble)."""
    if isinstance(e, ReplyError):
        return e.kind in TRANSIENT_REPLIES
    return isinstance(e, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                          redis.exceptions.RedisClusterException, ConnectionError, TimeoutError, OSError))


def redirection(e: BaseException | None) -> redis.exceptions.AskError | None:
    """The redirection in a ``MOVED`` (a :class:`~redis.exceptions.MovedError`) or ``ASK`` reply (an
    :class:`~redis.exceptions.AskError`); None for any other error."""
    if not isinstance(e, ReplyError):
        return None
    parts = str(e.args[0] if e.args else "").split(" ")
    if len(parts) == 3 and parts[0] in ("MOVED", "ASK"):
        cls = redis.exceptions.MovedError if parts[0] == "MOVED" else redis.exceptions.AskError
        try:
            return cls(f"{parts[1]} {parts[2]}")
        except ValueError:
            return None
    return None


def moved(e: BaseException | None) -> redis.exceptions.MovedError | None:
    """The redirection in a ``MOVED <slot> <host>:<port>`` reply, or None."""
    r = redirection(e)
    return r if isinstance(r, redis.exceptions.MovedError) else None


def as_reply(r: redis.exceptions.AskError) -> ReplyError:
    kind = "MOVED" if isinstance(r, redis.exceptions.MovedError) else "ASK"
    return ReplyError(f"{kind} {r.slot_id} {r.host}:{r.port}")


def raise_transient(errors: list[ReplyError]) -> None:
    for e in errors:
        if e.kind in TRANSIENT_REPLIES:
            raise e


def read_asking(rd: RespReader, errs: list[ReplyError]) -> None:
    """The ``+OK`` to the ``ASKING`` sent before a redirected command."""
    r = rd.read_reply_or_error()
    if isinstance(r, ReplyError):
        errs.append(r)


@dataclass
class Item:
    """One page of a batch, routed to a node."""

    pos: int  # index in the caller's batch
    rkey: bytes  # Redis key
    key: bytes  # page key
    page: int  # host page index (-1: none)
    redirect: redis.exceptions.AskError | None = None  # the last MOVED / ASK reply to this page
    damaged: tuple[int, bytes] | None = None  # a damaged value read here: (length, SHA1 hex), or (-1, b"")

    def redirected(self, e: BaseException) -> bool:
        """Is ``e`` a ``MOVED`` / ``ASK`` reply to this page? (Then it is noted here.)"""
        r = redirection(e)
        if r is None:
            return False
        self.redirect = r
        return True


NodeFn = Callable[[redis.Redis, list[Item], bool], list[int]]  # (client, pages, asking) -> codes


def on_conn(client: redis.Redis, fn: Callable[[Any, Any], T]) -> T:
    """Borrow a connection of ``client``'s pool (connected, TLS, AUTH and SELECT done by redis-py);
    ``fn(conn, sock)`` must read every reply it asked for. Any exception drops the connection (its reply
    stream is no longer in step)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    ok = False
    try:
        sock = getattr(conn, "_sock", None)
        if sock is None:
            conn.connect()
            sock = conn._sock
        res = fn(conn, sock)
        ok = True
        return res
    finally:
        if not ok:
            conn.disconnect()
        pool.release(conn)


class RedisNodes:
    """The nodes of one store: ``client`` (one instance or a Sentinel's master) or, when it is None, the
    Cluster that ``cluster_args`` describe (connected on first use). ``max_connections`` bounds the node
    calls in flight (a full pool would fail a call at once; waiting longer than ``timeout_s`` for a slot
    is a ``TimeoutError``). ``count(name, n)`` adds to the backend's ``extra`` counters. Thread-safe."""

    def __init__(self, client: redis.Redis | None, cluster_args: dict[str, Any] | None, max_connections: int,
                 timeout_s: float, count: Callable[[str, int], None]) -> None:
        self.client = client
        self._cluster_args = cluster_args or {}
        self._cluster: RedisCluster | None = None
        self._lock = threading.Lock()
        self._unlisted: dict[str, redis.Redis] = {}  # clients of nodes an ASK named that own no slot yet
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.BoundedSemaphore(max_connections)
        self._timeout_s = timeout_s
        self._count = count

    def cluster(self) -> RedisCluster:
        with self._lock:
            if self._cluster is None:
                self._cluster = RedisCluster(**self._cluster_args)
            return self._cluster

    def refresh(self, e: BaseException | None = None) -> None:
        """After an error on a Cluster: follow a ``MOVED`` reply, else re-read the slot map (best effort).

        A ``MOVED`` reply names the slot's new owner, which is authoritative at once; a full re-read
        asks one node, whose view of a slot that just moved may still be the old one."""
        self._count("retries", 1)
        if self._cluster is None:
            return
        m = moved(e)
        nm = self._cluster.nodes_manager
        if m is not None:
            node = nm.get_node(host=m.host, port=m.port)
            if node is not None and node.redis_connection is not None:
                nm.move_slot(m)
                return
        try:
            nm.initialize()
        except Exception as err:  # the cluster is (still) down; the next attempt decides
            log.debug("redis cluster: slot map refresh failed: %s", err)

    def masters(self) -> list[redis.Redis]:
        if self.client is not None:
            return [self.client]
        return [n.redis_connection for n in self.cluster().get_primaries() if n.redis_connection is not None]

    def ping(self) -> None:
        if self.client is not None:
            self.client.ping()
        else:
            self.cluster().ping(target_nodes=RedisCluster.PRIMARIES)

    # ------------------------------------------------------------------ routing
    def _route(self, items: list[Item]) -> list[tuple[redis.Redis, list[Item], bool]]:
        if self.client is not None:
            return [(self.client, items, False)]
        rc = self.cluster()
        groups: dict[str, tuple[redis.Redis, list[Item], bool]] = {}
        for it in items:
            node = rc.nodes_manager.get_node_from_slot(rc.keyslot(it.rkey))
            g = groups.get(node.name)
            if g is None:
                client = node.redis_connection
                if client is None:
                    raise redis.exceptions.ConnectionError(f"redis cluster: no connection to {node.name}")
                g = groups[node.name] = (client, [], False)
            g[1].append(it)
        return list(groups.values())

    def _redirect(self, items: list[Item]) -> list[tuple[redis.Redis, list[Item], bool]]:
        """Where the pages a node redirected go next: (client, pages, asking) per node. A ``MOVED`` moves
        the slot in the map; an ``ASK`` does not (it holds for this one command)."""
        first = items[0].redirect
        assert first is not None
        if self._cluster is None:  # one instance does not redirect: a node of a Cluster used as one
            raise as_reply(first)
        nm = self._cluster.nodes_manager
        groups: dict[tuple[str, bool], tuple[redis.Redis, list[Item], bool]] = {}
        for it in items:
            r = it.redirect
            assert r is not None
            asking = not isinstance(r, redis.exceptions.MovedError)
            if not asking:
                nm.move_slot(r)
            g = groups.get((f"{r.host}:{r.port}", asking))
            if g is None:
                g = groups[(f"{r.host}:{r.port}", asking)] = (self._node_client(r.host, r.port), [], asking)
            g[1].append(it)
        self._count("redirects", len(items))  # pages
        self._count("retries", 1)  # the operation went out again (to other nodes)
        return list(groups.values())

    def _node_client(self, host: str, port: int) -> redis.Redis:
        """The client of the Cluster node at ``host:port``, connecting to it first if need be. A node the
        slot map does not list (one that owns no slot yet, importing its first: a Cluster growing) gets
        a client of its own, kept until :meth:`close`."""
        assert self._cluster is not None
        nm = self._cluster.nodes_manager
        with self._lock:
            node = nm.get_node(host=host, port=port)
            if node is None:
                client = self._unlisted.get(f"{host}:{port}")
                if client is not None:
                    return client
                node = ClusterNode(host, port)
            if node.redis_connection is None:
                nm.create_redis_connections([node])
            assert node.redis_connection is not None
            if nm.get_node(host=host, port=port) is not node:
                self._unlisted[f"{host}:{port}"] = node.redis_connection
            return node.redis_connection

    def scatter(self, items: list[Item], node_fn: NodeFn) -> list[int]:
        """Run ``node_fn`` per node, then again for the pages a node redirected on the nodes named;
        result codes by batch position."""
        out = [MISS] * len(items)
        groups = self._route(items)
        for _ in range(MAX_REDIRECTS + 1):
            self._scatter_once(groups, node_fn, out)
            again = [it for _, its, _ in groups for it in its if out[it.pos] == REDIRECT]
            if not again:
                return out
            groups = self._redirect(again)
        r = again[0].redirect
        assert r is not None
        raise as_reply(r)  # transient: retried after a refresh

    def _scatter_once(self, groups: list[tuple[redis.Redis, list[Item], bool]], node_fn: NodeFn,
                      out: list[int]) -> None:
        def fn(client: redis.Redis, its: list[Item], asking: bool) -> list[int]:
            if not self._slots.acquire(timeout=self._timeout_s):  # every connection busy for a timeout
                raise TimeoutError("redis: no free connection")
            try:
                return node_fn(client, its, asking)
            finally:
                self._slots.release()

        if len(groups) == 1:
            client, its, asking = groups[0]
            for it, r in zip(its, fn(client, its, asking), strict=True):
                out[it.pos] = r
            return
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="hicache-redis-node")
        futs = [(its, self._pool.submit(fn, client, its, asking)) for client, its, asking in groups]
        err: BaseException | None = None
        for its, f in futs:
            try:
                for it, r in zip(its, f.result(), strict=True):
                    out[it.pos] = r
            except Exception as e:
                err = err or e
        if err is not None:
            raise err

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        try:
            if self.client is not None:
                self.client.close()
                self.client.connection_pool.disconnect()
            if self._cluster is not None:
                self._cluster.close()
            for c in self._unlisted.values():
                c.close()
                c.connection_pool.disconnect()
        except Exception as e:  # closing a dead connection
            log.debug("redis close: %s", e)


def int_replies(args: Callable[[Item], tuple[bytes, ...]]) -> NodeFn:
    """A node call sending the command ``args(page)`` per page, pipelined, and reading one integer reply
    each (``REDIRECT`` for a page redirected, ``NOSCRIPT`` for an ``EVALSHA`` the node has no script for);
    any other error reply raises."""
    def node(client: redis.Redis, its: list[Item], asking: bool) -> list[int]:
        ask = pack(b"ASKING") if asking else b""

        def io(conn: Any, sock: Any) -> list[int]:
            conn.send_packed_command([b"".join(ask + pack(*args(it)) for it in its)], check_health=False)
            rd = RespReader(sock)
            out: list[int] = []
            errs: list[ReplyError] = []
            for it in its:
                if asking:
                    read_asking(rd, errs)
                try:
                    out.append(rd.read_int())
                except ReplyError as e:
                    if it.redirected(e):
                        out.append(REDIRECT)
                    elif e.kind == "NOSCRIPT":  # the node has no script of that SHA1 cached
                        out.append(NOSCRIPT)
                    else:
                        out.append(MISS)
                        errs.append(e)
            if rd.buffered:
                raise ConnectionError("redis: unexpected extra reply bytes")
            raise_transient(errs)
            if errs:
                raise errs[0]
            return out

        return on_conn(client, io)

    return node
