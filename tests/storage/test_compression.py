"""Lossless L3 compression (``storage.compression``): bit-exact round trips through every backend and
codec, readers that decode whatever a frame names, and damaged or forged compressed frames as misses."""

from __future__ import annotations

import hashlib
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache import HiCache
from hicache.config import ConfigError, load_config
from hicache.layout import KVLayout
from hicache.pool import HostPool
from hicache.storage.file_backend import FileBackend
from hicache.storage.frame import (
    _HEADER,
    FRAME_VERSION,
    HEADER_BYTES,
    MAGIC,
    NEWEST_VERSION,
    PACKED_HEADER_BYTES,
    PACKED_VERSION,
    FrameError,
    NewerFormat,
    newer_format,
    pack_page,
    unpack_page,
)
from hicache.storage.memory import MemoryBackend
from hicache.storage.page_codec import MIN_SAVING, codec_names, make_codec, shuffle, unshuffle_into
from hicache.storage.redis_backend import RedisBackend
from kvhelpers import commit_fresh, kv_equal, read_kv, small_config
from storage.conftest import BACKENDS, NS, needs_redis, page_keys, pages_equal
from storage.test_backends import flip_stored_byte
from tcpproxy import TcpProxy

CODECS = ["zstd", "lz4"]
KEY = hashlib.sha256(b"page").digest()
# bf16 pages of 4 KiB: large enough for a codec's framing to be small next to what it saves
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", page_size=4)
PAGE = LAYOUT.bytes_per_page


