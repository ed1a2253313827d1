"""Redis L3 backend: one instance, Sentinel or Cluster; TLS and AUTH/ACL from the URL.

URLs::

    redis://[user[:password]@]host[:port][/db][?option=value&...]
    rediss://...                                                     (TLS)
    redis+sentinel://[user[:password]@]host:port[,host:port...]/service[/db][?...]
    rediss+sentinel://...
    redis+cluster://[user[:password]@]host:port[,host:port...][/][?...]
    rediss+cluster://...

Options (URL query or keyword arguments, keywords win): :class:`~hicache.storage.redis_options.RedisOptions`.

Storage layout: one string value per page, ``<prefix>{<page key hex>}`` -> frame (see
:mod:`hicache.storage.frame`). The braces are a Cluster hash tag over the page key alone, so the pages of
one request hash to different slots and spread over every master; a batch is split per master and the
parts run in parallel (:mod:`hicache.storage.redis_nodes`), each pipelined on one connection.

Page I/O speaks RESP itself (:mod:`hicache.storage.resp`) on connections borrowed from redis-py's pools
(which did the connect, TLS, AUTH and SELECT): a write sends the frame header and the host page's own
buffers, a read receives each payload straight into its host page and verifies it there, on the hash
threads while the next pages arrive. Only pages ``0..n-1`` of a ``batch_get`` that returned ``n`` hold
valid data (later pages may have been overwritten with rejected bytes). A value that cannot be one of
our pages (a string of the wrong size, a value of another type) is a damaged page, like a frame that
fails verification.

Damaged pages are counted (``corrupt_pages``) and, with ``delete_corrupt``, deleted only while the key
still holds the damaged value read (:mod:`hicache.storage.redis_damaged`; a frame of a newer release's
format is a miss left in place). ``extra["corrupt_deleted"]`` counts the values actually deleted.

Failure model: every operation is retried on transient errors (connection, timeout, waiting longer than
``timeout_s`` for a connection, MOVED / LOADING / ...) with backoff; when it still fails the error is
counted, the operation reports a miss / nothing stored, and a circuit breaker keeps later operations off
the store until a call succeeds (:mod:`hicache.storage.retry`). Other errors are counted and reported
the same way but leave the breaker closed. Nothing raises into the caller. Connections are
re-established by themselves when the store returns; a Cluster's slot map is refreshed after errors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any
from urllib.parse import parse_qsl, urlparse

import redis

from hicache.pool import HostPool
from hicache.storage import redis_damaged as damaged
from hicache.storage.base import StorageBackend, StorageContext, register_backend
from hicache.storage.frame import (
    HEADER_BYTES,
    PACKED_HEADER_BYTES,
    FrameError,
    NewerFormat,
    PageBuf,
    encode_header,
    header_len,
    newer_format,
    page_len,
    page_parts,
    unpack_page,
)
from hicache.storage.pageio import PageBuffers, page_buffers
from hicache.storage.redis_nodes import (
    CORRUPT,
    MISS,
    NEWER,
    OK,
    REDIRECT,
    Item,
    NodeFn,
    RedisNodes,
    int_replies,
    is_transient,
    on_conn,
    raise_transient,
    read_asking,
)
from hicache.storage.redis_options import RedisOptions, connect
from hicache.storage.resp import ReplyError, RespReader, bulk_head, pack
from hicache.storage.retry import CircuitBreaker, RetryPolicy, call_with_retry
from hicache.storage.threads import io_pool

log = logging.getLogger(__name__)

Frame = tuple[bytes, PageBuf]  # a page's frame: header, payload as stored (contiguous or in pieces)
Checked = list[tuple[int, int]]  # (position in a node's part, OK / CORRUPT / NEWER) from the hash threads


def _prefix_len(codes: list[int]) -> int:
    n = 0
    for r in codes:
        if r != OK:
            break
        n += 1
    return n


@register_backend("redis", "rediss", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster")
class RedisBackend(StorageBackend):
    """See the module docstring. Thread-safe; construction never connects (a down store is not an error)."""

    scheme = "redis"

    def __init__(self, url: str, ctx: StorageContext, **options: Any) -> None:
        super().__init__(url, ctx, **options)
        u = urlparse(url)
        self.scheme = u.scheme
        self.opts, rest = RedisOptions.parse(dict(parse_qsl(u.query)), options)
        o = self.opts
        self._prefix = o.prefix.encode()
        self._page_bytes = ctx.layout.bytes_per_page
        self._frame_bytes = HEADER_BYTES + self._page_bytes
        self._ttl_ms = str(max(1, int(o.ttl_s * 1000))).encode() if o.ttl_s > 0 else b""
        self._retry = RetryPolicy(o.retry_attempts, o.retry_base_s, o.retry_max_s)
        self._breaker = CircuitBreaker(o.breaker_base_s, o.breaker_max_s)
        hash_threads = o.hash_threads or min(8, max(2, os.cpu_count() or 2))
        self._hasher = io_pool(hash_threads, "hicache-redis-hash")  # reads: verification on a request's path
        self._write_hasher = io_pool(max(1, hash_threads // 2), "hicache-redis-write-hash", o.write_nice)
        self._group = max(1, (1 << 20) // self._page_bytes)  # pages per hashing task
        self._damaged = damaged.Deleter()
        client, cluster_args = connect(u, o, rest)
        self._nodes = RedisNodes(client, cluster_args, o.max_connections, o.timeout_s, self._count_extra)

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a page: ``<prefix>{<hex>}`` (the braces are the Cluster hash tag)."""
        return b"%s{%s}" % (self._prefix, key.hex().encode())

    def _items(self, keys: Sequence[bytes], pages: Sequence[int] | None = None) -> list[Item]:
        return [Item(i, self.redis_key(k), k, int(pages[i]) if pages is not None else -1)
                for i, k in enumerate(keys)]

    def _count_extra(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats.extra[name] = self._stats.extra.get(name, 0) + n

    def _refresh(self, e: BaseException | None = None) -> None:
        self._nodes.refresh(e)

    def _run(self, items: list[Item], fn: NodeFn) -> list[int] | None:
        """One batched operation with retries and the breaker; None when the store failed."""
        if not items:
            return []
        if not self._breaker.allow():
            self._count(errors=1)
            self._count_extra("breaker_skips")
            return None
        try:
            res = call_with_retry(lambda: self._nodes.scatter(items, fn), self._retry, is_transient,
                                  self._refresh)
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
            self._nodes.ping()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    # ------------------------------------------------------------------ exists / delete
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        res = self._run(self._items(keys), int_replies(lambda it: (b"EXISTS", it.rkey)))
        return 0 if res is None else _prefix_len([OK if r > 0 else MISS for r in res])

    def delete(self, keys: Sequence[bytes]) -> int:
        res = self._run(self._items(keys), int_replies(lambda it: (b"DEL", it.rkey)))
        return 0 if res is None else sum(res)

    def _delete_damaged(self, bad: list[Item]) -> int:
        """Delete each page's key only if it still holds the damaged value read there; returns how many."""
        res = self._run([Item(i, it.rkey, it.key, -1, damaged=it.damaged) for i, it in enumerate(bad)],
                        self._damaged.node)
        n = 0 if res is None else sum(r == 1 for r in res)
        self._count_extra("corrupt_deleted", n)
        return n

    # ------------------------------------------------------------------ set
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

    def batch_set(self, keys: Sequence[bytes], host_pool: HostPool | PageBuffers, host_indices: Sequence[int]) -> int:
        self._check_lengths(keys, host_indices)
        items = self._items(keys, host_indices)
        # "SET key value [PX ms]": the arguments after the value, and the array header
        suffix = b"\r\n" + pack(b"PX", self._ttl_ms)[4:] if self._ttl_ms else b"\r\n"
        nargs = b"*5\r\n" if self._ttl_ms else b"*3\r\n"
        pio = page_buffers(host_pool)
        stored = [0] * len(keys)  # payload bytes as written, by batch position

        def node(client: redis.Redis, its: list[Item], asking: bool) -> list[int]:
            heads = self._hash_ahead([pio.source(it.page) for it in its], [it.key for it in its])
            ask = pack(b"ASKING") if asking else b""

            def io(conn: Any, sock: Any) -> list[int]:
                lead = b""
                for it, h in zip(its, heads, strict=True):
                    hd, pl = h[0].result()[h[1]]
                    size = stored[it.pos] = page_len(pl)
                    head = b"".join((lead, ask, nargs, b"$3\r\nSET\r\n", bulk_head(len(it.rkey)), it.rkey,
                                     b"\r\n", bulk_head(size + len(hd)), hd))
                    conn.send_packed_command([head, *page_parts(pl)], check_health=False)
                    lead = suffix
                conn.send_packed_command([suffix], check_health=False)
                rd = RespReader(sock)
                errs: list[ReplyError] = []
                out: list[int] = []
                for it in its:
                    if asking:
                        read_asking(rd, errs)
                    r = rd.read_reply_or_error()
                    if not isinstance(r, ReplyError):
                        out.append(OK)
                    elif it.redirected(r):
                        out.append(REDIRECT)
                    else:
                        out.append(MISS)
                        errs.append(r)
                if rd.buffered:
                    raise ConnectionError("redis: unexpected extra reply bytes")
                raise_transient(errs)
                if errs:
                    log.warning("redis set: %s", errs[0])
                return out

            return on_conn(client, io)

        res = self._run(items, node)
        if res is None:
            return 0
        n = _prefix_len(res)
        if n < len(res):
            self._count(errors=1)
        self._count(sets=n, bytes_written=n * self._page_bytes, stored_bytes_written=sum(stored[:n]))
        return n

    # ------------------------------------------------------------------ get
    def _verify(self, header: bytes, payload: PageBuf, key: bytes) -> bool:
        return encode_header(payload, self.ctx.namespace_digest, key) == header

    def _verify_group(self, group: list[tuple[int, bytes, PageBuf, bytes]]) -> Checked:
        return [(j, OK if self._verify(h, dst, key) else NEWER if newer_format(h) else CORRUPT)
                for j, h, dst, key in group]

    def _unpack_group(self, group: list[tuple[int, bytearray, PageBuf, bytes]]) -> Checked:
        """Verify compressed frames and decode them into their host pages."""
        out = []
        for j, blob, dst, key in group:
            try:
                unpack_page(blob, self.ctx.namespace_digest, key, dst)
                out.append((j, OK))
            except NewerFormat:
                out.append((j, NEWER))
            except FrameError:
                out.append((j, CORRUPT))
        return out

    def batch_get(self, keys: Sequence[bytes], host_pool: HostPool | PageBuffers, host_indices: Sequence[int]) -> int:
        self._check_lengths(keys, host_indices)
        items = self._items(keys, host_indices)
        pio = page_buffers(host_pool)
        touch = bool(self._ttl_ms) and self.opts.touch_on_read
        keep = self.opts.delete_corrupt  # note what a damaged page held, for the conditional delete
        stored = [self._page_bytes] * len(keys)  # payload bytes as read, by batch position

        def cmd(it: Item) -> bytes:
            return pack(b"GETEX", it.rkey, b"PX", self._ttl_ms) if touch else pack(b"GET", it.rkey)

        def node(client: redis.Redis, its: list[Item], asking: bool) -> list[int]:
            ask = pack(b"ASKING") if asking else b""

            def io(conn: Any, sock: Any) -> list[int]:
                checks: list[Future[Checked]] = []
                try:
                    return read(conn, sock, checks)
                except BaseException:
                    # the hash threads may still be decoding into host pages: not after this call returns
                    # (its caller gives the pages of a failed read back, and others may take them at once)
                    futures_wait(checks)
                    raise

            def read(conn: Any, sock: Any, checks: list[Future[Checked]]) -> list[int]:
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
                        read_asking(rd, errs)
                    try:
                        n = rd.read_bulk_len()
                    except ReplyError as e:
                        if it.redirected(e):
                            out[j] = REDIRECT
                        elif e.kind == "WRONGTYPE":  # a value of another type: not one of our pages
                            it.damaged = damaged.OTHER_TYPE
                            out[j] = CORRUPT
                        else:
                            errs.append(e)
                        continue
                    if n < 0:
                        continue
                    if PACKED_HEADER_BYTES < n < self._frame_bytes:
                        # a compressed page, or a page of an earlier release (version 2): decoded on the
                        # hash threads
                        blob = bytearray(n)
                        rd.readinto(memoryview(blob))
                        rd.expect_crlf()
                        dst = pio.target(it.page)
                        blobs[j] = (blob, dst)
                        stored[it.pos] = n - header_len(blob)
                        packed.append((j, blob, dst, it.key))
                        if len(packed) * n >= 1 << 20:
                            checks.append(self._hasher.submit(self._unpack_group, packed))
                            packed = []
                        continue
                    if n != self._frame_bytes:  # wrong size: not one of our pages (damage, or a newer format)
                        head = bytearray(min(n, HEADER_BYTES))
                        rd.readinto(memoryview(head))
                        if keep and not newer_format(head):
                            it.damaged = damaged.skip_fingerprint(rd, n - len(head), head)
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
                        it.damaged = damaged.fingerprint(header, *page_parts(dst)) \
                            if keep and not newer_format(header) else None
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
                            its[j].damaged = damaged.fingerprint(blobs[j][0]) if j in blobs else \
                                damaged.fingerprint(held[j][0], *page_parts(held[j][1]))
                raise_transient(errs)
                return out

            return on_conn(client, io)

        res = self._run(items, node)
        if res is None:
            self._count(get_misses=len(keys))
            return 0
        n = _prefix_len(res)
        bad = [items[i] for i, r in enumerate(res) if r == CORRUPT]
        if bad:
            self._count(corrupt_pages=len(bad))
            log.warning("redis get: %d page(s) failed frame verification (treated as misses)", len(bad))
            found = [it for it in bad if it.damaged is not None]
            if self.opts.delete_corrupt and found:
                self._delete_damaged(found)
        self._count(gets=n, get_misses=len(keys) - n, bytes_read=n * self._page_bytes,
                    stored_bytes_read=sum(stored[:n]))
        return n

    # ------------------------------------------------------------------ admin
    def clear(self) -> int:
        """Delete every page under this backend's prefix (all masters); returns how many. Raises on a
        store that is down (an admin operation, not a request path)."""
        n = 0
        for c in self._nodes.masters():
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
        for c in self._nodes.masters():
            kw = c.connection_pool.connection_kwargs
            out[f"{kw.get('host')}:{kw.get('port')}"] = sum(
                1 for _ in c.scan_iter(match=self._prefix + b"{*}", count=1000))
        return out

    def close(self) -> None:
        self._hasher.shutdown(wait=True)
        self._write_hasher.shutdown(wait=True)
        self._nodes.close()
