"""Redis L3 backend: one instance, Sentinel or Cluster; TLS and AUTH/ACL from the URL.

URLs::

    redis://[user[:password]@]host[:port][/db][?option=value&...]
    rediss://...                                                     (TLS)
    redis+sentinel://[user[:password]@]host:port[,host:port...]/service[/db][?...]
    rediss+sentinel://...
    redis+cluster://[user[:password]@]host:port[,host:port...][/][?...]
    rediss+cluster://...

Options (URL query or keyword arguments, keywords win): ``prefix`` (key prefix, default ``"hicache:"``),
``ttl_s`` (expire pages; 0 = never), ``touch_on_read`` (reads push the TTL out, default true),
``timeout_s`` (per socket operation), ``connect_timeout_s``, ``max_connections`` (a node's pool, and
the backend's limit on operations in flight),
``retry_attempts`` / ``retry_base_s`` / ``retry_max_s`` (transient errors), ``breaker_base_s`` /
``breaker_max_s`` (how long a store that failed is left alone before a probe), ``delete_corrupt``
(drop a page that failed verification, default true), ``wire`` (``raw``: the zero-copy path of
:mod:`hicache.storage.resp`, the default; ``pipeline``: plain redis-py pipelines), ``sentinel_password``,
``hash_threads`` (frame checksums run there, overlapped with the socket; writes hash on a pool of
half as many lower-priority background threads: ``write_nice``, default 10, 0 = off), ``ssl_ca_certs``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` (:class:`~hicache.storage.redis_options.RedisOptions`;
:mod:`hicache.storage.redis_options` also turns the URL into a client).

Storage layout: one string value per page, ``<prefix>{<page key hex>}`` -> frame (see
:mod:`hicache.storage.frame`). The braces are a Cluster hash tag over the page key alone, so the pages of
one request hash to different slots and spread over every master; a batch is split per master and the
parts run in parallel, each one pipelined on one connection.

Reads land straight in the host pages and are verified there; only pages ``0..n-1`` of a ``batch_get``
that returned ``n`` hold valid data (later pages may have been overwritten with rejected bytes). A value
that cannot be one of our pages (a string of the wrong size, a value of another type) is a damaged page,
like a frame that fails verification.

Damaged pages are counted (``corrupt_pages``) and, with ``delete_corrupt``, deleted (not a frame of a newer
release's format: a miss left in place, :class:`~hicache.storage.frame.NewerFormat`) -- but only the
damaged value that was read: several nodes share the store, and one of them may have written a good copy
of the page under the same key since. The delete is a small Lua script, atomic on the server, one key
per call (``EVALSHA``, sent again as ``EVAL`` where a node answers ``NOSCRIPT``): a string is deleted
only if its length and SHA1 are still those of the value read; a value of another type only while the
key still holds something other than a string. Anything else there (a good rewrite, other damage) is
left alone. ``extra["corrupt_deleted"]`` counts the values actually deleted. A store that refuses
scripts (an ACL without ``@scripting``, ``EVAL`` renamed away: managed services often do) gets the same
conditional delete as an optimistic transaction instead, one key at a time: ``WATCH`` the key, read it,
compare, then ``MULTI`` / ``DEL`` / ``EXEC``, which the server refuses if the key changed after the
``WATCH``. The first refusal is logged once; the backend then goes straight to transactions.

Failure model: every operation is retried on transient errors (connection, timeout, waiting longer than
``timeout_s`` for a connection, MOVED / LOADING / ...) with backoff; when it still fails the error is
counted, the operation reports a miss / nothing stored, and a circuit breaker keeps later operations off
the store until a call succeeds (:mod:`hicache.storage.retry`). Other errors are counted and reported
the same way but leave the breaker closed. Nothing raises into the caller. Connections are
re-established by themselves when the store returns; a Cluster's slot map is refreshed after errors.

Cluster redirections are followed within the call, page by page: a ``MOVED`` reply (the slot has a new
owner: a resharding, a failover) updates the slot map and the page is sent to the new owner; an ``ASK``
reply (the slot is being migrated and the page is, or will be, on the importing node) sends the page
there once, preceded by ``ASKING``. Each page keeps its place in the batch and its host page; a page
still redirected after a few rounds fails the batch like any transient error (retried after a refresh of
the slot map). A redirection is not an error: it is counted in ``extra["redirects"]`` (pages) and, as
the operation goes out again, in ``extra["retries"]`` (once per round).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlparse

import redis
from redis.cluster import ClusterNode, RedisCluster

from hicache.pool import HostPool
from hicache.storage.base import StorageBackend, StorageContext, register_backend
from hicache.storage.frame import (
    HEADER_BYTES,
    FrameError,
    NewerFormat,
    PageBuf,
    encode_header,
    newer_format,
    page_len,
    page_parts,
    unpack_page,
)
from hicache.storage.pageio import PageBuffers, page_buffers
from hicache.storage.redis_options import RedisOptions, connect
from hicache.storage.resp import ReplyError, RespReader, bulk_head, pack
from hicache.storage.retry import CircuitBreaker, RetryPolicy, call_with_retry
from hicache.storage.threads import io_pool

log = logging.getLogger(__name__)
T = TypeVar("T")

OK, MISS, CORRUPT, REDIRECT, NOSCRIPT, NEWER = 0, 1, 2, 3, 4, 5  # NEWER: a newer release's frame (a miss)
_MAX_REDIRECTS = 5  # rounds of MOVED / ASK within one call before it fails as a transient error
_TRANSIENT_REPLIES = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "MASTERDOWN", "READONLY", "BUSY")
# What redis-py (the ``pipeline`` wire) makes of those replies: MovedError is an AskError,
# MasterDownError a ClusterDownError, BusyLoadingError a ConnectionError.
_TRANSIENT_CLASSES = (redis.exceptions.AskError, redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
                      redis.exceptions.ReadOnlyError)


def is_transient(e: BaseException) -> bool:
    """Errors worth a retry (and that mean the store, not the caller, is in trouble)."""
    if isinstance(e, ReplyError):
        return e.kind in _TRANSIENT_REPLIES
    if isinstance(e, _TRANSIENT_CLASSES):  # redis-py drops the reply's first word from these
        return True
    if isinstance(e, redis.exceptions.ResponseError):
        return str(e).split(" ", 1)[0] in _TRANSIENT_REPLIES
    return isinstance(e, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                          redis.exceptions.RedisClusterException, ConnectionError, TimeoutError, OSError))


def _moved(e: BaseException | None) -> redis.exceptions.MovedError | None:
    """The redirection in a ``MOVED <slot> <host>:<port>`` reply, or None."""
    if isinstance(e, redis.exceptions.MovedError):
        return e
    if isinstance(e, (ReplyError, redis.exceptions.ResponseError)):
        parts = str(e.args[0] if e.args else "").split(" ")
        if len(parts) == 3 and parts[0] == "MOVED":
            try:
                return redis.exceptions.MovedError(f"{parts[1]} {parts[2]}")
            except ValueError:
                return None
    return None


def _redirection(e: BaseException) -> redis.exceptions.AskError | None:
    """The redirection in a ``MOVED`` (a :class:`~redis.exceptions.MovedError`) or ``ASK`` reply
    (an :class:`~redis.exceptions.AskError`), ours or redis-py's; None for any other error."""
    if isinstance(e, redis.exceptions.AskError):  # MovedError is one too
        return e
    if isinstance(e, ReplyError):
        parts = str(e.args[0] if e.args else "").split(" ")
        if len(parts) == 3 and parts[0] in ("MOVED", "ASK"):
            cls = redis.exceptions.MovedError if parts[0] == "MOVED" else redis.exceptions.AskError
            try:
                return cls(f"{parts[1]} {parts[2]}")
            except ValueError:
                return None
    return None