def kv_like(n_bytes: int, seed: int, elem: int = 2) -> bytes:
    """Bytes shaped like a KV page: values of a few magnitudes (compressible high bytes, noisy low ones)."""
    rng = np.random.default_rng(seed)
    if elem == 1:
        return rng.integers(0, 4, n_bytes, dtype=np.uint8).tobytes()
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[elem]
    x = torch.from_numpy(rng.standard_normal(n_bytes // elem)) * 0.5
    return x.to(dtype).view(torch.uint8).numpy().tobytes()


def kv_pool(n: int, seed: int, host_layout: str = "page_first", incompressible: tuple[int, ...] = ()) -> HostPool:
    pool = HostPool(LAYOUT, n, host_layout)  # type: ignore[arg-type]
    for i in range(n):
        data = np.random.default_rng(seed + i).bytes(PAGE) if i in incompressible else kv_like(PAGE, seed + i)
        pool.write_page_bytes(i, data)
    return pool


def empty_pool(n: int, host_layout: str = "page_first") -> HostPool:
    pool = HostPool(LAYOUT, n, host_layout)  # type: ignore[arg-type]
    pool.buffer.view(torch.uint8).zero_()
    return pool


# ----------------------------------------------------------------------------------------- frames


@settings(max_examples=60, deadline=None)
@given(codec=st.sampled_from(CODECS), elem=st.sampled_from([1, 2, 4, 8]), words=st.integers(1, 600),
       seed=st.integers(0, 2**32 - 1), noise=st.booleans())
def test_any_page_round_trips_bit_exact(codec: str, elem: int, words: int, seed: int, noise: bool) -> None:
    n = words * 8  # whole elements of every size
    page = np.random.default_rng(seed).bytes(n) if noise else kv_like(n, seed, elem)
    header, payload = pack_page(memoryview(page), NS, KEY, make_codec(codec), elem)
    version = struct.unpack_from("<H", header, 4)[0]
    if version == PACKED_VERSION:
        assert len(payload) <= n * (1 - MIN_SAVING)  # stored compressed only where it saves space
    else:
        assert version == FRAME_VERSION and bytes(payload) == page  # stored as it is
    out = bytearray(n)
    unpack_page(header + bytes(payload), NS, KEY, memoryview(out))
    assert bytes(out) == page


@pytest.mark.parametrize("codec", CODECS)
def test_kv_pages_are_stored_smaller_and_noise_as_it_is(codec: str) -> None:
    page = kv_like(PAGE, 1)
    header, payload = pack_page(memoryview(page), NS, KEY, make_codec(codec), 2)
    assert _HEADER.unpack(header)[1] == PACKED_VERSION and len(payload) <= PAGE * (1 - MIN_SAVING)
    low, high = struct.unpack_from("<2I", payload)  # bf16: the low bytes are noise, kept as they are
    assert low == PAGE // 2 | 1 << 31 and high < PAGE // 2
    noise = np.random.default_rng(2).bytes(PAGE)
    header, payload = pack_page(memoryview(noise), NS, KEY, make_codec(codec), 2)
    assert _HEADER.unpack_from(header)[1] == FRAME_VERSION and payload.obj is noise if isinstance(payload, memoryview) \
        else payload == noise


def test_planes_of_noise_are_not_tried_again_but_on_probe_pages() -> None:
    codec = make_codec("zstd")
    tried: list[int] = []
    inner = codec._codec  # type: ignore[attr-defined]

    class Counting:
        def compress(self, data: object, asbytes: bool = False) -> bytes:
            tried.append(len(memoryview(data)))  # type: ignore[arg-type]
            return inner.compress(data, asbytes=asbytes)

        def decompress(self, data: object, decompressed_size: int) -> object:
            return inner.decompress(data, decompressed_size=decompressed_size)

    codec._codec = Counting()  # type: ignore[attr-defined]
    skip, every = codec.SKIP_AFTER, codec.PROBE_EVERY  # type: ignore[attr-defined]
    kv = kv_like(PAGE, 50)
    for i in range(1, every + 1):  # pages of KV: the low-byte plane is noise, the high one compresses
        tried.clear()
        stored = codec.compress(memoryview(kv), 2)
        assert stored is not None
        out = bytearray(PAGE)
        codec.decompress_into(memoryview(stored), 2, memoryview(out))
        assert bytes(out) == kv
        assert len(tried) == (1 if skip < i < every else 2), i  # the noise plane: tried until skipped, then probed
    noise = np.random.default_rng(1).bytes(PAGE)
    for _ in range(skip):
        assert codec.compress(memoryview(noise), 2) is None  # the high plane turns raw too ...
    tried.clear()
    assert codec.compress(memoryview(kv), 2) is None and not tried  # ... and both are skipped: stored as it is
    while codec._pages % every:  # type: ignore[attr-defined]
        codec.compress(memoryview(noise), 2)
    # (that was the probe page, of noise) -- the next probe tries again and KV compresses again
    for _ in range(every - 1):
        codec.compress(memoryview(noise), 2)
    assert codec.compress(memoryview(kv), 2) is not None


@pytest.mark.parametrize("elem", [2, 4, 8])
def test_shuffle_and_unshuffle_are_inverse(elem: int) -> None:
    page = np.random.default_rng(elem).bytes(64 * elem)
    planes = shuffle(memoryview(page), elem)
    assert planes.reshape(elem, -1)[1].tobytes() == page[1::elem]  # plane k: byte k of every element
    out = bytearray(len(page))
    unshuffle_into(planes, elem, memoryview(out))
    assert bytes(out) == page


def _frame(codec: str = "zstd", seed: int = 3) -> bytes:
    page = kv_like(PAGE, seed)
    header, payload = pack_page(memoryview(page), NS, KEY, make_codec(codec), 2)
    assert _HEADER.unpack(header)[1] == PACKED_VERSION
    return header + bytes(payload)


@settings(max_examples=80, deadline=None)
@given(codec=st.sampled_from(CODECS), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_bit_of_a_compressed_frame_is_refused(codec: str, where: float, bit: int) -> None:
    blob = bytearray(_frame(codec))
    blob[int(where * len(blob))] ^= 1 << bit
    with pytest.raises(FrameError):
        unpack_page(blob, NS, KEY, memoryview(bytearray(PAGE)))


@pytest.mark.parametrize("codec", CODECS)
def test_every_flipped_header_bit_is_refused(codec: str) -> None:
    """Flags too: a bit the decoder would ignore is damage all the same (every header bit is checked)."""
    frame = _frame(codec)
    raw = pack_page(memoryview(np.random.default_rng(0).bytes(PAGE)), NS, KEY, make_codec(codec), 2)
    for blob in (frame, raw[0] + bytes(raw[1])):  # a compressed frame, and a page stored as it is
        for i in range(HEADER_BYTES):
            for bit in range(8):
                bad = bytearray(blob)
                bad[i] ^= 1 << bit
                with pytest.raises(FrameError):
                    unpack_page(bad, NS, KEY, memoryview(bytearray(PAGE)))


def _forge(stored: bytes, flags: int, decoded_check: bytes, ns: bytes = NS, key: bytes = KEY) -> bytes:
    """A version 3 frame whose stored bytes carry a valid checksum, whatever they decode to."""
    h = xxhash.xxh3_128()
    for part in (ns, key, stored):
        h.update(part)
    return _HEADER.pack(MAGIC, PACKED_VERSION, flags, ns, key, len(stored), h.digest() + decoded_check) + stored


def test_forged_frames_with_valid_stored_checksums_are_refused() -> None:
    page = kv_like(PAGE, 4)
    zstd = make_codec("zstd")
    real = zstd.compress(memoryview(page), 2)
    assert real is not None
    good = xxhash.xxh3_128_digest(page)
    dst = memoryview(bytearray(PAGE))
    unpack_page(_forge(real, 1 | 2 << 8, good), NS, KEY, dst)  # the forger's frame itself decodes
    assert bytes(dst) == page
    cases = {
        "decoded page checksum mismatch": _forge(zstd.compress(memoryview(kv_like(PAGE, 5)), 2) or b"", 1 | 2 << 8,
                                                 good),  # another page's stream under this page's checksum
        "undecodable page": _forge(real, 1 | 4 << 8, good),  # another shuffle: another plane table
        "codec id 9": _forge(real, 9 | 2 << 8, good),  # a codec this release lacks (NewerFormat)
        "bad shuffle element size": _forge(real, 1 | 3 << 8, good),
        "payload length mismatch": _forge(b"\0" * PAGE, 1 | 2 << 8, good),  # not smaller than a page
    }
    # planes whose LZ4 streams decode to fewer bytes than a plane: the codec pads its output to the size
    # asked, so only the checksum of the decoded page can catch it
    lz4 = make_codec("lz4")._codec  # type: ignore[attr-defined]
    planes = shuffle(memoryview(page), 2).reshape(2, -1)
    short = [lz4.compress(p[:-32].tobytes(), asbytes=True) for p in planes]
    cases["decoded page checksum mismatch "] = _forge(struct.pack("<2I", *map(len, short)) + b"".join(short),
                                                      2 | 2 << 8, good)
    for what, blob in cases.items():
        with pytest.raises(FrameError) as e:
            unpack_page(blob, NS, KEY, memoryview(bytearray(PAGE)))
        assert what.strip() in str(e.value), (what, str(e.value))
    with pytest.raises(FrameError, match="foreign namespace"):
        unpack_page(_forge(real, 1 | 2 << 8, good, ns=bytes(32)), NS, KEY, memoryview(bytearray(PAGE)))
    with pytest.raises(FrameError, match="key mismatch"):
        unpack_page(_forge(real, 1 | 2 << 8, good, key=bytes(32)), NS, KEY, memoryview(bytearray(PAGE)))


def test_codec_names_and_bad_settings_are_clear_errors() -> None:
    assert {"none", "zstd", "lz4"} <= set(codec_names())
    with pytest.raises(ValueError, match=r"storage\.compression: unknown codec 'brotli'"):
        make_codec("brotli")
    with pytest.raises(ValueError, match=r"storage\.compression_level: must be in \[-7, 22\]"):
        make_codec("zstd", 50)
    with pytest.raises(ConfigError, match=r"storage\.compression"):
        load_config(overrides={"storage": {"compression": "brotli"}})
    with pytest.raises(ConfigError, match=r"storage\.compression_level"):
        load_config(overrides={"storage": {"compression": "zstd", "compression_level": 99}})


# ----------------------------------------------------------------------------------------- backends


@pytest.mark.parametrize("backend_url", BACKENDS, indirect=True)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_compressed_pages_round_trip_through_every_backend_and_any_reader(backend_url, open_backend, codec: str,
                                                                          host_layout: str) -> None:
    url, opts = backend_url
    writer = open_backend(url, layout=LAYOUT, host_layout=host_layout, compression=codec, **opts)
    n = 24
    src = kv_pool(n, 10, host_layout, incompressible=(5, 6, 17))  # both kinds of frame in one batch
    keys = page_keys(n, f"c-{codec}-{host_layout}")
    assert writer.batch_set(keys, src, list(range(n))) == n
    ws = writer.stats()
    assert ws.bytes_written == n * PAGE
    assert ws.stored_bytes_written <= ((n - 3) * (1 - MIN_SAVING) + 3) * PAGE  # KV-like pages shrink ...
    assert ws.stored_bytes_written > 3 * PAGE  # ... and the three of noise were stored as they are
    for reader_codec in ("none", "zstd" if codec == "lz4" else "lz4"):  # readers decode whatever frames name
        if url == "memory://":
            reader = writer
        else:
            reader = open_backend(url, layout=LAYOUT, host_layout=host_layout, compression=reader_codec, **opts)
        dst = empty_pool(n, host_layout)
        where = list(range(n - 1, -1, -1))
        before = reader.stats()
        assert reader.batch_get(keys, dst, where) == n
        assert pages_equal(src, dst, list(range(n)), where)
        after = reader.stats()
        assert after.bytes_read - before.bytes_read == n * PAGE
        assert after.stored_bytes_read - before.stored_bytes_read == ws.stored_bytes_written
        assert after.corrupt_pages == 0


@pytest.mark.parametrize("backend_url", BACKENDS, indirect=True)
def test_a_damaged_compressed_page_is_a_counted_miss(backend_url, open_backend) -> None:
    url, opts = backend_url
    b = open_backend(url, layout=LAYOUT, compression="zstd", **opts)
    src, dst = kv_pool(6, 20), empty_pool(6)
    keys = page_keys(6, "cflip")
    assert b.batch_set(keys, src, list(range(6))) == 6
    flip_stored_byte(b, keys[3], HEADER_BYTES + 100)  # inside the compressed payload
    assert b.batch_get(keys, dst, list(range(6))) == 3  # stops at the damaged page, never returns it
    assert pages_equal(src, dst, [0, 1, 2], [0, 1, 2])
    assert b.stats().corrupt_pages == 1
    if not isinstance(b, MemoryBackend):  # the damaged value is deleted (delete_corrupt): next time a plain miss
        assert b.batch_exists(keys) == 3


def test_file_store_size_cap_counts_stored_bytes(tmp_path: Path, open_backend) -> None:
    b = open_backend(f"file://{tmp_path}", layout=LAYOUT, compression="zstd")
    assert isinstance(b, FileBackend)
    src = kv_pool(10, 30)
    assert b.batch_set(page_keys(10, "cap"), src, list(range(10))) == 10
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.page"))
    assert b.stored_bytes == on_disk == b.stats().stored_bytes_written + 10 * PACKED_HEADER_BYTES  # (all compressed)
    assert on_disk < 10 * (PAGE + HEADER_BYTES) * 0.9


def test_the_cache_serves_compressed_l3_pages_and_exports_the_ratio(tmp_path: Path) -> None:
    layout = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16", "page_size": 4}
    cfg = small_config(layout=layout, cache={"write_policy": "write_through"},
                       storage={"url": f"file://{tmp_path}", "compression": "zstd"})
    cache = HiCache(cfg)
    try:
        assert cache.storage is not None and cache.storage.codec.name == "zstd"
        tokens = list(range(1, 33))  # 8 pages
        kv = commit_fresh(cache, tokens, seed=7)
        rep = cache.flush(10)
        assert rep is not None and rep.complete and rep.written_pages == 8
        cache.evict(l1_pages=8, l2_pages=8)
        req = cache.match(tokens)
        assert req.l3_pages == 8
        assert cache.prefetch(req) == 8
        load = cache.load_back(req)
        load.wait()
        assert kv_equal(read_kv(cache, load.device_indices), kv)  # bit for bit
        cache.release(req)
        cache.check_integrity()

        def metric(name: str) -> float:
            return cache.metrics.registry.get_sample_value(name) or 0.0

        written = metric("hicache_storage_written_bytes_total")
        stored = metric("hicache_storage_stored_written_bytes_total")
        assert written == 8 * cache.layout.bytes_per_page and 0 < stored < 0.9 * written
        assert metric("hicache_storage_stored_read_bytes_total") == stored
        assert metric("hicache_storage_read_bytes_total") == written
    finally:
        cache.close()


# ----------------------------------------------------------------------------------------- faults mid-read

BIG = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)  # 512 KiB pages


def big_pool(n: int, seed: int | None) -> HostPool:
    pool = HostPool(BIG, n, "page_first")  # type: ignore[arg-type]
    for i in range(n):
        pool.write_page_bytes(i, kv_like(BIG.bytes_per_page, seed + i) if seed is not None else
                              bytes(BIG.bytes_per_page))
    return pool


@needs_redis
@pytest.mark.redis
@pytest.mark.parametrize("hash_threads", [1, 4])
def test_a_read_cut_short_writes_no_host_page_after_it_returns(redis_single, open_backend, prefix: str,
                                                                hash_threads: int) -> None:
    """Compressed pages decode on the hash threads straight into the host pages. When the reply stream
    breaks, the read fails (0 pages) and its caller gives the pages back at once: no decode may still be
    writing into them by then."""
    n = 48
    writer = open_backend(redis_single.url, layout=BIG, compression="zstd", prefix=prefix)
    keys = page_keys(n, "cut")
    assert writer.batch_set(keys, big_pool(n, 1), list(range(n))) == n
    stored = writer.stats().stored_bytes_written
    proxy = TcpProxy(redis_single.port)
    try:
        reader = open_backend(proxy.url, layout=BIG, prefix=prefix, retry_attempts=1, hash_threads=hash_threads)
        assert reader.probe() is None
        dst = big_pool(n, None)
        proxy.arm(int(stored * 0.9))  # the connection drops near the end of the replies
        assert reader.batch_get(keys, dst, list(range(n))) == 0 and reader.stats().errors == 1
        u8 = dst.buffer.view(torch.uint8).view(n, -1)
        u8.fill_(0xAA)  # the pages belong to someone else now
        time.sleep(0.5)
        assert bool((u8 == 0xAA).all()), "a decode wrote into a host page after the read had failed"
    finally:
        proxy.close()


@needs_redis
@pytest.mark.redis
def test_stored_bytes_read_are_those_of_the_attempt_that_succeeded(redis_single, open_backend, prefix: str) -> None:
    """A read retried after a reset counts the bytes of the frames it finally read: here a node storing
    pages as they are rewrote the compressed pages between the two attempts."""
    n, page = 4, BIG.bytes_per_page
    zstd = open_backend(redis_single.url, layout=BIG, compression="zstd", prefix=prefix)
    plain = open_backend(redis_single.url, layout=BIG, prefix=prefix)
    src, keys = big_pool(n, 3), page_keys(n, "retry")
    assert zstd.batch_set(keys, src, list(range(n))) == n
    first = zstd.stats().stored_bytes_written // n
    proxy = TcpProxy(redis_single.port)
    try:
        reader = open_backend(proxy.url, layout=BIG, prefix=prefix, retry_attempts=2)
        assert isinstance(reader, RedisBackend) and reader.probe() is None
        refresh = reader._refresh

        def rewrite_then_refresh(e: BaseException | None = None) -> None:  # between the two attempts
            assert plain.batch_set(keys, src, list(range(n))) == n
            refresh(e)

        reader._refresh = rewrite_then_refresh  # type: ignore[method-assign]
        proxy.arm(first + HEADER_BYTES + 200_000)  # page 0 arrives whole, the connection drops in page 1
        dst = big_pool(n, None)
        assert reader.batch_get(keys, dst, list(range(n))) == n
        assert pages_equal(src, dst, list(range(n)), list(range(n)))
        st = reader.stats()
        assert st.extra.get("retries") == 1 and st.bytes_read == st.stored_bytes_read == n * page
    finally:
        proxy.close()


# ----------------------------------------------------------------------------------------- newer formats


def newer_frames(key: bytes) -> dict[str, bytes]:
    """Frames a newer release might write for ``key``: a later version (smaller than, as large as, or larger
    than a page's frame), and a version 3 frame of a codec this release does not have (stored bytes intact)."""
    def later(size: int) -> bytes:
        head = _HEADER.pack(MAGIC, NEWEST_VERSION + 1, 0, NS, key, size - HEADER_BYTES, bytes(32))
        rest = size - len(head)
        return head + bytes(range(256)) * (rest // 256) + bytes(rest % 256)

    stored = make_codec("zstd").compress(memoryview(kv_like(PAGE, 9)), 2)
    assert stored is not None
    h = xxhash.xxh3_128()
    for part in (NS, key, stored):
        h.update(part)
    codec = _HEADER.pack(MAGIC, PACKED_VERSION, 200 | 2 << 8, NS, key, len(stored), h.digest() + bytes(16)) + stored
    return {"smaller": later(HEADER_BYTES + PAGE // 2), "same size": later(HEADER_BYTES + PAGE),
            "larger": later(HEADER_BYTES + 2 * PAGE), "unknown codec": codec}


@pytest.mark.parametrize("what", ["smaller", "same size", "larger", "unknown codec"])
def test_a_newer_format_is_a_newer_format_error(what: str) -> None:
    with pytest.raises(NewerFormat):
        unpack_page(newer_frames(KEY)[what], NS, KEY, memoryview(bytearray(PAGE)))
    assert newer_format(newer_frames(KEY)[what]) == (what != "unknown codec")


@pytest.mark.parametrize("backend_url", [*(p for p in BACKENDS if p.id != "memory"),
                                         pytest.param("file-pyarrow", id="file-pyarrow")], indirect=True)
def test_a_newer_release_s_pages_are_misses_left_in_the_store(backend_url, open_backend) -> None:
    """A node of this release sharing the store with a newer one: the newer frames are misses (counted like
    damage) but never deleted, while damage beside them still is."""
    url, opts = backend_url
    b = open_backend(url, layout=LAYOUT, compression="zstd", **opts)
    kinds = list(newer_frames(KEY))
    keys = page_keys(len(kinds) + 1, "newer")
    src = kv_pool(len(keys), 40)
    assert b.batch_set(keys, src, list(range(len(keys)))) == len(keys)
    for key, kind in zip(keys, kinds, strict=False):
        put_raw(b, key, newer_frames(key)[kind])
    flip_stored_byte(b, keys[-1], HEADER_BYTES + 100)  # the last one: damage
    for i, key in enumerate(keys):
        assert b.batch_get([key], empty_pool(1), [0]) == 0, i
    assert b.stats().corrupt_pages == len(keys)
    assert [b.batch_exists([k]) for k in keys] == [1] * len(kinds) + [0]  # only the damaged page went


def put_raw(b: object, key: bytes, blob: bytes) -> None:
    """Store ``blob`` as ``key``'s value, in the store itself."""
    if isinstance(b, FileBackend):
        Path(b.path(key)).write_bytes(blob)
    elif isinstance(b, RedisBackend):
        client = b._nodes.cluster() if b._nodes.client is None else b._nodes.client
        client.set(b.redis_key(key), blob)
    else:
        raise AssertionError(type(b))
