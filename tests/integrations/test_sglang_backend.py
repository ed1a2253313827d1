"""hicache as SGLang's HiCache storage backend, driven through SGLang's own classes (sglang 0.5.23): its
factory's dynamic loader, its storage config, its CPU host pools in every memory layout, MHA and MLA."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from integrations.sglang_kit import (
    create,
    load_sglang,
    mha_pool,
    mla_pool,
    sglang_available,
    sglang_keys,
    storage_config,
)

if not sglang_available():  # (scripts/engine_env.sh installs it; the main test run does not)
    pytest.skip("sglang is not installed (scripts/engine_env.sh)", allow_module_level=True)
load_sglang()

from hicache.config import ConfigError  # noqa: E402
from hicache.integrations.sglang import HiCacheStore  # noqa: E402
from hicache.storage.redis_local import LocalRedis, redis_server_binary  # noqa: E402
from tcpproxy import TcpProxy  # noqa: E402

LAYOUTS = ["page_first", "page_first_direct", "layer_first"]
POOLS = {"mha": mha_pool, "mla": mla_pool}
needs_redis = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")


def fill(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    u8 = pool.kv_buffer.view(torch.uint8)
    u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=g))


def page_bytes(pool: Any, host_indices: torch.Tensor) -> list[bytes]:
    """Each page's bytes as SGLang's zero-copy metadata names them."""
    import ctypes

    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    k = len(ptrs) // (len(host_indices) // pool.page_size)
    raw = [ctypes.string_at(p, s) for p, s in zip(ptrs, sizes, strict=True)]
    return [b"".join(raw[i:i + k]) for i in range(0, len(raw), k)]


def tokens_of(pages: int, start: int = 0) -> torch.Tensor:
    """Host token indices of ``pages`` pages from page ``start`` (page 0 is SGLang's padding page)."""
    return torch.arange((start + 1) * 4, (start + 1 + pages) * 4, dtype=torch.int64)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    with LocalRedis() as r:
        yield r


@pytest.fixture(params=["file", pytest.param("redis", marks=[pytest.mark.redis, needs_redis])])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    if request.param == "file":
        return {"url": f"file://{tmp_path / 'l3'}"}
    r = request.getfixturevalue("redis_server")
    return {"url": r.url, "options": {"prefix": f"t{time.monotonic_ns()}:"}}


@pytest.fixture
def backends() -> Iterator[Callable[..., HiCacheStore]]:
    made: list[HiCacheStore] = []

    def make(extra: dict[str, Any], pool: Any, **kw: Any) -> HiCacheStore:
        b = create(extra, pool, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["mha", "mla"])
def test_the_next_process_reads_byte_exact_what_one_wrote(attn: str, layout: str, store: dict[str, Any],
                                                          backends: Any) -> None:
    src, dst = POOLS[attn](layout), POOLS[attn](layout)
    fill(src, 1)
    keys = sglang_keys(list(range(6 * 4)))
    a = backends(store, src)
    assert isinstance(a, HiCacheStore)
    assert a.batch_exists(keys) == 0
    assert a.batch_set_v1(keys[:4], tokens_of(4)) == [True] * 4
    b = backends(store, dst)  # another process (or host): a fresh backend and pool, the same model and layout
    assert b.batch_exists(keys) == 4
    assert b.batch_get_v1(keys, tokens_of(6, start=2)) == [True] * 4 + [False] * 2
    assert page_bytes(dst, tokens_of(4, start=2)) == page_bytes(src, tokens_of(4))
    stats = b.get_stats()
    assert stats.prefetch_pgs == [4] and stats.hicache["gets"] == 4
    assert b.get_stats().prefetch_pgs == []  # samples are handed over once


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_flat_path_and_the_zero_copy_path_store_the_same_pages(layout: str, tmp_path: Path,
                                                                   backends: Any) -> None:
    src, dst = mha_pool(layout), mha_pool(layout)
    fill(src, 2)
    keys = sglang_keys(list(range(3 * 4)))
    store = {"url": f"file://{tmp_path}"}
    flat = backends({**store, "interface_v1": 0}, src)
    # what SGLang's controller does on its generic path: flat page tensors of the host pool
    assert flat.batch_set(keys, [src.get_data_page(int(i), flat=True) for i in tokens_of(3)[::4]])
    v1 = backends(store, dst)
    assert v1.batch_get_v1(keys, tokens_of(3)) == [True] * 3
    assert page_bytes(dst, tokens_of(3)) == page_bytes(src, tokens_of(3))
    back = [dst.get_dummy_flat_data_page() for _ in keys]
    got = flat.batch_get(keys, back)
    assert all(t is not None for t in got)
    for i, t in zip(tokens_of(3)[::4], back, strict=True):
        assert torch.equal(t.view(torch.uint8), src.get_data_page(int(i), flat=True).view(torch.uint8))


def test_models_layouts_shards_and_tenants_never_share_pages(tmp_path: Path, backends: Any) -> None:
    store = {"url": f"file://{tmp_path}"}
    src = mha_pool("page_first")
    fill(src, 3)
    keys = sglang_keys(list(range(2 * 4)))
    backends(store, src).batch_set_v1(keys, tokens_of(2))
    others = [backends(store, mha_pool("page_first"), model="org/other"),
              backends(store, mha_pool("page_first"), tp=(1, 2)),
              backends(store, mha_pool("layer_first")),
              backends(store, mha_pool("page_first", heads=1, dim=16)),
              backends({**store, "tenant": "acme"}, mha_pool("page_first"))]
    for o in others:
        assert o.batch_exists(keys) == 0
        assert o.batch_get_v1(keys, tokens_of(2)) == [False, False]
    assert backends(store, mha_pool("page_first")).batch_exists(keys) == 2  # the same namespace hits


def test_mla_pages_are_shared_by_tp_ranks_and_written_by_the_writer_only(tmp_path: Path, backends: Any) -> None:
    store = {"url": f"file://{tmp_path}"}
    src = mla_pool("page_first")
    fill(src, 4)
    keys = sglang_keys(list(range(2 * 4)))
    rank1 = backends(store, src, tp=(1, 2))
    assert rank1.batch_set_v1(keys, tokens_of(2)) == [True, True]  # not the writer: nothing written
    assert rank1.batch_exists(keys) == 0
    backends(store, src, tp=(0, 2)).batch_set_v1(keys, tokens_of(2))
    dst = mla_pool("page_first")
    assert backends(store, dst, tp=(1, 2)).batch_get_v1(keys, tokens_of(2)) == [True, True]
    assert page_bytes(dst, tokens_of(2)) == page_bytes(src, tokens_of(2))


def test_a_damaged_page_is_a_miss_counted(tmp_path: Path, backends: Any) -> None:
    src = mha_pool("page_first")
    fill(src, 5)
    keys = sglang_keys(list(range(3 * 4)))
    b = backends({"url": f"file://{tmp_path}"}, src)
    b.batch_set_v1(keys, tokens_of(3))
    victim = next(p for p in tmp_path.rglob("*") if p.is_file() and
                  p.name.startswith(b.store.storage_keys([bytes.fromhex(keys[1])])[0].hex()))
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    victim.write_bytes(bytes(blob))
    assert b.batch_get_v1(keys, tokens_of(3, start=4)) == [True, False, False]
    assert b.get_stats().hicache["corrupt_pages"] == 1


@needs_redis
@pytest.mark.redis
def test_redis_cut_mid_batch_fails_the_batch_and_the_next_succeeds(redis_server: LocalRedis, backends: Any) -> None:
    proxy = TcpProxy(redis_server.port)
    src = mha_pool("page_first")
    fill(src, 6)
    keys = sglang_keys(list(range(8 * 4)))
    b = backends({"url": proxy.url, "options": {"prefix": "cut:", "retry_attempts": 1, "breaker_base_s": 0.01}}, src)
    assert b.batch_set_v1(keys, tokens_of(8)) == [True] * 8
    proxy.arm(3 * 800)  # the replies stop a few pages into the next read
    got = b.batch_get_v1(keys, tokens_of(8, start=8))
    assert got != [True] * 8 and proxy.cuts == 1
    time.sleep(0.05)
    assert b.batch_get_v1(keys, tokens_of(8, start=8)) == [True] * 8
    assert page_bytes(src, tokens_of(8, start=8)) == page_bytes(src, tokens_of(8))


@needs_redis
@pytest.mark.redis
def test_redis_killed_fails_the_batch_and_after_its_restart_the_next_succeeds(backends: Any) -> None:
    src = mha_pool("page_first")
    fill(src, 7)
    keys = sglang_keys(list(range(4 * 4)))
    with LocalRedis() as r:
        b = backends({"url": r.url, "options": {"timeout_s": 1.0, "breaker_base_s": 0.01}}, src)
        assert b.batch_set_v1(keys[:2], tokens_of(2)) == [True, True]
        r.kill()
        assert b.batch_set_v1(keys[2:], tokens_of(2, start=2)) == [False, False]
        assert b.batch_exists(keys) == 0
        r.start()
        time.sleep(0.05)
        assert b.batch_set_v1(keys, tokens_of(4)) == [True] * 4


def test_bad_configuration_stops_the_backend_with_one_line(tmp_path: Path) -> None:
    pool = mha_pool("page_first")
    for extra, msg in (({}, "url: required"), ({"url": "file:///x", "colour": 1}, "colour: unknown field"),
                       ({"url": "file:///x", "compression": "gzip"}, "compression: must be one of")):
        with pytest.raises(ConfigError) as e:
            create(extra, pool)
        assert str(e.value).startswith(f"--hicache-storage-backend-extra-config: {msg}"), str(e.value)
        assert "\n" not in str(e.value)


def test_sglang_calls_the_backend_as_it_expects() -> None:
    """The parts of SGLang 0.5.23 this backend relies on; a release that changes them fails here."""
    import importlib.metadata

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    assert importlib.metadata.version("sglang") == "0.5.23"
    for name in ("batch_get_v1", "batch_set_v1"):
        assert list(inspect.signature(getattr(HiCacheStorage, name)).parameters) == \
            ["self", "keys", "host_indices", "extra_info"]
    assert list(inspect.signature(HiCacheStorage.batch_exists).parameters) == ["self", "keys", "extra_info"]
    assert list(inspect.signature(HiCacheStorage.batch_get).parameters)[:3] == ["self", "keys", "target_locations"]
    assert list(inspect.signature(HiCacheStorage.batch_set).parameters)[:3] == ["self", "keys", "values"]
    assert "register_mem_pool_host" in vars(HiCacheStorage) and "get_stats" in vars(HiCacheStorage)
    src = inspect.getsource(StorageBackendFactory._create_dynamic_backend)
    assert "backend_class(storage_config, kwargs)" in src
    cfg = storage_config({})
    for f in ("tp_rank", "tp_size", "pp_rank", "pp_size", "is_mla_model", "model_name", "extra_config",
              "attn_cp_rank", "attn_cp_size", "should_split_heads"):
        assert hasattr(cfg, f), f
    assert cfg.is_storage_writer
    pool = mha_pool("layer_first")
    assert tuple(pool.kv_buffer.shape) == (2, 3, pool.size, 2, 8)
    assert len(pool.get_page_buffer_meta(torch.arange(4))[0]) == 2 * 3


_WRITER = """
import json, sys
sys.path[:0] = sys.argv[1].split(":")
from integrations.sglang_kit import create, load_sglang, mha_pool, sglang_keys
load_sglang()
import torch
from test_sglang_backend import fill, tokens_of
pool = mha_pool(sys.argv[2])
fill(pool, 11)
b = create(json.loads(sys.argv[3]), pool)
ok = b.batch_set_v1(sglang_keys(list(range(5 * 4))), tokens_of(5))
b.close()
sys.exit(0 if ok == [True] * 5 else 3)
"""


@pytest.fixture(params=["file", pytest.param("cluster", marks=[pytest.mark.redis, needs_redis])])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    if request.param == "file":
        yield {"url": f"file://{tmp_path / 'shared'}"}
        return
    from hicache.storage.redis_local import LocalRedisCluster

    with LocalRedisCluster(3) as cluster:
        yield {"url": cluster.url}


def test_a_second_sglang_process_hits_what_the_first_wrote(shared_store: dict[str, Any], backends: Any) -> None:
    """Two SGLang processes of one model, one store (a file store; a Redis Cluster): the second reads, byte
    exact, what the first wrote."""
    import json
    import subprocess
    import sys

    layout = "page_first" if shared_store["url"].startswith("file:") else "layer_first"
    here = Path(__file__).resolve().parent  # the other process imports this file's helpers from here
    proc = subprocess.run([sys.executable, "-c", _WRITER, f"{here.parent}:{here}", layout, json.dumps(shared_store)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    mine, theirs = mha_pool(layout), mha_pool(layout)
    fill(theirs, 11)  # what the other process's pool held
    b = backends(shared_store, mine)
    keys = sglang_keys(list(range(5 * 4)))
    assert b.batch_exists(keys) == 5
    assert b.batch_get_v1(keys, tokens_of(5, start=3)) == [True] * 5
    assert page_bytes(mine, tokens_of(5, start=3)) == page_bytes(theirs, tokens_of(5))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["mha", "mla"])
def test_pieces_are_where_sglang_says(attn: str, layout: str, tmp_path: Path, backends: Any) -> None:
    """The backend places page pieces itself (an affine fit of SGLang's metadata, checked at start): the
    same pointers and sizes as SGLang's ``get_page_buffer_meta`` for any pages, in any order."""
    pool = POOLS[attn](layout)
    b = backends({"url": f"file://{tmp_path}"}, pool)
    assert b.view is not None and b.view.affine is not None, "the fit failed: every batch asks SGLang"
    idx = torch.cat([torch.arange(p * 4, p * 4 + 4) for p in (9, 1, 30, 2)])
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    mine = [v for page in b.view.pages(idx) for v in page]
    base = pool.kv_buffer.data_ptr()
    import ctypes

    got = [(ctypes.addressof(ctypes.c_char.from_buffer(v)) - base, len(v)) for v in mine]
    assert got == [(p - base, s) for p, s in zip(ptrs, sizes, strict=True)]
    with pytest.raises(ValueError, match="outside the pool's buffer"):
        b.view.pages(torch.arange(10_000 * 4, 10_001 * 4))
