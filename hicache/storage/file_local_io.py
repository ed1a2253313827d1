"""The file store's fast path for local disks and mounts: a page's file read, written and deleted through
``os`` (``readv`` / ``writev`` straight into / out of the host pages), the same files and results as the
``pyarrow.fs`` path (:mod:`hicache.storage.file_pages`).

Reads: a page is read in pieces of :data:`READ_CHUNK`, each fed to the page's checksum as soon as it
lands, while it is still in the CPU's cache: verifying costs no second pass over the page from memory. A
page written by this release (a version 4 frame) starts at file offset 128, 64-byte aligned as the host
pool's pages are, which makes the kernel's copy out of the page cache cheaper than from the 112-byte
header's offset of a version 2 frame (still read, its header read as 112 bytes). Figures:
``benchmarks/results/cpu/README.md``.

Writes: the frame goes to ``target`` and is renamed to ``final`` (atomic), so a reader sees the whole page
or none of it.

Deleting a damaged page (:func:`delete_aside`): the file is renamed aside to a private
``.<name>.<pid>.<random>.del.tmp`` (atomic), so what is compared with the file read is what gets deleted.
A file that is not the one read goes back with a hard link, which never replaces a newer page written
meanwhile; where the filesystem has no hard links, by a rename when nothing took its place (a window of
one ``lstat``). While it is aside the page reads as a miss.
"""

from __future__ import annotations

import os

import xxhash

from hicache.storage.file_pages import (
    KEPT,
    VERIFIED,
    PageRead,
    Seen,
    seen_reader,
    temp_path,
    unpacked,
    unverified,
)
from hicache.storage.frame import (
    HEADER_BYTES,
    PACKED_HEADER_BYTES,
    PageBuf,
    header_of,
    newer_format,
    page_len,
    page_parts,
    payload_hasher,
    plain_header_len,
)

READ_CHUNK = 1 << 20


def read_hashing(fd: int, header: bytearray, dst: PageBuf, hasher: xxhash.xxh3_128) -> int:
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
                k -= len(header)
                if k < 0:
                    return 0
            if k:
                hasher.update(piece[:k])
            got += k
            if k < len(piece):
                return got
    return got


def read_local(p: str, dst: PageBuf, ns: bytes, key: bytes, page_bytes: int, keep: bool) -> PageRead:
    """Read page file ``p`` into ``dst`` and verify it."""
    fd = os.open(p, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        hlen = plain_header_len(size, page_bytes)  # a page as it is (version 4, or 2 of an earlier release)
        if hlen is None and PACKED_HEADER_BYTES < size < HEADER_BYTES + page_bytes:
            blob = bytearray(size)
            if os.readv(fd, [blob]) != size:
                return KEPT  # (the file changed under us)
            return unpacked(blob, dst, ns, key, keep)
        if hlen is None:
            if keep and not newer_format(os.pread(fd, HEADER_BYTES, 0)):
                return PageRead(seen=seen_reader(lambda k: os.read(fd, k)))
            return KEPT
        header = bytearray(hlen)
        hasher = payload_hasher(ns, key)
        got = read_hashing(fd, header, dst, hasher)
        ok = got == page_bytes and header_of(hasher, ns, key, got, hlen) == header
    finally:
        os.close(fd)
    return VERIFIED if ok else unverified(header, dst, got, page_bytes, keep)


def write_local(target: str, final: str, header: bytes, payload: PageBuf) -> None:
    """Write a frame to ``target``, then rename it to ``final`` unless that is where it was written."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if os.writev(fd, [header, *page_parts(payload)]) != len(header) + page_len(payload):
            raise OSError(f"short write to {target}")
    finally:
        os.close(fd)
    if target != final:
        os.rename(target, final)


def delete_aside(p: str, seen: Seen) -> bool:
    """Rename ``p`` aside, delete it if it is what was read, else put it back; whether it was deleted."""
    d, name = p.rsplit("/", 1)
    aside = temp_path(d, name, ".del")
    try:
        os.rename(p, aside)
    except FileNotFoundError:  # gone already (another node deleted it)
        return False
    try:
        with open(aside, "rb", buffering=0) as f:
            same = seen_reader(f.read) == seen
    except OSError:
        same = False
    if same:
        os.unlink(aside)
        return True
    try:
        os.link(aside, p)  # a link never replaces a newer page that took its place
    except FileExistsError:
        pass  # the newer page stays
    except OSError:  # no hard links here
        if not os.path.lexists(p):
            os.rename(aside, p)
            return False
    os.unlink(aside)
    return False
