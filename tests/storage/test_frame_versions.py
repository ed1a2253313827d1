"""Frame versions: a page as it is is written as version 4 (a 128-byte header, the payload 64-byte
aligned, the pad checked), and the version 2 frames of earlier releases (a 112-byte header) still read
back byte-exact from every store."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
import xxhash

from hicache.storage.file_backend import FileBackend
from hicache.storage.frame import (
    HEADER_BYTES,
    MAGIC,
    FrameError,
    decode_frame,
    encode_frame,
    header_len,
    newer_format,
    unpack_page,
)
from hicache.storage.memory import MemoryBackend
from storage.conftest import BACKENDS, LAYOUT, NS, make_pool, page_keys, pages_equal
from storage.test_backends import flip_stored_byte

KEY = hashlib.sha256(b"page").digest()
PAGE = LAYOUT.bytes_per_page
PAYLOAD = bytes(range(256)) * 33 + b"tail"
V2_HEADER = 112  # the header of a version 2 frame, as earlier releases wrote it
PAD_AT = range(HEADER_BYTES - 16, HEADER_BYTES)  # version 4's pad: after the checksum field


def v2_frame(payload: bytes, ns: bytes = NS, key: bytes = KEY) -> bytes:
    """A version 2 frame built from the documented layout (not by this release's writer): magic, version
    2, flags 0, ns and key (32 bytes each), payload length (u64), XXH3-128 of (ns, key, payload) padded
    to 32 bytes, then the payload: little-endian, 112 bytes of header."""
    check = xxhash.xxh3_128_digest(ns.ljust(32, b"\0") + key.ljust(32, b"\0") + payload).ljust(32, b"\0")
    head = struct.pack("<4sHH32s32sQ32s", b"HKV1", 2, 0, ns, key, len(payload), check)
    assert len(head) == V2_HEADER
    return head + payload


def test_a_page_as_it_is_is_a_version_4_frame_with_its_payload_64_byte_aligned() -> None:
    frame = encode_frame(PAYLOAD, NS, KEY)
    assert HEADER_BYTES == 128 and HEADER_BYTES % 64 == 0 and header_len(frame) == HEADER_BYTES
    magic, version, flags = struct.unpack_from("<4sHH", frame)
    assert (magic, version, flags) == (MAGIC, 4, 0)
    assert frame[HEADER_BYTES - 32:HEADER_BYTES] == bytes(32)  # the checksum field's zero half, then the pad
    assert frame[HEADER_BYTES:] == PAYLOAD and bytes(decode_frame(frame, NS, KEY)) == PAYLOAD
    # an earlier release (versions 2 and 3) reads it as a later version: a miss it leaves in place
    assert magic == b"HKV1" and version > 3 and not newer_format(frame)


def test_the_file_store_writes_the_payload_at_a_64_byte_aligned_offset(tmp_path: Path, open_backend) -> None:
    b = open_backend(f"file://{tmp_path}")
    src = make_pool(1, seed=7)
    assert b.batch_set([KEY], src, [0]) == 1
    blob = Path(b.path(KEY)).read_bytes()
    assert len(blob) == HEADER_BYTES + PAGE and struct.unpack_from("<H", blob, 4)[0] == 4
    assert blob[HEADER_BYTES:] == src.page_bytes(0)


def test_a_version_2_frame_reads_back_byte_exact() -> None:
    frame = v2_frame(PAYLOAD)
    assert header_len(frame) == V2_HEADER
    assert bytes(decode_frame(frame, NS, KEY, len(PAYLOAD))) == PAYLOAD
    out = bytearray(len(PAYLOAD))
    assert unpack_page(frame, NS, KEY, memoryview(out)) == len(PAYLOAD)
    assert bytes(out) == PAYLOAD
    a, b = bytearray(1000), bytearray(len(PAYLOAD) - 1000)  # a page in pieces
    unpack_page(frame, NS, KEY, [memoryview(a), memoryview(b)])
    assert bytes(a + b) == PAYLOAD


def test_a_version_2_frame_is_still_verified() -> None:
    frame = v2_frame(PAYLOAD)
    for at in (4, 6, 8, 40, 72, 104, 80, 90, V2_HEADER, V2_HEADER + 500, len(frame) - 1):
        bad = bytearray(frame)
        bad[at] ^= 0x01
        with pytest.raises(FrameError):
            unpack_page(bad, NS, KEY, memoryview(bytearray(len(PAYLOAD))))
    with pytest.raises(FrameError):  # cut short
        unpack_page(frame[:-1], NS, KEY, memoryview(bytearray(len(PAYLOAD))))
    with pytest.raises(FrameError):  # another namespace's page
        unpack_page(v2_frame(PAYLOAD, ns=bytes(32)), NS, KEY, memoryview(bytearray(len(PAYLOAD))))


@pytest.mark.parametrize("at", PAD_AT)
def test_a_non_zero_pad_is_damage(at: int) -> None:
    bad = bytearray(encode_frame(PAYLOAD, NS, KEY))
    bad[at] = 0x80
    with pytest.raises(FrameError) as e:
        unpack_page(bad, NS, KEY, memoryview(bytearray(len(PAYLOAD))))
    assert type(e.value) is FrameError  # damage, not a newer format


def put_frame(b: object, key: bytes, blob: bytes) -> None:
    """Store ``blob`` as ``key``'s value, in the store itself."""
    if isinstance(b, MemoryBackend):
        b.put_raw(key, blob)
    elif isinstance(b, FileBackend):
        p = Path(b.path(key))
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(blob)
    else:
        from storage.test_compression import put_raw
        put_raw(b, key, blob)


STORES = [*BACKENDS, pytest.param("file-pyarrow", id="file-pyarrow")]


@pytest.mark.parametrize("backend_url", STORES, indirect=True)
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_a_store_of_an_earlier_release_reads_back_byte_exact(backend_url, open_backend, host_layout) -> None:
    """Pages an earlier release stored (version 2 frames) are hits, byte-exact, not damage; damage in one
    of them is still a counted miss (and dropped)."""
    url, opts = backend_url
    b = open_backend(url, host_layout=host_layout, **opts)
    n = 6
    keys, src = page_keys(n, f"v2-{host_layout}"), make_pool(n, host_layout, seed=11)
    for i, k in enumerate(keys):
        put_frame(b, k, v2_frame(src.page_bytes(i), key=k))
    dst = make_pool(n, host_layout, seed=None)
    assert b.batch_get(keys, dst, list(range(n))) == n
    assert pages_equal(src, dst, list(range(n)), list(range(n)))
    st = b.stats()
    assert st.corrupt_pages == 0 and st.bytes_read == n * PAGE and st.stored_bytes_read == n * PAGE
    flip_stored_byte(b, keys[2], V2_HEADER + 10)  # in the payload
    assert b.batch_get(keys, make_pool(n, host_layout, seed=None), list(range(n))) == 2
    assert b.stats().corrupt_pages == 1
    assert isinstance(b, MemoryBackend) or b.batch_exists(keys[2:3]) == 0  # damage is dropped
    # and a page written now, beside them, is a version 4 frame
    assert b.batch_set(keys[2:3], src, [2]) == 1
    dst = make_pool(n, host_layout, seed=None)
    assert b.batch_get(keys, dst, list(range(n))) == n
    assert pages_equal(src, dst, list(range(n)), list(range(n)))


@pytest.mark.parametrize("backend_url", STORES, indirect=True)
def test_a_non_zero_pad_in_a_store_is_a_counted_miss(backend_url, open_backend) -> None:
    url, opts = backend_url
    b = open_backend(url, **opts)
    keys, src = page_keys(3, "pad"), make_pool(3, seed=12)
    assert b.batch_set(keys, src, [0, 1, 2]) == 3
    flip_stored_byte(b, keys[1], HEADER_BYTES - 1)  # the pad's last byte
    assert b.batch_get(keys, make_pool(3, seed=None), [0, 1, 2]) == 1
    assert b.stats().corrupt_pages == 1
    assert isinstance(b, MemoryBackend) or b.batch_exists(keys[1:2]) == 0  # damage is dropped
