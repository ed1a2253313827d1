"""File L3 backend over ``pyarrow.fs``: a local or mounted directory, or any URI pyarrow understands.

URLs: ``file:///var/cache/hicache``, a plain path (``/var/cache/hicache``), ``s3://bucket/prefix``,
``hdfs://namenode:8020/path``, ``gs://bucket/prefix`` -- all through the same code
(``pyarrow.fs.FileSystem.from_uri``).

Layout: one file per page, ``<root>/<k0>/<k1>/<key hex>.page`` where ``k0``/``k1`` are the first two
bytes of the key in hex (``shard_levels`` directories of 256 entries each, so no directory grows huge).
Each file is one frame (:mod:`hicache.storage.frame`), verified on every read.

Reads land straight in the host pages (page-first pools) and are verified there: only pages ``0..n-1``
of a ``batch_get`` that returned ``n`` hold valid data. A local page is read in pieces of ``READ_CHUNK``
(1 MiB), each fed to the page's checksum as soon as it lands, while it is still in the CPU's cache: the
check costs no second pass over the page from memory.

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
renamed aside to a private ``.<name>.<pid>.<random>.del.tmp`` (atomic, like the writers' renames), so
whatever is compared is what gets deleted; a file that is not the one read goes back with a hard link, which
never replaces a newer page written meanwhile (for the moment it is aside the page reads as a miss). Where
the filesystem has no hard links it goes back by a rename when nothing took its place, a window of one
``lstat``. Other stores (s3, gs, hdfs, a ``filesystem`` object) have no such rename through pyarrow.fs: the
file is read again and deleted if it still matches, so a good page written between that read and the delete
is lost (a later miss, never a wrong page). ``extra["corrupt_deleted"]`` counts the files actually deleted.

Size cap (``max_bytes``, 0 = none): the backend tracks the pages it knows of (scanned when opened, and
again at most every ``rescan_s`` seconds during writes; plus its own writes; reads refresh a page) and,
when the total passes the cap, deletes the oldest pages until it is below ``sweep_to`` of the cap. A
rescan orders the pages by file time again, so it forgets what reads refreshed since.

Options: ``max_bytes``, ``sweep_to`` (0.9), ``shard_levels`` (2), ``tmp_max_age_s`` (600),
``rescan_s`` (60), ``io_threads`` (0 = min(16, max(4, cpus)): pages of a read are fetched and verified
in parallel, except on a local filesystem with pages under 256 KiB, and for one page, which run on the
caller's thread), ``write_threads`` (0 = max(2, io_threads // 4): pages of a write, in parallel),
``write_nice`` (10: the write threads lower their own CPU priority by this much, on Linux; 0 = off),
``filesystem`` (a ``pyarrow.fs.FileSystem`` object to use instead of resolving the
URL; its path part is the root), ``delete_corrupt``
(true). A store error (disk full, permission, network) is counted and reported as a miss / nothing
written; it never raises into the caller.

Writes are background work (L2 -> L3 writeback) while reads sit on a request's path, so they run on
separate threads: a small write pool whose threads yield the CPU to everything else (``write_nice``);
local pages under 256 KiB are written on the calling thread (the writeback's own).
Writing a page costs CPU (its checksum, the kernel's copy into the page cache); with as many writers as
cores, a burst of writeback starved the thread that drives the GPU and slowed a prefill running beside
it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs
import xxhash

from hicache.pool import HostPool
from hicache.storage.base import StorageBackend, StorageContext, register_backend
from hicache.storage.frame import (
    HEADER_BYTES,
    FrameError,
    NewerFormat,
    PageBuf,
    encode_header,
    header_of,
    newer_format,
    page_len,
    page_parts,
    payload_hasher,
    unpack_page,
)
from hicache.storage.pageio import PageBuffers, page_buffers
from hicache.storage.threads import check_nice, io_pool

log = logging.getLogger(__name__)

OK, MISS, CORRUPT, ERROR = 0, 1, 2, 3
_OBJECT_STORES = ("s3", "gs")
PAGE_SUFFIX = ".page"
INLINE_PAGE_BYTES = 256 << 10  # local pages smaller than this are read/written on the caller's thread
TMP_SUFFIX = ".tmp"
# A local page is read in pieces of this size, each hashed as soon as it lands: still in the CPU's cache
# (L2 / a share of L3). One read then one hash of a whole 8 MiB page read it from memory a second time for
# the checksum (issue #40, one EPYC core, 8 MiB pages: +21% CPU over the read alone; in 1 MiB pieces, +11%).
READ_CHUNK = 1 << 20
Seen = tuple[int, bytes]  # a damaged file as read: its length and SHA1 (hex)


def _seen(*parts: bytes | bytearray | memoryview) -> Seen:
    h = hashlib.sha1(usedforsecurity=False)
    for p in parts:
        h.update(p)
    return sum(len(p) for p in parts), h.hexdigest().encode()


def _seen_reader(read: Callable[[int], bytes]) -> Seen:
    """:func:`_seen` of everything ``read`` returns from where it stands to the end."""
    h = hashlib.sha1(usedforsecurity=False)
    n = 0
    while chunk := read(1 << 20):
        h.update(chunk)
        n += len(chunk)
    return n, h.hexdigest().encode()


def _read_hashing(fd: int, header: bytearray, dst: PageBuf, hasher: xxhash.xxh3_128) -> int:
    """Read ``fd`` from where it stands into ``header`` and then ``dst``'s pieces, in pieces of at most
    :data:`READ_CHUNK` bytes, feeding each piece of the payload to ``hasher`` as it lands; returns the
    payload bytes read (fewer than ``page_len(dst)``: the file ended early; what was read is hashed)."""
    got = 0
    lead: list[bytearray] = [header]  # (read with the first piece: one syscall for a small page)
    for part in page_parts(dst):
        view = memoryview(part)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        for off in range(0, len(view), READ_CHUNK):
            piece = view[off:off + READ_CHUNK]
            k = os.readv(fd, [*lead, piece])
            if lead:
                lead = []
                k -= HEADER_BYTES
                if k < 0:
                    return 0
            if k:
                hasher.update(piece[:k])
            got += k
            if k < len(piece):
                return got
    return got


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
        scheme = urlparse(url).scheme
        self.fs: pafs.FileSystem
        if filesystem is not None:  # a pyarrow filesystem object supplied by the caller; the URL's path is the root
            self.fs = filesystem
            self.root = urlparse(url).path.rstrip("/") if scheme else url.rstrip("/")
        elif scheme in ("", "file"):
            host = urlparse(url).netloc
            if scheme == "file" and host not in ("", "localhost"):
                # file://relative/x would otherwise mean /x on this machine
                raise ValueError(f"file store: {url!r} names host {host!r}; use file:///absolute/path")
            path = urlparse(url).path if scheme == "file" else url
            if not path:
                raise ValueError(f"file store: no path in {url!r}")
            self.fs = pafs.LocalFileSystem()
            self.root = os.path.abspath(path)
        else:
            self.fs, self.root = pafs.FileSystem.from_uri(url)
            self.root = self.root.rstrip("/")
        self.atomic_rename = scheme not in _OBJECT_STORES
        self.max_bytes = max_bytes
        self.sweep_to = sweep_to
        self.shard_levels = shard_levels
        self.delete_corrupt = delete_corrupt
        self.rescan_s = rescan_s
        self._page_bytes = ctx.layout.bytes_per_page
        self._frame_bytes = HEADER_BYTES + self._page_bytes
        self._threads = io_threads
        self._pool = io_pool(io_threads, "hicache-file")
        self._write_threads = write_threads
        self._write_pool = io_pool(write_threads, "hicache-file-write", write_nice)
        self._dirs: set[str] = set()
        self._index: OrderedDict[str, int] = OrderedDict()  # path -> bytes, oldest first
        self._index_bytes = 0
        self._index_lock = threading.Lock()
        self._last_scan = 0.0
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
        h = key.hex()
        shards = [h[2 * i : 2 * i + 2] for i in range(self.shard_levels)]
        return "/".join([self.root, *shards, h + PAGE_SUFFIX])

    def _ensure_dir(self, d: str) -> None:
        if not self.atomic_rename:  # object stores have no directories to create
            return
        if d not in self._dirs:
            self.fs.create_dir(d, recursive=True)
            self._dirs.add(d)

    # ------------------------------------------------------------------ index and sweeping
    def _scan(self, tmp_max_age_s: float | None = None) -> None:
        """Rebuild the index from the store (oldest first); remove stale temporary files."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.root, recursive=True, allow_not_found=True))
        now = time.time()
        pages: list[tuple[float, str, int]] = []
        for fi in infos:
            if fi.type != pafs.FileType.File:
                continue
            mtime = fi.mtime.timestamp() if fi.mtime is not None else 0.0
            if fi.base_name.endswith(TMP_SUFFIX):
                if tmp_max_age_s is not None and now - mtime >= tmp_max_age_s:
                    self._delete_path(fi.path)
            elif fi.base_name.endswith(PAGE_SUFFIX):
                pages.append((mtime, fi.path, int(fi.size or 0)))
        pages.sort()
        with self._index_lock:
            self._index = OrderedDict((p, s) for _, p, s in pages)
            self._index_bytes = sum(s for _, _, s in pages)
            self._last_scan = time.monotonic()

    @property
    def stored_bytes(self) -> int:
        """Bytes of pages the backend knows of (what the size cap is applied to)."""
        with self._index_lock:
            return self._index_bytes

    def _note(self, path: str, size: int) -> None:
        with self._index_lock:
            old = self._index.pop(path, None)
            self._index_bytes += size - (old or 0)
            self._index[path] = size

    def _forget(self, path: str) -> None:
        with self._index_lock:
            old = self._index.pop(path, None)
            if old is not None:
                self._index_bytes -= old

    def _touch(self, path: str) -> None:
        with self._index_lock:
            if path in self._index:
                self._index.move_to_end(path)

    def _sweep(self) -> None:
        if self.max_bytes <= 0:
            return
        if self.rescan_s > 0 and time.monotonic() - self._last_scan > self.rescan_s:
            try:
                self._scan()
            except OSError as e:
                log.debug("file store: rescan failed: %s", e)
        victims: list[str] = []
        with self._index_lock:
            if self._index_bytes <= self.max_bytes:
                return
            target = int(self.max_bytes * self.sweep_to)
            while self._index and self._index_bytes > target:
                p, s = self._index.popitem(last=False)
                self._index_bytes -= s
                victims.append(p)
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
        target = f"{d}/.{key.hex()}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}" if self.atomic_rename \
            else final
        try:
            if self._local:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    if os.writev(fd, [header, *page_parts(payload)]) != HEADER_BYTES + page_len(payload):
                        raise OSError(f"short write to {target}")
                finally:
                    os.close(fd)
                if self.atomic_rename:
                    os.rename(target, final)
            else:
                with self.fs.open_output_stream(target) as out:
                    out.write(header)
                    for part in page_parts(payload):
                        out.write(part)
                if self.atomic_rename:
                    self.fs.move(target, final)
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
            self._note(final, HEADER_BYTES + page_len(payload))
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

        def unpacked(i: int, blob: bytes | bytearray, dst: PageBuf) -> int:
            """A compressed frame (smaller than a page's): verify and decode it into ``dst``."""
            try:
                unpack_page(blob, ns, keys[i], dst)
            except NewerFormat:  # a newer release's page: a miss, left in place
                return CORRUPT
            except FrameError:
                if keep:
                    seen[i] = _seen(blob)
                return CORRUPT
            stored[i] = len(blob) - HEADER_BYTES
            pio.commit(int(host_indices[i]), dst)
            self._touch(self.path(keys[i]))
            return OK

        def one(i: int) -> int:
            key, page = keys[i], int(host_indices[i])
            p = self.path(key)
            dst = pio.target(page)
            header: bytes | bytearray
            if self._local:
                fd = os.open(p, os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    if HEADER_BYTES < size < self._frame_bytes:
                        blob = bytearray(size)
                        if os.readv(fd, [blob]) != size:
                            return CORRUPT  # (the file changed under us; kept)
                        return unpacked(i, blob, dst)
                    if size != self._frame_bytes:
                        if keep and not newer_format(os.pread(fd, HEADER_BYTES, 0)):
                            seen[i] = _seen_reader(lambda k: os.read(fd, k))
                        return CORRUPT
                    header = bytearray(HEADER_BYTES)
                    hasher = payload_hasher(ns, key)
                    # each piece is hashed as it lands (still in the CPU's cache), not in a second pass
                    got = _read_hashing(fd, header, dst, hasher)
                    ok = got == self._page_bytes and header_of(hasher, ns, key, got) == header
                finally:
                    os.close(fd)
            else:
                with self.fs.open_input_file(p) as f:
                    size = f.size()
                    if HEADER_BYTES < size < self._frame_bytes:
                        return unpacked(i, f.read(), dst)
                    if size != self._frame_bytes:
                        if keep and not newer_format(f.read_at(HEADER_BYTES, 0)):
                            f.seek(0)
                            seen[i] = _seen_reader(f.read)
                        return CORRUPT
                    header = f.read(HEADER_BYTES)
                    got = sum(f.readinto(part) for part in page_parts(dst))
                ok = got == self._page_bytes and encode_header(dst, ns, key) == header
            if not ok:
                if keep and got == self._page_bytes and not newer_format(header):  # (a short read: the file
                    # changed under us; a newer format: another release's page; both kept)
                    seen[i] = _seen(header, *page_parts(dst))
                return CORRUPT
            pio.commit(page, dst)
            self._touch(p)
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
            self._forget(p)
        return n

    def _delete_damaged(self, damaged: list[tuple[bytes, Seen]]) -> int:
        """Delete each page's file only if it is still the damaged file read (see the module docstring);
        returns how many were deleted."""
        n = 0
        for key, seen in damaged:
            p = self.path(key)
            try:
                gone = self._delete_aside(p, seen) if self._local else self._delete_if_same(p, seen)
            except OSError as e:
                log.debug("file store: delete of damaged %s failed: %s", p, e)
                gone = False
            if gone:
                n += 1
                self._forget(p)
        self._count_extra("corrupt_deleted", n)
        return n

    @staticmethod
    def _delete_aside(p: str, seen: Seen) -> bool:
        """Local: rename ``p`` aside (atomic), delete it if it is what was read, else put it back."""
        d, name = p.rsplit("/", 1)
        aside = f"{d}/.{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.del{TMP_SUFFIX}"
        try:
            os.rename(p, aside)
        except FileNotFoundError:  # gone already (another node deleted it)
            return False
        try:
            with open(aside, "rb", buffering=0) as f:
                same = _seen_reader(f.read) == seen
        except OSError:
            same = False
        if same:
            os.unlink(aside)
            return True
        try:
            os.link(aside, p)  # back in place, unless a newer page took it: a link never replaces
        except FileExistsError:
            pass  # the newer page stays
        except OSError:  # no hard links here: back by a rename, if nothing took its place
            if not os.path.lexists(p):
                os.rename(aside, p)
                return False
        os.unlink(aside)
        return False

    def _delete_if_same(self, p: str, seen: Seen) -> bool:
        """Stores without an atomic rename aside: read ``p`` again, delete it if it still matches."""
        try:
            with self.fs.open_input_file(p) as f:
                if _seen_reader(f.read) != seen:
                    return False
        except OSError:  # gone, or unreadable: leave it
            return False
        return self._delete_path(p)

    def clear(self) -> None:
        """Delete every page (and temporary file) under the root."""
        self.fs.delete_dir_contents(self.root, missing_dir_ok=True)
        self._dirs.clear()
        with self._index_lock:
            self._index.clear()
            self._index_bytes = 0

    def close(self) -> None:
        self._write_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