def _as_reply(r: redis.exceptions.AskError) -> ReplyError:
    kind = "MOVED" if isinstance(r, redis.exceptions.MovedError) else "ASK"
    return ReplyError(f"{kind} {r.slot_id} {r.host}:{r.port}")


def _wrong_type(e: BaseException) -> bool:
    """A ``WRONGTYPE`` reply to a page's GET: the key holds a value of another type (a list, a hash...),
    i.e. not one of our pages -- damaged or foreign, like a string of the wrong size."""
    if isinstance(e, ReplyError):
        return e.kind == "WRONGTYPE"
    return isinstance(e, redis.exceptions.ResponseError) and str(e).startswith("WRONGTYPE")


# Deletes KEYS[1] only if it still holds the damaged value read there: ARGV[1] its length and ARGV[2] its
# SHA1 (hex) for a string; ARGV[1] == "-1" for a value of another type (deleted while it is not a string).
# Returns how many keys it deleted (0 or 1).
_DELETE_DAMAGED = b"""\
local t = redis.call('TYPE', KEYS[1])['ok']
if ARGV[1] == '-1' then
  if t == 'none' or t == 'string' then return 0 end
  return redis.call('DEL', KEYS[1])
end
if t ~= 'string' or redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return 0 end
if redis.sha1hex(redis.call('GET', KEYS[1])) ~= ARGV[2] then return 0 end
return redis.call('DEL', KEYS[1])
"""
_DELETE_DAMAGED_SHA = hashlib.sha1(_DELETE_DAMAGED).hexdigest().encode()
_OTHER_TYPE: tuple[int, bytes] = (-1, b"")  # what was read: a value of another type than a string


def _fingerprint(*parts: bytes | bytearray | memoryview) -> tuple[int, bytes]:
    """(length, SHA1 hex) of a damaged value as read: what the conditional delete compares."""
    h = hashlib.sha1(usedforsecurity=False)
    for p in parts:
        h.update(p)
    return sum(len(p) for p in parts), h.hexdigest().encode()


def _skip_fingerprint(rd: RespReader, n: int, head: bytes | bytearray = b"") -> tuple[int, bytes]:
    """Consume a bulk string's ``n`` bytes and its CRLF, returning their :func:`_fingerprint` (``head``: the
    value's first bytes, consumed already)."""
    h = hashlib.sha1(usedforsecurity=False)
    h.update(head)
    total = n + len(head)
    buf = memoryview(bytearray(max(1, min(n, 1 << 20))))
    left = n
    while left:
        k = min(left, len(buf))
        rd.readinto(buf[:k])
        h.update(buf[:k])
        left -= k
    rd.expect_crlf()
    return total, h.hexdigest().encode()


