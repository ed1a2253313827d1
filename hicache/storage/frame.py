"""The frame every stored page carries, checked on every read.

Layout (little-endian)::

    magic    4s   b"HKV1"
    version  u16  FRAME_VERSION
    flags    u16  0
    ns       32s  namespace digest (model, revision, layout, TP shard, tenant)
    key      32s  page key
    length   u64  payload bytes
    checksum 32s  XXH3-128 of (ns, key, payload), 16 bytes, zero-padded
    payload  length bytes

The checksum guards against accidental damage (a flipped bit, a truncated or torn write). XXH3 runs at
tens of GB/s per core and releases the GIL, so verifying every read costs little next to a memory copy,
the network or a disk. Foreign pages are caught by the namespace and key fields, which are compared
exactly; that keys name their tokens rests on the sha256 chain (:mod:`hicache.keys`), not on this
checksum. Version 1 frames (blake2b-256 checksums) are refused as unsupported, i.e. read as misses.

A frame whose magic, version, namespace, key, length or checksum does not match is a ``FrameError``:
the caller counts it in ``hicache_storage_corrupt_pages_total`` and treats the page as a miss.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"HKV1"
FRAME_VERSION = 2
_HEADER = struct.Struct("<4sHH32s32sQ32s")
HEADER_BYTES = _HEADER.size


class FrameError(ValueError):
    """A stored page failed verification."""


def _checksum(ns: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    h = xxhash.xxh3_128()
    h.update(ns)
    h.update(key)
    h.update(payload)
    return h.digest().ljust(32, b"\0")


def _pad32(b: bytes) -> bytes:
    if len(b) > 32:
        raise ValueError("frame: namespace digest and key must be at most 32 bytes")
    return b.ljust(32, b"\0")


def encode_header(payload: bytes | memoryview, ns: bytes, key: bytes) -> bytes:
    ns32, key32 = _pad32(ns), _pad32(key)
    return _HEADER.pack(MAGIC, FRAME_VERSION, 0, ns32, key32, len(payload), _checksum(ns32, key32, payload))


def encode_frame(payload: bytes | memoryview, ns: bytes, key: bytes) -> bytes:
    return encode_header(payload, ns, key) + bytes(payload)


def decode_frame(blob: bytes | memoryview, ns: bytes, key: bytes, expected_len: int | None = None) -> memoryview:
    """Verify ``blob`` and return a view of its payload; ``FrameError`` says what did not match."""
    view = memoryview(blob)
    if len(view) < HEADER_BYTES:
        raise FrameError("frame shorter than its header")
    magic, version, _flags, f_ns, f_key, length, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FrameError("bad magic")
    if version != FRAME_VERSION:
        raise FrameError(f"unsupported frame version {version}")
    ns32, key32 = _pad32(ns), _pad32(key)
    if f_ns != ns32:
        raise FrameError("foreign namespace")
    if f_key != key32:
        raise FrameError("key mismatch")
    if length != len(view) - HEADER_BYTES or (expected_len is not None and length != expected_len):
        raise FrameError("payload length mismatch")
    payload = view[HEADER_BYTES:]
    if _checksum(ns32, key32, payload) != checksum:
        raise FrameError("checksum mismatch")
    return payload
