"""File L3 backend over ``pyarrow.fs``: a local or mounted directory, or any URI pyarrow understands.

URLs: ``file:///var/cache/hicache``, a plain path (``/var/cache/hicache``), ``s3://bucket/prefix``,
``hdfs://namenode:8020/path``, ``gs://bucket/prefix`` -- all through the same code
(``pyarrow.fs.FileSystem.from_uri``).

Layout: one file per page, ``<root>/<k0>/<k1>/<key hex>.page`` where ``k0``/``k1`` are the first two
bytes of the key in hex (``shard_levels`` directories of 256 entries each, so no directory grows huge).
Each file is one frame (:mod:`hicache.storage.frame`), verified on every read. Names and the
``pyarrow.fs`` path of one page's read, write and delete: :mod:`hicache.storage.file_pages`; local disks
and mounts go through ``os`` instead (:mod:`hicache.storage.file_local_io`, pages read in pieces hashed
as they land).

Reads land straight in the host pages (page-first pools) and are verified there: only pages ``0..n-1``
of a ``batch_get`` that returned ``n`` hold valid data.

Atomic writes: a page is written to ``.<key hex>.<pid>.<random>.tmp`` in the same directory and renamed
into place, so a reader sees the whole page or none of it, even when the writer dies between the write
and the rename. Temporary files older than ``tmp_max_age_s`` are removed when the store is opened. On
object stores (s3, gs), where an object only appears once its upload completed, pages are written in
place.

Damaged pages: a file that fails verification is counted (``corrupt_pages``) and, with ``delete_corrupt``,
deleted (not a frame of a newer release's format: a miss left in place,
:class:`~hicache.storage.frame.NewerFormat`) -- but only the damaged file that was read: several nodes share
the store, and one of them may have renamed a good copy into place since. The read notes the length and SHA1
of what it read; the delete compares the file with that first. On a local disk or mount the file is first
renamed aside (atomic, like the writers' renames), so whatever is compared is what gets deleted, and a file
that is not the one read goes back without replacing a newer page
(:func:`~hicache.storage.file_local_io.delete_aside`). Other stores (s3, gs, hdfs, a ``filesystem``
object) have no such rename through pyarrow.fs: the file is read again and deleted if it still matches, so a
good page written between that read and the delete is lost (a later miss, never a wrong page).
``extra["corrupt_deleted"]`` counts the files actually deleted.

Size cap (``max_bytes``, 0 = none): the backend tracks the pages it knows of (scanned when opened, and
again at most every ``rescan_s`` seconds during writes; plus its own writes; reads refresh a page) and,
when the total passes the cap, deletes the oldest pages until it is below ``sweep_to`` of the cap. A
rescan orders the pages by file time again, so it forgets what reads refreshed since
(:mod:`hicache.storage.file_index`).

Options: ``max_bytes``, ``sweep_to`` (0.9), ``shard_levels`` (2), ``tmp_max_age_s`` (600),
``rescan_s`` (60), ``io_threads`` (0 = min(16, max(4, cpus)): pages of a read are fetched and verified
in parallel, except on a local filesystem with pages under 256 KiB, and for one page, which run on the
caller's thread), ``write_threads`` (0 = max(2, io_threads // 4): pages of a write, in parallel),
``write_nice`` (10: the write threads lower their own CPU priority by this much, on Linux; 0 = off),
``filesystem`` (a ``pyarrow.fs.FileSystem`` object to use instead of resolving the URL; its path part is
the root), ``delete_corrupt`` (true). A store error (disk full, permission, network) is counted and
reported as a miss / nothing written; it never raises into the caller.

Writes are background work (L2 -> L3 writeback) while reads sit on a request's path, so they run on a
small pool of their own whose threads yield the CPU (``write_nice``): writing a page costs CPU (its
checksum, the kernel's copy into the page cache), and with as many writers as cores a burst of writeback
starved the thread that drives the GPU and slowed a prefill running beside it. Local pages under 256 KiB
are written on the calling thread (the writeback's own).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

from hicache.pool import HostPool
from hicache.storage.base import StorageBackend, StorageContext, register_backend
from hicache.storage.file_index import PageIndex
from hicache.storage.file_local_io import delete_aside, read_local, write_local
from hicache.storage.file_pages import (
    TMP_SUFFIX,
    PageRead,
    Seen,
    page_path,
    read_arrow,
    resolve_store,
    scan_store,
    still_same,
    temp_path,
    write_arrow,
)
from hicache.storage.frame import PageBuf, page_len
from hicache.storage.pageio import PageBuffers, page_buffers
from hicache.storage.threads import check_nice, io_pool

log = logging.getLogger(__name__)

OK, MISS, CORRUPT, ERROR = 0, 1, 2, 3
_OBJECT_STORES = ("s3", "gs")
INLINE_PAGE_BYTES = 256 << 10  # local pages smaller than this are read/written on the caller's thread


@register_backend("file", "s3", "hdfs", "gs")
class FileBackend(StorageBackend):
    """See the module docstring. Thread-safe."""

    scheme = "file"

    def __init__(self, url: str, ctx: StorageContext, max_bytes: int = 0, sweep_to: float = 0.9,
                 shard_levels: int = 2, tmp_max_age_s: float = 600.0, rescan_s: float = 60.0,
                 io_threads: int = 0, write_threads: int = 0, write_nice: int = 10, delete_corrupt: bool = True,
                 filesystem: pafs.FileSystem | None = None, **options: Any) -> None:
        super().__init__(url, ctx, **options)
        if options:
            raise ValueError(f"file store: unknown option(s) {sorted(options)}")
        if max_bytes < 0:
            raise ValueError(f"file store max_bytes: must be >= 0, got {max_bytes}")
        if not 0.0 < sweep_to <= 1.0:
            raise ValueError(f"file store sweep_to: must be in (0, 1], got {sweep_to}")
        if not 0 <= shard_levels <= 4:
            raise ValueError(f"file store shard_levels: must be in [0, 4], got {shard_levels}")
        if io_threads < 0:
            raise ValueError(f"file store io_threads: must be >= 0 (0: scale with the cpus), got {io_threads}")
        io_threads = io_threads or min(16, max(4, os.cpu_count() or 4))
        if write_threads < 0:
            raise ValueError(f"file store write_threads: must be >= 0 (0: max(2, io_threads // 4)), "
                             f"got {write_threads}")
        check_nice("file store write_nice", write_nice)
        write_threads = write_threads or max(2, io_threads // 4)
        self.fs, self.root = resolve_store(url, filesystem)
        self.atomic_rename = urlparse(url).scheme not in _OBJECT_STORES
        self.max_bytes = max_bytes
        self.sweep_to = sweep_to
        self.shard_levels = shard_levels
        self.delete_corrupt = delete_corrupt
        self.rescan_s = rescan_s
        self._page_bytes = ctx.layout.bytes_per_page
        self._threads = io_threads
        self._pool = io_pool(io_threads, "hicache-file")
        self._write_threads = write_threads
        self._write_pool = io_pool(write_threads, "hicache-file-write", write_nice)
        self._dirs: set[str] = set()
        self._index = PageIndex()
        try:
            self.fs.create_dir(self.root, recursive=True)
            self._scan(tmp_max_age_s)
        except OSError as e:  # store unreachable now: start empty, count it (probe() says why; operations warn)
            self._count(errors=1)
            log.debug("file store %s: cannot open (%s)", self.root, e)

    def probe(self) -> str | None:
        """Create the root if needed, then write and delete a small file there."""
        name = f"{self.root}/.probe-{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
        try:
            self.fs.create_dir(self.root, recursive=True)
            with self.fs.open_output_stream(name) as f:
                f.write(b"hicache probe")
            self.fs.delete_file(name)
        except Exception as e:
            return f"{self.root}: {e}"
        return None

    @property
    def _local(self) -> bool:
        """Local disks and mounts: page reads and writes go straight through ``os`` (one writev / readv
        per page, same layout, same atomic rename); everything else goes through pyarrow.fs."""
        return type(self.fs) is pafs.LocalFileSystem

    # ------------------------------------------------------------------ paths
    def path(self, key: bytes) -> str:
        return page_path(self.root, self.shard_levels, key)

    def _ensure_dir(self, d: str) -> None:
        if not self.atomic_rename:  # object stores have no directories to create
            return
        if d not in self._dirs:
            self.fs.create_dir(d, recursive=True)
            self._dirs.add(d)

    # ------------------------------------------------------------------ index and sweeping
    def _scan(self, tmp_max_age_s: float | None = None) -> None:
        """Rebuild the index from the store (oldest first); remove stale temporary files."""
        pages, temps = scan_store(self.fs, self.root)
        now = time.time()
        for mtime, p in temps:
            if tmp_max_age_s is not None and now - mtime >= tmp_max_age_s:
                self._delete_path(p)
        self._index.replace((p, size) for _, p, size in pages)

    @property
    def stored_bytes(self) -> int:
        """Bytes of pages the backend knows of (what the size cap is applied to)."""
        return self._index.bytes

    def _sweep(self) -> None:
        if self.max_bytes <= 0:
            return
        if self.rescan_s > 0 and time.monotonic() - self._index.scanned_at > self.rescan_s:
            try:
                self._scan()
            except OSError as e:
                log.debug("file store: rescan failed: %s", e)
        victims = self._index.take_oldest(self.max_bytes, int(self.max_bytes * self.sweep_to))
        if not victims:
            return
        for p in victims:
            self._delete_path(p)
        self._count_extra("swept_pages", len(victims))

    def _delete_path(self, p: str) -> bool:
        try:
            self.fs.delete_file(p)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            log.debug("file store: delete %s failed: %s", p, e)
            return False

    def _count_extra(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats.extra[name] = self._stats.extra.get(name, 0) + n

    # ------------------------------------------------------------------ batch helpers
    def _map(self, fn: Callable[[int], int], n: int, write: bool = False) -> list[int]:
        """Run ``fn(i)`` for i in range(n) on the read (or ``write``) threads: a missing file is a MISS
        (an ERROR for a write), any other ``OSError`` an ERROR; other exceptions (bugs) propagate."""
        def safe(i: int) -> int:
            try:
                return fn(i)
            except FileNotFoundError as e:
                if write:  # a page's directory vanished again while it was being written: not stored
                    log.warning("file store %s: %s", self.root, e)
                    return ERROR
                return MISS
            except OSError as e:
                log.warning("file store %s: %s", self.root, e)
                return ERROR

        if (n == 1 and not write) or (self._local and self._page_bytes < INLINE_PAGE_BYTES):
            # small local pages: each costs a few microseconds of syscalls and Python, and handing them
            # to threads only adds GIL ping-pong; run them on the caller's thread
            return [safe(i) for i in range(n)]
        # Contiguous runs of pages per thread: one task each, not one per page (less GIL ping-pong).
        pool, threads = (self._write_pool, self._write_threads) if write else (self._pool, self._threads)
        parts = min(n, threads)
        bounds = [(n * k // parts, n * (k + 1) // parts) for k in range(parts)]
        out: list[int] = []
        for res in pool.map(lambda b: [safe(i) for i in range(*b)], bounds):
            out.extend(res)
        return out

    @staticmethod
    def _leading(res: list[int]) -> int:
        n = 0
        for r in res:
            if r != OK:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ operations
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        try:
            infos = self.fs.get_file_info([self.path(k) for k in keys])
        except OSError as e:
            self._count(errors=1)
            log.warning("file store %s: %s", self.root, e)
            return 0
        n = 0
        for fi in infos:
            if fi.type != pafs.FileType.File:
                break
            n += 1
        return n

    def _write_frame(self, d: str, key: bytes, final: str, header: bytes, payload: PageBuf) -> None:
        """Write one page's frame to ``final`` (in directory ``d``): through a temporary file renamed into
        place where renames are atomic, else in place."""
        target = temp_path(d, key.hex()) if self.atomic_rename else final
        try:
            if self._local:
                write_local(target, final, header, payload)
            else:
                write_arrow(self.fs, target, final, header, payload)
        except BaseException:
            if self.atomic_rename:
                self._delete_path(target)
            raise

    def batch_set(self, keys: Sequence[bytes], host_pool: HostPool | PageBuffers, host_indices: Sequence[int]) -> int:
        self._check_lengths(keys, host_indices)
        pio = page_buffers(host_pool)

        stored = [0] * len(keys)  # payload bytes as written

        def one(i: int) -> int:
            key, page = keys[i], int(host_indices[i])
            header, payload = self.pack(pio.source(page), key)
            final = self.path(key)
            d = final.rsplit("/", 1)[0]
            self._ensure_dir(d)
            try:
                self._write_frame(d, key, final, header, payload)
            except FileNotFoundError:
                # The directory went away since we made it (the store was wiped, another node cleared it):
                # make it again. Without this, every later page of that directory would fail, forever.
                self._dirs.discard(d)
                self._ensure_dir(d)
                self._write_frame(d, key, final, header, payload)
            self._index.note(final, len(header) + page_len(payload))
            stored[i] = page_len(payload)
            return OK

        res = self._map(one, len(keys), write=True)
        n = self._leading(res)
        errors = sum(r == ERROR for r in res)
        if errors:
            self._count(errors=errors)
        self._count(sets=sum(r == OK for r in res), bytes_written=sum(r == OK for r in res) * self._page_bytes,
                    stored_bytes_written=sum(stored))
        self._sweep()
        return n

    def batch_get(self, keys: Sequence[bytes], host_pool: HostPool | PageBuffers, host_indices: Sequence[int]) -> int:
        self._check_lengths(keys, host_indices)
        ns = self.ctx.namespace_digest
        pio = page_buffers(host_pool)
        keep = self.delete_corrupt
        seen: list[Seen | None] = [None] * len(keys)  # damaged files as read, for the conditional delete
        stored = [self._page_bytes] * len(keys)  # payload bytes as read

        def one(i: int) -> int:
            key, page = keys[i], int(host_indices[i])
            p = self.path(key)
            dst = pio.target(page)
            r: PageRead = (read_local(p, dst, ns, key, self._page_bytes, keep) if self._local
                           else read_arrow(self.fs, p, dst, ns, key, self._page_bytes, keep))
            if not r.ok:
                seen[i] = r.seen
                return CORRUPT
            if r.stored:
                stored[i] = r.stored
            pio.commit(page, dst)
            self._index.touch(p)
            return OK

        res = self._map(one, len(keys))
        n = self._leading(res)
        bad = [keys[i] for i, r in enumerate(res) if r == CORRUPT]
        if bad:
            self._count(corrupt_pages=len(bad))
            log.warning("file store %s: %d page(s) failed frame verification (treated as misses)",
                        self.root, len(bad))
            if keep:
                self._delete_damaged([(keys[i], s) for i, s in enumerate(seen) if s is not None])
        errors = sum(r == ERROR for r in res)
        if errors:
            self._count(errors=errors)
        self._count(gets=n, get_misses=len(keys) - n, bytes_read=n * self._page_bytes,
                    stored_bytes_read=sum(stored[:n]))
        return n

    def delete(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            p = self.path(k)
            if self._delete_path(p):
                n += 1
            self._index.forget(p)
        return n

    def _delete_damaged(self, damaged: list[tuple[bytes, Seen]]) -> int:
        """Delete each page's file only if it is still the damaged file read (see the module docstring);
        returns how many were deleted."""
        n = 0
        for key, seen in damaged:
            p = self.path(key)
            try:
                gone = delete_aside(p, seen) if self._local else still_same(self.fs, p, seen) and self._delete_path(p)
            except OSError as e:
                log.debug("file store: delete of damaged %s failed: %s", p, e)
                gone = False
            if gone:
                n += 1
                self._index.forget(p)
        self._count_extra("corrupt_deleted", n)
        return n

    def clear(self) -> None:
        """Delete every page (and temporary file) under the root."""
        self.fs.delete_dir_contents(self.root, missing_dir_ok=True)
        self._dirs.clear()
        self._index.clear()

    def close(self) -> None:
        self._write_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
