"""The frame every stored page carries, checked on every read.

Layout (little-endian)::

    magic    4s   b"HKV1"
    version  u16  4 (the page as it is), 3 (the page compressed) or 2 (the page as it is, earlier releases)
    flags    u16  0 (versions 2 and 4); version 3: codec id (low byte) | shuffle element size << 8
    ns       32s  namespace digest (model, revision, layout, TP shard, tenant)
    key      32s  page key
    length   u64  payload bytes (as stored)
    checksum 32s  XXH3-128 of (ns, key, payload), 16 bytes; versions 2 and 4: zero-padded; version 3: then
                  the XXH3-128 of the decompressed page
    pad      16s  version 4 only: zero bytes (a header of 128 bytes; versions 2 and 3 have no pad: 112)
    payload  length bytes

A page as it is is written as a version 4 frame: its header is padded to 128 bytes, so the payload starts
at a 64-byte aligned offset in a page file, as the host pool's pages are aligned in memory (the kernel's
copy out of the page cache costs less CPU when source and destination agree mod 64; figures in
benchmarks/results/cpu/README.md). The pad is checked: a non-zero byte there is damage. Version 2 frames
(the same page, a 112-byte header, written by earlier releases) are still read and verified the same way;
this release does not write them. A release before version 4 reads a version 4 frame as a later version
(below): a miss it leaves in place.

Version 3 frames hold a page compressed by a lossless codec (:mod:`hicache.storage.page_codec`); they are
written only when compression saves space, so a store holds pages of both kinds. The first checksum guards the
stored bytes (damage is caught before anything is decompressed), the second the page they decode to, so
a codec that decoded wrongly could not hand out a wrong page either. Readers decode whatever codec a
frame names, whatever their own ``storage.compression``.

The checksum guards against accidental damage (a flipped bit, a truncated or torn write). XXH3 runs at
tens of GB/s per core and releases the GIL, so verifying every read costs little next to a memory copy,
the network or a disk. Foreign pages are caught by the namespace and key fields, which are compared
exactly; that keys name their tokens rests on the sha256 chain (:mod:`hicache.keys`), not on this
checksum. Version 1 frames (blake2b-256 checksums) are refused as unsupported, i.e. read as misses.

A frame whose magic, version, namespace, key, length or checksum does not match is a ``FrameError``:
the caller counts it in ``hicache_storage_corrupt_pages_total`` and treats the page as a miss. A frame of
a later version, or of a codec this release does not have, is a ``NewerFormat``: a miss counted the same
way, but one the stores leave in place (a newer release shares the store), where they delete damage.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from hicache.storage.page_codec import PageCodec, codec_for_id, codec_ids

MAGIC = b"HKV1"
FRAME_VERSION = 4  # a page as it is (written), header padded to 128 bytes
PACKED_VERSION = 3  # a page compressed
LEGACY_VERSION = 2  # a page as it is, 112-byte header (earlier releases; read, not written)
NEWEST_VERSION = FRAME_VERSION  # a frame of a later version is a NewerFormat
_HEADER = struct.Struct("<4sHH32s32sQ32s")  # versions 2 and 3
_PLAIN_HEADER = struct.Struct("<4sHH32s32sQ32s16s")  # version 4
HEADER_BYTES = _PLAIN_HEADER.size  # 128: the header of a page stored as it is (version 4)
PACKED_HEADER_BYTES = _HEADER.size  # 112: versions 2 and 3
_PAD = bytes(HEADER_BYTES - PACKED_HEADER_BYTES)
assert HEADER_BYTES % 64 == 0


class FrameError(ValueError):
    """A stored page failed verification."""


class NewerFormat(FrameError):
    """A frame of a format this release does not know: a later version, or (its stored bytes intact) a
    codec it does not have -- written by a newer release sharing the store. A miss like any frame that
    fails verification, but not damage: a store never deletes it (the page's next write replaces it)."""


Buffer = bytes | bytearray | memoryview
# One page's bytes: contiguous, or its pieces in order (an engine's host pool may keep a page's K and V, or
# its layers, apart; the frame's payload is their concatenation, written and read without joining them).
PageBuf = Buffer | Sequence[memoryview]


def page_parts(page: PageBuf) -> Sequence[Buffer]:
    """``page``'s pieces in order (a contiguous page is one piece)."""
    return page if isinstance(page, (list, tuple)) else (page,)  # type: ignore[return-value]


def page_len(page: PageBuf) -> int:
    """Bytes of ``page``, all pieces together."""
    if isinstance(page, (list, tuple)):
        return sum(len(p) for p in page)
    return len(page)  # type: ignore[arg-type]


def join_page(page: PageBuf) -> Buffer:
    """``page`` as one contiguous buffer (no copy when it is one piece)."""
    parts = page_parts(page)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def scatter(src: Buffer, dst: PageBuf) -> None:
    """Copy ``src`` (exactly ``page_len(dst)`` bytes) into ``dst``'s pieces in order."""
    view, off = memoryview(src), 0
    for part in page_parts(dst):
        n = len(part)
        part[:] = view[off:off + n]  # type: ignore[index]
        off += n


def newer_format(header: bytes | bytearray | memoryview) -> bool:
    """``header`` (a frame's first bytes) starts a frame of a later version than this release knows."""
    if len(header) < 6:
        return False
    magic, version = struct.unpack_from("<4sH", header)
    return bool(magic == MAGIC and version > NEWEST_VERSION)


def header_len(frame: bytes | bytearray | memoryview) -> int:
    """The header bytes of ``frame`` (its first bytes at least), by its version: where its payload starts.
    A frame of an unknown version, or too short to say, counts as this release's plain frame."""
    if len(frame) >= 6 and struct.unpack_from("<4sH", frame) in ((MAGIC, LEGACY_VERSION), (MAGIC, PACKED_VERSION)):
        return PACKED_HEADER_BYTES
    return HEADER_BYTES


def plain_header_len(size: int, page_bytes: int) -> int | None:
    """The header bytes of a page stored as it is in a frame of ``size`` bytes (``page_bytes`` a page):
    :data:`HEADER_BYTES` (version 4) or :data:`PACKED_HEADER_BYTES` (version 2, earlier releases; a
    version 3 frame is always shorter); ``None`` when no plain frame has that size."""
    if size == HEADER_BYTES + page_bytes:
        return HEADER_BYTES
    if size == PACKED_HEADER_BYTES + page_bytes:
        return PACKED_HEADER_BYTES
    return None


def _checksum(ns: bytes, key: bytes, payload: PageBuf, pad: bool = True) -> bytes:
    h = xxhash.xxh3_128()
    h.update(ns)
    h.update(key)
    for part in page_parts(payload):
        h.update(part)
    return h.digest().ljust(32, b"\0") if pad else h.digest()


def _pad32(b: bytes) -> bytes:
    if len(b) > 32:
        raise ValueError("frame: namespace digest and key must be at most 32 bytes")
    return b.ljust(32, b"\0")


def _names(f_ns: bytes, f_key: bytes, ns: bytes, key: bytes) -> tuple[bytes, bytes]:
    """``(ns, key)`` padded as frames hold them, once the frame's own fields are checked against them."""
    ns32, key32 = _pad32(ns), _pad32(key)
    if f_ns != ns32:
        raise FrameError("foreign namespace")
    if f_key != key32:
        raise FrameError("key mismatch")
    return ns32, key32


def _plain(ns32: bytes, key32: bytes, length: int, check: bytes, hlen: int) -> bytes:
    """The header of a page as it is: version 4 (``hlen`` :data:`HEADER_BYTES`), or version 2 (the
    112-byte header of earlier releases, to compare one read with)."""
    if hlen == HEADER_BYTES:
        return _PLAIN_HEADER.pack(MAGIC, FRAME_VERSION, 0, ns32, key32, length, check, _PAD)
    return _HEADER.pack(MAGIC, LEGACY_VERSION, 0, ns32, key32, length, check)


def encode_header(payload: PageBuf, ns: bytes, key: bytes, hlen: int = HEADER_BYTES) -> bytes:
    """The header of ``payload`` (a page as it is, contiguous or in pieces): version 4, the one written;
    ``hlen`` :data:`PACKED_HEADER_BYTES`: version 2's, to compare a frame of an earlier release with."""
    ns32, key32 = _pad32(ns), _pad32(key)
    return _plain(ns32, key32, page_len(payload), _checksum(ns32, key32, payload), hlen)


def payload_hasher(ns: bytes, key: bytes) -> xxhash.xxh3_128:
    """The checksum of a plain frame (version 4 or 2) of ``(ns, key)``, its payload still to be fed in
    order (``update``): a reader hashes each piece of a page as it lands, while it is in the CPU's cache,
    not in a second pass over the whole page. :func:`header_of` then gives the header to compare with the
    one read."""
    h = xxhash.xxh3_128()
    h.update(_pad32(ns))
    h.update(_pad32(key))
    return h


def header_of(hasher: xxhash.xxh3_128, ns: bytes, key: bytes, length: int, hlen: int = HEADER_BYTES) -> bytes:
    """The header of a ``length``-byte payload fed whole to ``hasher`` (:func:`payload_hasher`); the same
    bytes as :func:`encode_header` of that payload (``hlen`` as there)."""
    return _plain(_pad32(ns), _pad32(key), length, hasher.digest().ljust(32, b"\0"), hlen)


def encode_frame(payload: PageBuf, ns: bytes, key: bytes) -> bytes:
    return encode_header(payload, ns, key) + b"".join(page_parts(payload))


def decode_frame(blob: bytes | memoryview, ns: bytes, key: bytes, expected_len: int | None = None) -> memoryview:
    """Verify ``blob``, a page as it is (version 4, or 2 of an earlier release), and return a view of its
    payload; ``FrameError`` says what did not match."""
    view = memoryview(blob)
    if len(view) < 6:
        raise FrameError("frame shorter than its header")
    magic, version = struct.unpack_from("<4sH", view)
    if magic != MAGIC:
        raise FrameError("bad magic")
    if version not in (FRAME_VERSION, LEGACY_VERSION):
        raise FrameError(f"unsupported frame version {version}")
    hlen = HEADER_BYTES if version == FRAME_VERSION else PACKED_HEADER_BYTES
    if len(view) < hlen:
        raise FrameError("frame shorter than its header")
    if version == FRAME_VERSION:
        _, _, flags, f_ns, f_key, length, checksum, pad = _PLAIN_HEADER.unpack_from(view)
        if pad != _PAD:  # (the pad is zero: anything else is damage)
            raise FrameError("non-zero header pad")
    else:
        _, _, flags, f_ns, f_key, length, checksum = _HEADER.unpack_from(view)
    if flags:  # (no flag is defined for a page stored as it is: a set bit is damage)
        raise FrameError(f"unknown flags {flags:#x}")
    ns32, key32 = _names(f_ns, f_key, ns, key)
    if length != len(view) - hlen or (expected_len is not None and length != expected_len):
        raise FrameError("payload length mismatch")
    payload = view[hlen:]
    if _checksum(ns32, key32, payload) != checksum:
        raise FrameError("checksum mismatch")
    return payload


def pack_page(page: PageBuf, ns: bytes, key: bytes, codec: PageCodec | None, elem: int
              ) -> tuple[bytes, PageBuf]:
    """The frame of one page as (header, payload): compressed by ``codec`` (shuffled by ``elem``-byte
    elements) into a version 3 frame when that saves space, else the page as it is (version 4, the
    payload is ``page`` itself, contiguous or in pieces, no copy)."""
    if codec is None or not codec.codec_id:
        return encode_header(page, ns, key), page
    whole = join_page(page)
    stored = codec.compress(memoryview(whole), elem)
    if stored is None:
        return encode_header(page, ns, key), page
    ns32, key32 = _pad32(ns), _pad32(key)
    flags = codec.codec_id | (elem << 8)
    check = _checksum(ns32, key32, stored, pad=False) + xxhash.xxh3_128_digest(whole)
    return _HEADER.pack(MAGIC, PACKED_VERSION, flags, ns32, key32, len(stored), check), stored


def unpack_page(blob: bytes | bytearray | memoryview, ns: bytes, key: bytes, dst: PageBuf) -> int:
    """Verify the frame ``blob`` (any version this release reads) and write the page it holds into ``dst``
    (exactly one page, contiguous or in pieces); returns its payload bytes as stored. ``FrameError`` says
    what did not match. ``dst`` is undefined after an error."""
    view = memoryview(blob)
    if len(view) < 6:
        raise FrameError("frame shorter than its header")
    magic, version = struct.unpack_from("<4sH", view)
    size = page_len(dst)
    if magic == MAGIC and version in (FRAME_VERSION, LEGACY_VERSION):
        payload = decode_frame(view, ns, key, size)
        scatter(payload, dst)
        return len(payload)
    if magic != MAGIC:
        raise FrameError("bad magic")
    if version > NEWEST_VERSION:
        raise NewerFormat(f"frame version {version} (this release reads {LEGACY_VERSION} to {NEWEST_VERSION})")
    if version != PACKED_VERSION:
        raise FrameError(f"unsupported frame version {version}")
    if len(view) < PACKED_HEADER_BYTES:
        raise FrameError("frame shorter than its header")
    _, _, flags, f_ns, f_key, length, checksum = _HEADER.unpack_from(view)
    ns32, key32 = _names(f_ns, f_key, ns, key)
    if length != len(view) - PACKED_HEADER_BYTES or length >= size:
        raise FrameError("payload length mismatch")
    payload = view[PACKED_HEADER_BYTES:]
    if _checksum(ns32, key32, payload, pad=False) != checksum[:16]:
        raise FrameError("checksum mismatch")
    try:
        codec = codec_for_id(flags & 0xFF)
    except ValueError:
        raise NewerFormat(f"codec id {flags & 0xFF} (this release has {codec_ids()})") from None
    parts = page_parts(dst)
    out = parts[0] if len(parts) == 1 else memoryview(bytearray(size))
    try:
        codec.decompress_into(payload, flags >> 8, out)  # type: ignore[arg-type]
    except ValueError as e:
        raise FrameError(f"undecodable page ({e})") from None
    if xxhash.xxh3_128_digest(out) != checksum[16:]:
        raise FrameError("decoded page checksum mismatch")
    if out is not parts[0]:
        scatter(out, dst)
    return length
