"""Every L3 backend: byte-identical round trips, the exists/get prefix contract, verification of frames."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hicache.storage.base import create_backend
from hicache.storage.file_backend import FileBackend
from hicache.storage.frame import HEADER_BYTES
from hicache.storage.memory import MemoryBackend
from hicache.storage.redis_backend import RedisBackend
from storage.conftest import BACKENDS, LAYOUT, NS, make_pool, page_keys, pages_equal

PAGE = LAYOUT.bytes_per_page


def flip_stored_byte(b: object, key: bytes, offset: int) -> None:
    """Damage one stored byte of ``key``'s frame, in the store itself."""
    if isinstance(b, MemoryBackend):
        blob = bytearray(b.raw(key) or b"")
        blob[offset] ^= 0xFF
        b.put_raw(key, bytes(blob))
    elif isinstance(b, FileBackend):
        p = b.path(key)
        with open(p, "r+b") as f:
            f.seek(offset)
            v = f.read(1)
            f.seek(offset)
            f.write(bytes([v[0] ^ 0xFF]))
    elif isinstance(b, RedisBackend):
        import redis
        from redis.cluster import RedisCluster
        rk = b.redis_key(key)
        client = b._nodes.cluster() if b._nodes.client is None else b._nodes.client
        assert isinstance(client, (redis.Redis, RedisCluster))
        v = client.getrange(rk, offset, offset)
        client.setrange(rk, offset, bytes([v[0] ^ 0xFF]))
    else:
        raise AssertionError(type(b))


@pytest.mark.parametrize("backend_url", BACKENDS, indirect=True)
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "block_first"])
def test_round_trip_is_byte_identical(backend_url, open_backend, host_layout) -> None:
    url, opts = backend_url
    b = open_backend(url, host_layout=host_layout, **opts)
    src = make_pool(40, host_layout, seed=1)
    dst = make_pool(40, host_layout, seed=None)
    keys = page_keys(40, "rt")
    src_pages = list(range(40))
    dst_pages = list(range(39, -1, -1))  # different host pages on the way back
    assert b.batch_exists(keys) == 0
    assert b.batch_set(keys, src, src_pages) == 40
    assert b.batch_exists(keys) == 40
    assert b.batch_get(keys, dst, dst_pages) == 40
    assert pages_equal(src, dst, src_pages, dst_pages)
    st = b.stats()
    assert (st.sets, st.gets, st.corrupt_pages, st.errors) == (40, 40, 0, 0)
    assert st.bytes_written == st.bytes_read == 40 * PAGE
    assert b.delete(keys[:5]) == 5
    assert b.batch_exists(keys) == 0 and b.batch_exists(keys[5:]) == 35


@pytest.mark.parametrize("backend_url", BACKENDS, indirect=True)
def test_hits_are_a_contiguous_prefix(backend_url, open_backend) -> None:
    url, opts = backend_url
    b = open_backend(url, **opts)
    src, dst = make_pool(10, seed=2), make_pool(10, seed=None)
    keys = page_keys(10, "prefix")
    stored = [0, 1, 2, 3, 5, 6]  # page 4 missing
    assert b.batch_set([keys[i] for i in stored], src, stored) == len(stored)
    assert b.batch_exists(keys) == 4
    assert b.batch_get(keys, dst, list(range(10))) == 4
    assert pages_equal(src, dst, [0, 1, 2, 3], [0, 1, 2, 3])
    assert b.stats().get_misses == 6
    assert b.batch_exists([]) == 0


@pytest.mark.parametrize("backend_url", BACKENDS, indirect=True)
@pytest.mark.parametrize("where", ["payload", "header"])
def test_flipped_byte_is_a_counted_miss(backend_url, open_backend, where) -> None:
    url, opts = backend_url
    b = open_backend(url, **opts)
    src, dst = make_pool(6, seed=3), make_pool(6, seed=None)
    keys = page_keys(6, "flip" + where)
    assert b.batch_set(keys, src, list(range(6))) == 6
    offset = HEADER_BYTES + PAGE // 2 if where == "payload" else 40  # 40: inside the namespace digest
    flip_stored_byte(b, keys[3], offset)
    assert b.batch_get(keys, dst, list(range(6))) == 3  # stops at the damaged page, never returns it
    assert pages_equal(src, dst, [0, 1, 2], [0, 1, 2])
    assert b.stats().corrupt_pages == 1


