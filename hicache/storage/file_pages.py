"""One page's file in the file store (:mod:`hicache.storage.file_backend`): its name, and its read, write
and conditional delete through ``pyarrow.fs`` (s3, gs, hdfs, a ``filesystem`` object). Local disks and
mounts take :mod:`hicache.storage.file_local_io` instead: the same files, the same results.

Stores: :func:`resolve_store` turns a URL (a plain path, ``file:///...``, or any URI
``pyarrow.fs.FileSystem.from_uri`` takes) into a filesystem and the root directory under it.

Names: a page is ``<root>/<k0>/.../<key hex>.page``, one directory level per ``shard_levels`` (the key's
leading bytes in hex). Temporary files -- a write before its rename, a damaged page taken aside -- are
``.<name>.<pid>.<random>[.del].tmp`` in the page's directory: a page's name never starts with a dot or ends
in ``.tmp``, so a scan of the store tells them apart.

A read returns a :class:`PageRead`: the page verified in its target (a compressed frame -- shorter than
a page's -- verified and decoded into it), or a miss -- and then, where the file is damaged (not a newer
release's frame, not one that changed while it was read) and ``keep`` asks for it, the :data:`Seen` of
what was read, so that a later delete removes that file and never a good page written over it since.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import pyarrow.fs as pafs

from hicache.storage.frame import (
    HEADER_BYTES,
    PACKED_HEADER_BYTES,
    FrameError,
    NewerFormat,
    PageBuf,
    encode_header,
    newer_format,
    page_parts,
    plain_header_len,
    unpack_page,
)

PAGE_SUFFIX = ".page"
TMP_SUFFIX = ".tmp"
Seen = tuple[int, bytes]  # a damaged file as read: its length and SHA1 (hex)


@dataclass(frozen=True, slots=True)
class PageRead:
    """What reading one page's file found: ``ok`` (verified in the target; ``stored``: the payload bytes
    of a compressed frame, 0 for a whole page) or a miss (``seen``: a damaged file to delete if it is still
    this one)."""

    ok: bool = False
    stored: int = 0
    seen: Seen | None = None


VERIFIED = PageRead(ok=True)
KEPT = PageRead()  # not a page: left in place


def resolve_store(url: str, filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    """The filesystem and root directory a store URL names (``filesystem``: use that one, the URL's path
    is the root); ``ValueError`` for a URL that names none."""
    scheme = urlparse(url).scheme
    if filesystem is not None:
        return filesystem, urlparse(url).path.rstrip("/") if scheme else url.rstrip("/")
    if scheme in ("", "file"):
        host = urlparse(url).netloc
        if scheme == "file" and host not in ("", "localhost"):
            # file://relative/x would otherwise mean /x on this machine
            raise ValueError(f"file store: {url!r} names host {host!r}; use file:///absolute/path")
        path = urlparse(url).path if scheme == "file" else url
        if not path:
            raise ValueError(f"file store: no path in {url!r}")
        return pafs.LocalFileSystem(), os.path.abspath(path)
    fs, root = pafs.FileSystem.from_uri(url)
    return fs, root.rstrip("/")


def page_path(root: str, shard_levels: int, key: bytes) -> str:
    h = key.hex()
    shards = [h[2 * i : 2 * i + 2] for i in range(shard_levels)]
    return "/".join([root, *shards, h + PAGE_SUFFIX])


def temp_path(d: str, name: str, kind: str = "") -> str:
    """A private temporary file for ``name`` in directory ``d`` (``kind``: ``".del"`` for one taken aside)."""
    return f"{d}/.{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{kind}{TMP_SUFFIX}"


def seen_of(*parts: bytes | bytearray | memoryview) -> Seen:
    h = hashlib.sha1(usedforsecurity=False)
    for p in parts:
        h.update(p)
    return sum(len(p) for p in parts), h.hexdigest().encode()


def seen_reader(read: Callable[[int], bytes]) -> Seen:
    """:func:`seen_of` everything ``read`` returns from where it stands to the end."""
    h = hashlib.sha1(usedforsecurity=False)
    n = 0
    while chunk := read(1 << 20):
        h.update(chunk)
        n += len(chunk)
    return n, h.hexdigest().encode()


def scan_store(fs: pafs.FileSystem, root: str) -> tuple[list[tuple[float, str, int]], list[tuple[float, str]]]:
    """Every page file under ``root`` as (mtime, path, bytes), oldest first; every temporary file as
    (mtime, path)."""
    pages: list[tuple[float, str, int]] = []
    temps: list[tuple[float, str]] = []
    for fi in fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True)):
        if fi.type != pafs.FileType.File:
            continue
        mtime = fi.mtime.timestamp() if fi.mtime is not None else 0.0
        if fi.base_name.endswith(TMP_SUFFIX):
            temps.append((mtime, fi.path))
        elif fi.base_name.endswith(PAGE_SUFFIX):
            pages.append((mtime, fi.path, int(fi.size or 0)))
    pages.sort()
    return pages, temps


def unpacked(blob: bytes | bytearray, dst: PageBuf, ns: bytes, key: bytes, keep: bool) -> PageRead:
    """A frame shorter than a plain one (a compressed page, or damage), verified and decoded into ``dst``."""
    try:
        stored = unpack_page(blob, ns, key, dst)
    except NewerFormat:  # a newer release's page: a miss, left in place
        return KEPT
    except FrameError:
        return PageRead(seen=seen_of(blob)) if keep else KEPT
    return PageRead(ok=True, stored=stored)


def unverified(header: bytes | bytearray, dst: PageBuf, got: int, page_bytes: int, keep: bool) -> PageRead:
    """A full-size frame that failed verification. A short read (the file changed under us) or a newer
    release's frame is kept; damage is noted for the delete when ``keep``."""
    if keep and got == page_bytes and not newer_format(header):
        return PageRead(seen=seen_of(header, *page_parts(dst)))
    return KEPT


def read_arrow(fs: pafs.FileSystem, p: str, dst: PageBuf, ns: bytes, key: bytes, page_bytes: int,
               keep: bool) -> PageRead:
    """Read page file ``p`` into ``dst`` and verify it."""
    with fs.open_input_file(p) as f:
        size = f.size()
        hlen = plain_header_len(size, page_bytes)  # a page as it is (version 4, or 2 of an earlier release)
        if hlen is None and PACKED_HEADER_BYTES < size < HEADER_BYTES + page_bytes:
            return unpacked(f.read(), dst, ns, key, keep)
        if hlen is None:
            if keep and not newer_format(f.read_at(HEADER_BYTES, 0)):
                f.seek(0)
                return PageRead(seen=seen_reader(f.read))
            return KEPT
        header = f.read(hlen)
        got = sum(f.readinto(part) for part in page_parts(dst))
    if got == page_bytes and encode_header(dst, ns, key, hlen) == header:
        return VERIFIED
    return unverified(header, dst, got, page_bytes, keep)


def write_arrow(fs: pafs.FileSystem, target: str, final: str, header: bytes, payload: PageBuf) -> None:
    """Write a frame to ``target``, then move it to ``final`` unless that is where it was written."""
    with fs.open_output_stream(target) as out:
        out.write(header)
        for part in page_parts(payload):
            out.write(part)
    if target != final:
        fs.move(target, final)


def still_same(fs: pafs.FileSystem, p: str, seen: Seen) -> bool:
    """Whether ``p`` is still the damaged file read (read again: stores without an atomic rename aside)."""
    try:
        with fs.open_input_file(p) as f:
            return seen_reader(f.read) == seen
    except OSError:  # gone, or unreadable: leave it
        return False