def _scripts_refused(e: BaseException) -> bool:
    """The store refuses Lua scripts: ``NOPERM`` (an ACL without ``@scripting``) or an unknown ``EVAL``
    / ``EVALSHA`` (renamed away)."""
    if isinstance(e, ReplyError):
        kind, text = e.kind, str(e)
    elif isinstance(e, redis.exceptions.ResponseError):
        text = str(e)
        kind = "NOPERM" if isinstance(e, redis.exceptions.NoPermissionError) else text.split(" ", 1)[0]
    else:
        return False
    low = text.lower()  # (a NOPERM for keys or other commands is no refusal of scripts)
    return (kind == "NOPERM" or "unknown command" in low) and "eval" in low


def _noscript(e: BaseException) -> bool:
    """A ``NOSCRIPT`` reply: the node has no script of that SHA1 cached (an ``EVAL`` caches it)."""
    if isinstance(e, ReplyError):
        return e.kind == "NOSCRIPT"
    return isinstance(e, redis.exceptions.NoScriptError)


Frame = tuple[bytes, PageBuf]  # a page's frame: header, payload as stored (contiguous or in pieces)


@dataclass
class _Item:
    """One page of a batch, routed to a node."""

    pos: int  # index in the caller's batch
    rkey: bytes  # Redis key
    key: bytes  # page key
    page: int  # host page index
    redirect: redis.exceptions.AskError | None = None  # the last MOVED / ASK reply to this page
    damaged: tuple[int, bytes] | None = None  # a damaged value read here: its _fingerprint, or _OTHER_TYPE


_NodeFn = Callable[[redis.Redis, list[_Item], bool], list[int]]  # one node's part of a batch -> codes