@pytest.mark.parametrize("backend_url", BACKENDS, indirect=True)
def test_foreign_namespace_and_wrong_layout_are_misses(backend_url, open_backend) -> None:
    url, opts = backend_url
    writer = open_backend(url, **opts)
    src = make_pool(3, seed=4)
    keys = page_keys(3, "foreign")
    assert writer.batch_set(keys, src, [0, 1, 2]) == 3
    other_ns = bytes(32)
    if url == "memory://":  # memory:// is per process: read back through the same store
        reader = MemoryBackend(url, writer.ctx.__class__(other_ns, LAYOUT))
        reader._data = writer._data  # type: ignore[attr-defined]
    else:
        reader = open_backend(url, ns=other_ns, **opts)
    dst = make_pool(3, seed=None)
    assert reader.batch_get(keys, dst, [0, 1, 2]) == 0
    assert reader.stats().corrupt_pages >= 1
    if url != "memory://":  # same namespace, another page size: a length mismatch, never a page
        from hicache.layout import KVLayout
        other = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)
        r2 = open_backend(url, layout=other, **opts)
        writer.batch_set(keys, src, [0, 1, 2])
        assert r2.batch_get(keys, make_pool(3, layout=other, seed=None), [0, 1, 2]) == 0
        assert r2.stats().corrupt_pages >= 1


def test_unknown_scheme_and_bad_options_are_clear_errors(tmp_path: Path) -> None:
    from hicache.storage import StorageContext
    ctx = StorageContext(NS, LAYOUT)
    with pytest.raises(ValueError, match="unknown scheme"):
        create_backend("nosuch://x", ctx)
    with pytest.raises(ValueError, match="unknown option"):
        create_backend("redis://127.0.0.1:1/0", ctx, bogus=1)
    with pytest.raises(ValueError, match="braces"):
        create_backend("redis://127.0.0.1:1/0", ctx, prefix="a{b}")
    with pytest.raises(ValueError, match="ttl_s"):
        create_backend("redis://127.0.0.1:1/0?ttl_s=abc", ctx)
    with pytest.raises(ValueError, match="service name"):
        create_backend("redis+sentinel://127.0.0.1:26379", ctx)
    with pytest.raises(ValueError, match="unknown option"):
        create_backend(str(tmp_path), ctx, prefix="x")
    with pytest.raises(ValueError, match="host pages"):
        b = create_backend(str(tmp_path), ctx)
        b.batch_set(page_keys(2), make_pool(2), [0])


def test_file_store_paths_are_sharded_and_plain_paths_work(tmp_path: Path, open_backend) -> None:
    b = open_backend(str(tmp_path / "plain"))
    keys = page_keys(3, "shard")
    assert b.batch_set(keys, make_pool(3), [0, 1, 2]) == 3
    h = keys[0].hex()
    assert os.path.exists(tmp_path / "plain" / h[:2] / h[2:4] / f"{h}.page")
    assert os.path.getsize(tmp_path / "plain" / h[:2] / h[2:4] / f"{h}.page") == HEADER_BYTES + PAGE


@pytest.mark.parametrize("backend_url", BACKENDS, indirect=True)
def test_probe_answers_on_a_live_store_and_leaves_nothing(backend_url, open_backend, tmp_path: Path) -> None:
    url, opts = backend_url
    b = open_backend(url, **opts)
    before = b.stats()
    assert b.probe() is None
    after = b.stats()
    assert (after.sets, after.errors, after.bytes_written) == (before.sets, before.errors, before.bytes_written)
    if isinstance(b, FileBackend):
        assert [p for p in (tmp_path / "store").rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("kind", ["redis", "cluster", "file"])
def test_probe_says_why_a_store_does_not_answer(kind: str, open_backend, tmp_path: Path) -> None:
    from hicache.storage.redis_local import free_port

    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    url = {"redis": f"redis://:secret@127.0.0.1:{free_port()}/0",
           "cluster": f"redis+cluster://127.0.0.1:{free_port()}",
           "file": f"file://{blocker}/store"}[kind]  # a path under a regular file cannot be created
    b = open_backend(url, **({"connect_timeout_s": 0.2} if kind != "file" else {}))
    why = b.probe()
    assert why and "\n" not in why
    assert "secret" not in why and "secret" not in b.url_safe
    assert b.batch_exists(page_keys(2, "probe")) == 0  # and the store still answers misses, never raises


def test_unknown_scheme_error_does_not_repeat_credentials() -> None:
    from hicache.storage.base import StorageContext

    with pytest.raises(ValueError, match="unknown scheme") as ei:
        create_backend("ftp://bob:hunter2@host/x?password=hunter2", StorageContext(NS, LAYOUT))
    assert "hunter2" not in str(ei.value) and "ftp://host/x" in str(ei.value)