@register_backend("redis", "rediss", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster")
class RedisBackend(StorageBackend):
    """See the module docstring. Thread-safe; construction never connects (a down store is not an error)."""

    scheme = "redis"

    def __init__(self, url: str, ctx: StorageContext, **options: Any) -> None:
        super().__init__(url, ctx, **options)
        u = urlparse(url)
        self.scheme = u.scheme
        query = dict(parse_qsl(u.query))
        self.opts, rest = RedisOptions.parse(query, options)
        o = self.opts
        self._prefix = o.prefix.encode()
        self._page_bytes = ctx.layout.bytes_per_page
        self._frame_bytes = HEADER_BYTES + self._page_bytes
        self._retry = RetryPolicy(o.retry_attempts, o.retry_base_s, o.retry_max_s)
        self._breaker = CircuitBreaker(o.breaker_base_s, o.breaker_max_s)
        self._cluster: RedisCluster | None = None
        self._cluster_lock = threading.Lock()
        self._unlisted: dict[str, redis.Redis] = {}  # clients of nodes an ASK named that own no slot yet
        self._nodes_pool: ThreadPoolExecutor | None = None
        # Operations in flight hold one connection each: never more than a pool allows (a full pool would
        # fail an operation at once). One limit for the whole backend; waiting longer than timeout_s for a
        # slot is a transient failure like a timeout.
        self._slots = threading.BoundedSemaphore(o.max_connections)
        hash_threads = o.hash_threads or min(8, max(2, os.cpu_count() or 2))
        self._hasher = io_pool(hash_threads, "hicache-redis-hash")  # reads: verification on a request's path
        self._write_hasher = io_pool(max(1, hash_threads // 2), "hicache-redis-write-hash", o.write_nice)
        self._group = max(1, (1 << 20) // self._page_bytes)  # pages per hashing task
        self._no_scripts = False  # the store refused scripts once: conditional deletes use transactions
        self._client, cluster_args = connect(u, o, rest)
        self._cluster_args = cluster_args or {}

    # ------------------------------------------------------------------ keys and routing
    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a page: ``<prefix>{<hex>}`` (the braces are the Cluster hash tag)."""
        return b"%s{%s}" % (self._prefix, key.hex().encode())

    def _get_cluster(self) -> RedisCluster:
        with self._cluster_lock:
            if self._cluster is None:
                self._cluster = RedisCluster(**self._cluster_args)
            return self._cluster

    def _refresh(self, e: BaseException | None = None) -> None:
        """After an error on a Cluster: follow a ``MOVED`` reply, else re-read the slot map (best effort).

        A ``MOVED`` reply names the slot's new owner, which is authoritative at once; a full re-read
        asks one node, whose view of a slot that just moved may still be the old one.
        """
        self._count_extra("retries")
        if self._cluster is None:
            return
        moved = _moved(e)
        nm = self._cluster.nodes_manager
        if moved is not None:
            node = nm.get_node(host=moved.host, port=moved.port)
            if node is not None and node.redis_connection is not None:
                nm.move_slot(moved)
                return
        try:
            nm.initialize()
        except Exception as err:  # the cluster is (still) down; the next attempt decides
            log.debug("redis cluster: slot map refresh failed: %s", err)

    def _route(self, items: list[_Item]) -> list[tuple[redis.Redis, list[_Item]]]:
        if self._client is not None:
            return [(self._client, items)]
        rc = self._get_cluster()
        groups: dict[str, tuple[redis.Redis, list[_Item]]] = {}
        for it in items:
            node = rc.nodes_manager.get_node_from_slot(rc.keyslot(it.rkey))
            g = groups.get(node.name)
            if g is None:
                client = node.redis_connection
                if client is None:
                    raise redis.exceptions.ConnectionError(f"redis cluster: no connection to {node.name}")
                g = groups[node.name] = (client, [])
            g[1].append(it)
        return list(groups.values())

    def _redirect(self, items: list[_Item]) -> list[tuple[redis.Redis, list[_Item], bool]]:
        """Where the pages a node redirected go next: (client, pages, asking) per node. A ``MOVED`` moves
        the slot in the map; an ``ASK`` does not (it holds for this one command)."""
        first = items[0].redirect
        assert first is not None
        if self._cluster is None:  # one instance does not redirect: a node of a Cluster used as one
            raise _as_reply(first)
        nm = self._cluster.nodes_manager
        groups: dict[tuple[str, bool], tuple[redis.Redis, list[_Item], bool]] = {}
        for it in items:
            r = it.redirect
            assert r is not None
            asking = not isinstance(r, redis.exceptions.MovedError)
            if not asking:
                nm.move_slot(r)
            name = f"{r.host}:{r.port}"
            g = groups.get((name, asking))
            if g is None:
                g = groups[(name, asking)] = (self._node_client(r.host, r.port), [], asking)
            g[1].append(it)
        self._count_extra("redirects", len(items))  # pages
        self._count_extra("retries")  # the operation went out again (to other nodes)
        return list(groups.values())

    def _node_client(self, host: str, port: int) -> redis.Redis:
        """The client of the Cluster node at ``host:port``, connecting to it first if need be. A node the
        slot map does not list (one that owns no slot yet, importing its first: a Cluster growing) gets
        a client of its own, kept until :meth:`close`."""
        assert self._cluster is not None
        nm = self._cluster.nodes_manager
        with self._cluster_lock:
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

    def _scatter(self, items: list[_Item], node_fn: Callable[[redis.Redis, list[_Item], bool], list[int]]) -> list[int]:
        """Run ``node_fn`` per node (in parallel when there are several), then again for the pages a node
        redirected (``MOVED`` / ``ASK``) on the nodes named; results by batch position."""
        out = [MISS] * len(items)
        groups = [(client, its, False) for client, its in self._route(items)]
        for _ in range(_MAX_REDIRECTS + 1):
            self._scatter_once(groups, node_fn, out)
            again = [it for _, its, _ in groups for it in its if out[it.pos] == REDIRECT]
            if not again:
                return out
            groups = self._redirect(again)
        r = again[0].redirect
        assert r is not None
        raise _as_reply(r)  # transient: retried after a refresh

    def _scatter_once(self, groups: list[tuple[redis.Redis, list[_Item], bool]],
                      node_fn: Callable[[redis.Redis, list[_Item], bool], list[int]], out: list[int]) -> None:
        def fn(client: redis.Redis, its: list[_Item], asking: bool) -> list[int]:
            if not self._slots.acquire(timeout=self.opts.timeout_s):  # every connection busy for a timeout
                raise TimeoutError("redis: no free connection")
            try:
                return node_fn(client, its, asking)  # one connection per node call
            finally:
                self._slots.release()

        if len(groups) == 1:
            client, its, asking = groups[0]
            for it, r in zip(its, fn(client, its, asking), strict=True):
                out[it.pos] = r
            return
        if self._nodes_pool is None:
            with self._cluster_lock:
                if self._nodes_pool is None:
                    self._nodes_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="hicache-redis-node")
        futs = [(its, self._nodes_pool.submit(fn, client, its, asking)) for client, its, asking in groups]
        err: BaseException | None = None
        for its, f in futs:
            try:
                for it, r in zip(its, f.result(), strict=True):
                    out[it.pos] = r
            except Exception as e:
                err = err or e
        if err is not None:
            raise err

    def _run(self, items: list[_Item],
             fn: Callable[[redis.Redis, list[_Item], bool], list[int]]) -> list[int] | None:
        """One batched operation with retries and the breaker; None when the store failed."""
        if not items:
            return []
        if not self._breaker.allow():
            self._count(errors=1)
            self._count_extra("breaker_skips")
            return None
        try:
            res = call_with_retry(lambda: self._scatter(items, fn), self._retry, is_transient, self._refresh)
        except Exception as e:
            self._count(errors=1)
            if is_transient(e):
                self._breaker.failure()
                log.warning("redis %s: store unavailable (%s); L3 paused", self.url_safe, e)
            else:
                self._breaker.success()
                log.warning("redis %s: operation failed: %r", self.url_safe, e)
            return None
        self._breaker.success()
        return res

    def probe(self) -> str | None:
        """PING every node the store has (one instance, the Sentinel's master, or each Cluster master)."""
        try:
            if self._client is not None:
                self._client.ping()
            else:
                self._get_cluster().ping(target_nodes=RedisCluster.PRIMARIES)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    def _count_extra(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats.extra[name] = self._stats.extra.get(name, 0) + n

    def _items(self, keys: Sequence[bytes], pages: Sequence[int] | None = None) -> list[_Item]:
        return [_Item(i, self.redis_key(k), k, int(pages[i]) if pages is not None else -1)
                for i, k in enumerate(keys)]

    # ------------------------------------------------------------------ connection plumbing
    def _on_conn(self, client: redis.Redis, fn: Callable[[Any, Any], list[int]]) -> list[int]:
        """Borrow a connection; ``fn(conn, sock)`` must read every reply it asked for. Any exception
        drops the connection (its reply stream is no longer in step)."""
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

    @staticmethod
    def _raise_transient(errors: list[ReplyError]) -> None:
        for e in errors:
            if e.kind in _TRANSIENT_REPLIES:
                raise e

    @staticmethod
    def _redirected(it: _Item, e: BaseException) -> bool:
        """Is ``e`` a ``MOVED`` / ``ASK`` reply to page ``it``? (Then it is noted on the page.)"""
        r = _redirection(e)
        if r is None:
            return False
        it.redirect = r
        return True

    @staticmethod
    def _read_asking(rd: RespReader, errs: list[ReplyError]) -> None:
        """The ``+OK`` to the ``ASKING`` sent before a redirected command."""
        r = rd.read_reply_or_error()
        if isinstance(r, ReplyError):
            errs.append(r)

    @staticmethod
    def _drop_asking(res: list[Any], asking: bool) -> list[Any]:
        """A pipeline's replies without those to the ``ASKING`` commands before each command."""
        if not asking:
            return res
        for r in res[0::2]:
            if isinstance(r, Exception):
                raise r
        return res[1::2]

    # ------------------------------------------------------------------ exists / delete
    def _ints(self, args: Callable[[_Item], tuple[bytes, ...]]) -> _NodeFn:
        """A node call sending ``args(page)`` per page and reading one integer reply each (``REDIRECT``
        for a page redirected, ``NOSCRIPT`` for an ``EVALSHA`` the node has no script for)."""
        def node(client: redis.Redis, its: list[_Item], asking: bool) -> list[int]:
            if self.opts.wire == "pipeline":
                p = client.pipeline(transaction=False)
                for it in its:
                    if asking:
                        p.execute_command("ASKING")
                    p.execute_command(*args(it))
                res = self._drop_asking(p.execute(raise_on_error=False), asking)
                out = []
                for it, r in zip(its, res, strict=True):
                    if isinstance(r, Exception):
                        if self._redirected(it, r):
                            out.append(REDIRECT)
                        elif _noscript(r):
                            out.append(NOSCRIPT)
                        else:
                            raise r
                    else:
                        out.append(int(r))
                return out

            ask = pack(b"ASKING") if asking else b""

            def io(conn: Any, sock: Any) -> list[int]:
                conn.send_packed_command([b"".join(ask + pack(*args(it)) for it in its)], check_health=False)
                rd = RespReader(sock)
                out: list[int] = []
                errs: list[ReplyError] = []
                for it in its:
                    if asking:
                        self._read_asking(rd, errs)
                    try:
                        out.append(rd.read_int())
                    except ReplyError as e:
                        if self._redirected(it, e):
                            out.append(REDIRECT)
                        elif _noscript(e):
                            out.append(NOSCRIPT)
                        else:
                            out.append(MISS)
                            errs.append(e)
                if rd.buffered:
                    raise ConnectionError("redis: unexpected extra reply bytes")
                self._raise_transient(errs)
                if errs:
                    raise errs[0]
                return out

            return self._on_conn(client, io)

        return node

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        res = self._run(self._items(keys), self._ints(lambda it: (b"EXISTS", it.rkey)))
        if res is None:
            return 0
        n = 0
        for r in res:
            if r <= 0:
                break
            n += 1
        return n

    def delete(self, keys: Sequence[bytes]) -> int:
        res = self._run(self._items(keys), self._ints(lambda it: (b"DEL", it.rkey)))
        return 0 if res is None else sum(res)

    def _delete_damaged(self, damaged: list[_Item]) -> int:
        """Delete each page's key only if it still holds the damaged value read there (``it.damaged``):
        one atomic script call per key (see ``_DELETE_DAMAGED``). Returns how many were deleted."""
        items = [_Item(i, it.rkey, it.key, -1, damaged=it.damaged) for i, it in enumerate(damaged)]

        def args(cmd: bytes, script: bytes) -> Callable[[_Item], tuple[bytes, ...]]:
            def one(it: _Item) -> tuple[bytes, ...]:
                assert it.damaged is not None
                return cmd, script, b"1", it.rkey, str(it.damaged[0]).encode(), it.damaged[1]
            return one

        evalsha = self._ints(args(b"EVALSHA", _DELETE_DAMAGED_SHA))
        eval_ = self._ints(args(b"EVAL", _DELETE_DAMAGED))

        def refused(e: BaseException) -> bool:
            if not _scripts_refused(e):
                return False
            if not self._no_scripts:
                self._no_scripts = True
                log.warning("redis: the store refuses scripts (%s); damaged pages are deleted through WATCH / "
                            "MULTI instead", e)
            return True

        def transactions(client: redis.Redis, its: list[_Item], asking: bool) -> list[int]:
            if asking:  # a slot migrating (a transaction would need ASKING before each command): the key
                return [0] * len(its)  # is left for a later read to find again
            return [self._watch_delete(client, it) for it in its]

        def node(client: redis.Redis, its: list[_Item], asking: bool) -> list[int]:
            if self._no_scripts:
                return transactions(client, its, asking)
            try:
                out = evalsha(client, its, asking)
            except (ReplyError, redis.exceptions.ResponseError) as e:
                if not refused(e):
                    raise
                return transactions(client, its, asking)
            again = [j for j, r in enumerate(out) if r == NOSCRIPT]
            if again:  # the node has not cached the script (restarted, flushed, new): EVAL caches it
                rest = [its[j] for j in again]
                try:
                    res = eval_(client, rest, asking)
                except (ReplyError, redis.exceptions.ResponseError) as e:
                    if not refused(e):
                        raise
                    res = transactions(client, rest, asking)  # (what EVALSHA deleted stays counted)
                for j, r in zip(again, res, strict=True):
                    out[j] = r
            return out

        res = self._run(items, node)
        n = 0 if res is None else sum(r == 1 for r in res)
        self._count_extra("corrupt_deleted", n)
        return n

    @staticmethod
    def _watch_delete(client: redis.Redis, it: _Item) -> int:
        """``_DELETE_DAMAGED`` as an optimistic transaction, for a store without scripts: 1 when the key
        still held the damaged value read (``it.damaged``) and was deleted, else 0 (a value written since
        is left alone, also one written between the check and the delete: ``EXEC`` then fails)."""
        with client.pipeline(transaction=True) as p:
            try:
                p.watch(it.rkey)
                if it.damaged == _OTHER_TYPE:  # deleted only while it still holds a value of another type
                    kind = p.type(it.rkey)
                    same = kind not in (b"none", b"string", "none", "string")
                else:
                    try:
                        value = p.get(it.rkey)
                    except redis.exceptions.ResponseError:  # WRONGTYPE: something else now
                        value = None
                    same = isinstance(value, bytes) and _fingerprint(value) == it.damaged
                if not same:
                    p.unwatch()
                    return 0
                p.multi()
                p.delete(it.rkey)
                return int(p.execute()[0])
            except redis.exceptions.WatchError:  # written meanwhile: not the value read
                return 0
            except redis.exceptions.ResponseError as e:  # MOVED (resharded since the read) and the like
                log.debug("redis: conditional delete of %r skipped: %s", it.rkey, e)
                return 0

    # ------------------------------------------------------------------ set
    def _set_suffix(self) -> bytes:
        if self.opts.ttl_s > 0:
            ms = str(max(1, int(self.opts.ttl_s * 1000))).encode()
            return b"\r\n" + pack(b"PX", ms)[4:]  # "$2\r\nPX\r\n$n\r\nms\r\n" (drop the "*2\r\n")
        return b"\r\n"

    def _frames(self, pages: list[PageBuf], keys: list[bytes]) -> list[Frame]:
        return [self.pack(p, k) for p, k in zip(pages, keys, strict=True)]

    def _hash_ahead(self, pages: list[PageBuf], keys: list[bytes]) -> list[tuple[Future[list[Frame]], int]]:
        """Frames (header, stored payload) made on the hash threads, ahead of the socket (xxhash and the
        codecs release the GIL for large inputs), in groups of about 1 MiB; returns (future, index in its
        group) per page."""
        out: list[tuple[Future[list[Frame]], int]] = []
        for lo in range(0, len(pages), self._group):
            hi = min(lo + self._group, len(pages))
            f = self._write_hasher.submit(self._frames, pages[lo:hi], keys[lo:hi])
            out.extend((f, i - lo) for i in range(lo, hi))
        return out

    def _verify_group(self, group: list[tuple[int, bytes, PageBuf, bytes]]) -> list[tuple[int, int]]:
        return [(j, OK if self._verify(h, dst, key) else NEWER if newer_format(h) else CORRUPT)
                for j, h, dst, key in group]

    def _unpack(self, blob: bytes | bytearray, key: bytes, dst: PageBuf) -> int:
        """Verify a frame and decode it into ``dst``: ``OK``, ``CORRUPT``, or ``NEWER`` (a format of a newer
        release: a miss, not damage)."""
        try:
            unpack_page(blob, self.ctx.namespace_digest, key, dst)
        except NewerFormat:
            return NEWER
        except FrameError:
            return CORRUPT
        return OK

    def _unpack_group(self, group: list[tuple[int, bytearray, PageBuf, bytes]]) -> list[tuple[int, int]]:
        return [(j, self._unpack(blob, key, dst)) for j, blob, dst, key in group]

    def batch_set(self, keys: Sequence[bytes], host_pool: HostPool | PageBuffers, host_indices: Sequence[int]) -> int:
        self._check_lengths(keys, host_indices)
        items = self._items(keys, host_indices)
        suffix = self._set_suffix()
        nargs = b"*5\r\n" if self.opts.ttl_s > 0 else b"*3\r\n"

        pio = page_buffers(host_pool)
        stored = [0] * len(keys)  # payload bytes as written, by batch position

        def node(client: redis.Redis, its: list[_Item], asking: bool) -> list[int]:
            heads = self._hash_ahead([pio.source(it.page) for it in its], [it.key for it in its])
            if self.opts.wire == "pipeline":
                p = client.pipeline(transaction=False)
                for it, h in zip(its, heads, strict=True):
                    hd, pl = h[0].result()[h[1]]
                    stored[it.pos] = page_len(pl)
                    val = b"".join((hd, *page_parts(pl)))
                    if asking:
                        p.execute_command("ASKING")
                    if self.opts.ttl_s > 0:
                        p.set(it.rkey, val, px=max(1, int(self.opts.ttl_s * 1000)))
                    else:
                        p.set(it.rkey, val)
                res = self._drop_asking(p.execute(raise_on_error=False), asking)
                out = []
                for it, r in zip(its, res, strict=True):
                    if not isinstance(r, Exception):
                        out.append(OK)
                    elif self._redirected(it, r):
                        out.append(REDIRECT)
                    elif is_transient(r):
                        raise r
                    else:
                        out.append(MISS)
                return out

            ask = pack(b"ASKING") if asking else b""

            def io(conn: Any, sock: Any) -> list[int]:
                lead = b""
                for it, h in zip(its, heads, strict=True):
                    hd, pl = h[0].result()[h[1]]
                    size = stored[it.pos] = page_len(pl)
                    head = b"".join((lead, ask, nargs, b"$3\r\nSET\r\n", bulk_head(len(it.rkey)), it.rkey,
                                     b"\r\n", bulk_head(size + HEADER_BYTES), hd))
                    conn.send_packed_command([head, *page_parts(pl)], check_health=False)
                    lead = suffix
                conn.send_packed_command([suffix], check_health=False)
                rd = RespReader(sock)
                errs: list[ReplyError] = []
                out: list[int] = []
                for it in its:
                    if asking:
                        self._read_asking(rd, errs)
                    r = rd.read_reply_or_error()
                    if not isinstance(r, ReplyError):
                        out.append(OK)
                    elif self._redirected(it, r):
                        out.append(REDIRECT)
                    else:
                        out.append(MISS)
                        errs.append(r)
                if rd.buffered:
                    raise ConnectionError("redis: unexpected extra reply bytes")
                self._raise_transient(errs)
                if errs:
                    log.warning("redis set: %s", errs[0])
                return out

            return self._on_conn(client, io)

        res = self._run(items, node)
        if res is None:
            return 0
        n = 0
        for r in res:
            if r != OK:
                break
            n += 1
        if n < len(res):
            self._count(errors=1)
        self._count(sets=n, bytes_written=n * self._page_bytes, stored_bytes_written=sum(stored[:n]))
        return n

    # ------------------------------------------------------------------ get
    def _verify(self, header: bytes, payload: PageBuf, key: bytes) -> bool:
        return encode_header(payload, self.ctx.namespace_digest, key) == header

    def batch_get(self, keys: Sequence[bytes], host_pool: HostPool | PageBuffers, host_indices: Sequence[int]) -> int:
        self._check_lengths(keys, host_indices)
        items = self._items(keys, host_indices)
        pio = page_buffers(host_pool)
        ttl_ms = str(max(1, int(self.opts.ttl_s * 1000))).encode() if self.opts.ttl_s > 0 else b""
        touch = bool(ttl_ms) and self.opts.touch_on_read
        keep = self.opts.delete_corrupt  # note what a damaged page held, for the conditional delete
        stored = [self._page_bytes] * len(keys)  # payload bytes as read, by batch position

        def cmd(it: _Item) -> bytes:
            return pack(b"GETEX", it.rkey, b"PX", ttl_ms) if touch else pack(b"GET", it.rkey)

        def node(client: redis.Redis, its: list[_Item], asking: bool) -> list[int]:
            if self.opts.wire == "pipeline":
                p = client.pipeline(transaction=False)
                for it in its:
                    if asking:
                        p.execute_command("ASKING")
                    if touch:
                        p.getex(it.rkey, px=int(ttl_ms))
                    else:
                        p.get(it.rkey)
                res = self._drop_asking(p.execute(raise_on_error=False), asking)
                out = []
                for it, blob in zip(its, res, strict=True):
                    if isinstance(blob, Exception):
                        if self._redirected(it, blob):
                            out.append(REDIRECT)
                            continue
                        if is_transient(blob):
                            raise blob
                        if _wrong_type(blob):
                            it.damaged = _OTHER_TYPE
                            out.append(CORRUPT)
                        else:
                            out.append(MISS)
                    elif blob is None:
                        out.append(MISS)
                    else:
                        dst = pio.target(it.page)
                        code = self._unpack(blob, it.key, dst)
                        if code != OK:
                            it.damaged = _fingerprint(blob) if keep and code == CORRUPT else None
                            out.append(CORRUPT)
                            continue
                        stored[it.pos] = len(blob) - HEADER_BYTES
                        pio.commit(it.page, dst)
                        out.append(OK)
                return out

            ask = pack(b"ASKING") if asking else b""

            def io(conn: Any, sock: Any) -> list[int]:
                checks: list[Future[list[tuple[int, int]]]] = []
                try:
                    return read(conn, sock, checks)
                except BaseException:
                    # the hash threads may still be decoding into host pages: not after this call returns
                    # (its caller gives the pages of a failed read back, and others may take them at once)
                    futures_wait(checks)
                    raise

            def read(conn: Any, sock: Any, checks: list[Future[list[tuple[int, int]]]]) -> list[int]:
                conn.send_packed_command([b"".join(ask + cmd(it) for it in its)], check_health=False)
                rd = RespReader(sock)
                out = [MISS] * len(its)
                group: list[tuple[int, bytes, PageBuf, bytes]] = []
                packed: list[tuple[int, bytearray, PageBuf, bytes]] = []  # compressed frames to decode
                blobs: dict[int, tuple[bytearray, PageBuf]] = {}  # compressed frames read: frame, page
                held: dict[int, tuple[bytearray, PageBuf]] = {}  # zero-copy pages read: header, page
                errs: list[ReplyError] = []
                for j, it in enumerate(its):
                    if asking:
                        self._read_asking(rd, errs)
                    try:
                        n = rd.read_bulk_len()
                    except ReplyError as e:
                        if self._redirected(it, e):
                            out[j] = REDIRECT
                        elif _wrong_type(e):
                            it.damaged = _OTHER_TYPE
                            out[j] = CORRUPT
                        else:
                            errs.append(e)
                        continue
                    if n < 0:
                        continue
                    if HEADER_BYTES < n < self._frame_bytes:  # a compressed page: decoded on the hash threads
                        blob = bytearray(n)
                        rd.readinto(memoryview(blob))
                        rd.expect_crlf()
                        dst = pio.target(it.page)
                        blobs[j] = (blob, dst)
                        stored[it.pos] = n - HEADER_BYTES
                        packed.append((j, blob, dst, it.key))
                        if len(packed) * n >= 1 << 20:
                            checks.append(self._hasher.submit(self._unpack_group, packed))
                            packed = []
                        continue
                    if n != self._frame_bytes:  # wrong size: not one of our pages (damage, or a newer format)
                        head = bytearray(min(n, HEADER_BYTES))
                        rd.readinto(memoryview(head))
                        if keep and not newer_format(head):
                            it.damaged = _skip_fingerprint(rd, n - len(head), head)
                        else:
                            rd.skip(n - len(head))
                            rd.expect_crlf()
                        out[j] = CORRUPT
                        continue
                    header = bytearray(HEADER_BYTES)
                    rd.readinto(memoryview(header))
                    dst = pio.target(it.page)
                    for part in page_parts(dst):
                        rd.readinto(part)  # type: ignore[arg-type]
                    rd.expect_crlf()
                    stored[it.pos] = self._page_bytes  # (an earlier attempt may have read it compressed)
                    if pio.zero_copy:  # verify on the hash threads while the next pages arrive
                        if keep:
                            held[j] = (header, dst)
                        group.append((j, bytes(header), dst, it.key))
                        if len(group) >= self._group:
                            checks.append(self._hasher.submit(self._verify_group, group))
                            group = []
                    elif self._verify(bytes(header), dst, it.key):
                        pio.commit(it.page, dst)
                        out[j] = OK
                    else:
                        it.damaged = _fingerprint(header, *page_parts(dst)) if keep and not newer_format(header) \
                            else None
                        out[j] = CORRUPT
                if rd.buffered:
                    raise ConnectionError("redis: unexpected extra reply bytes")
                if group:
                    checks.append(self._hasher.submit(self._verify_group, group))
                if packed:
                    checks.append(self._hasher.submit(self._unpack_group, packed))
                for f in checks:
                    for j, code in f.result():
                        if code == OK and j in blobs:
                            pio.commit(its[j].page, blobs[j][1])
                        out[j] = OK if code == OK else CORRUPT
                        if code == CORRUPT and keep:  # what was read: the frame, or the host page holding it
                            its[j].damaged = _fingerprint(blobs[j][0]) if j in blobs else \
                                _fingerprint(held[j][0], *page_parts(held[j][1]))
                self._raise_transient(errs)
                return out

            return self._on_conn(client, io)

        res = self._run(items, node)
        if res is None:
            self._count(get_misses=len(keys))
            return 0
        n = 0
        for r in res:
            if r != OK:
                break
            n += 1
        bad = [items[i] for i, r in enumerate(res) if r == CORRUPT]
        if bad:
            self._count(corrupt_pages=len(bad))
            log.warning("redis get: %d page(s) failed frame verification (treated as misses)", len(bad))
            damaged = [it for it in bad if it.damaged is not None]
            if self.opts.delete_corrupt and damaged:
                self._delete_damaged(damaged)
        self._count(gets=n, get_misses=len(keys) - n, bytes_read=n * self._page_bytes,
                    stored_bytes_read=sum(stored[:n]))
        return n

    # ------------------------------------------------------------------ admin
    def _all_clients(self) -> list[redis.Redis]:
        if self._client is not None:
            return [self._client]
        rc = self._get_cluster()
        return [n.redis_connection for n in rc.get_primaries() if n.redis_connection is not None]

    def clear(self) -> int:
        """Delete every page under this backend's prefix (all masters); returns how many. Raises on a
        store that is down (an admin operation, not a request path)."""
        n = 0
        for c in self._all_clients():
            keys = list(c.scan_iter(match=self._prefix + b"{*}", count=1000))
            for lo in range(0, len(keys), 1000):
                p = c.pipeline(transaction=False)
                for k in keys[lo : lo + 1000]:
                    p.unlink(k)  # one key per command: keys of one node may sit in different slots
                n += sum(int(r) for r in p.execute())
        return n

    def key_counts(self) -> dict[str, int]:
        """Pages under this prefix per master (``host:port`` -> count): how a Cluster spreads them."""
        out: dict[str, int] = {}
        for c in self._all_clients():
            kw = c.connection_pool.connection_kwargs
            out[f"{kw.get('host')}:{kw.get('port')}"] = sum(
                1 for _ in c.scan_iter(match=self._prefix + b"{*}", count=1000))
        return out

    def close(self) -> None:
        self._hasher.shutdown(wait=True)
        self._write_hasher.shutdown(wait=True)
        if self._nodes_pool is not None:
            self._nodes_pool.shutdown(wait=True)
        try:
            if self._client is not None:
                self._client.close()
                self._client.connection_pool.disconnect()
            if self._cluster is not None:
                self._cluster.close()
            for c in self._unlisted.values():
                c.close()
                c.connection_pool.disconnect()
        except Exception as e:  # closing a dead connection
            log.debug("redis close: %s", e)
