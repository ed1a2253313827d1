"""Storage fixtures: real redis-server processes on free loopback ports, pools, contexts, backends.

A single instance and a 3-master Cluster are started once per session (skipped cleanly when
``redis-server`` is not installed); tests isolate themselves with a key prefix of their own. Tests that
kill or reconfigure a server start a private one.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch

from hicache.layout import KVLayout
from hicache.pool import HostPool
from hicache.storage import StorageBackend, StorageContext, create_backend
from hicache.storage.redis_local import LocalRedis, LocalRedisCluster, redis_server_binary

needs_redis = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)  # 512 B pages
NS = hashlib.sha256(b"storage-tests").digest()


@pytest.fixture(scope="session")
def redis_single() -> Iterator[LocalRedis]:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    with LocalRedis() as r:
        yield r


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    with LocalRedisCluster(3) as c:
        yield c


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}:"


def make_pool(n: int, host_layout: str = "page_first", seed: int | None = 0, layout: KVLayout = LAYOUT) -> HostPool:
    pool = HostPool(layout, n, host_layout)  # type: ignore[arg-type]
    u8 = pool.buffer.view(torch.uint8)
    if seed is None:
        u8.zero_()
    else:
        g = torch.Generator().manual_seed(seed)
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=g))
    return pool


def page_keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n)]


def pages_equal(a: HostPool, b: HostPool, pa: list[int], pb: list[int]) -> bool:
    return all(a.page_bytes(x) == b.page_bytes(y) for x, y in zip(pa, pb, strict=True))


BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("file", id="file"),
    pytest.param("redis", id="redis", marks=[pytest.mark.redis, needs_redis]),
    pytest.param("cluster", id="cluster", marks=[pytest.mark.redis, needs_redis]),
]


@pytest.fixture
def backend_url(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> tuple[str, dict[str, Any]]:
    """(url, options) for the backend named by the test's ``kind`` parameter."""
    kind = request.param
    if kind == "memory":
        return "memory://", {}
    if kind == "file":
        return f"file://{tmp_path / 'store'}", {}
    if kind == "file-pyarrow":  # the same store read and written through pyarrow.fs, not os
        return f"file://{tmp_path / 'store'}", {"filesystem": pafs.SubTreeFileSystem("/", pafs.LocalFileSystem())}
    if kind == "redis":
        return request.getfixturevalue("redis_single").url, {"prefix": prefix}
    if kind == "cluster":
        return request.getfixturevalue("redis_cluster").url, {"prefix": prefix}
    raise AssertionError(kind)


@pytest.fixture
def open_backend() -> Iterator[Callable[..., StorageBackend]]:
    """Create backends that are closed after the test."""
    made: list[StorageBackend] = []

    def make(url: str, layout: KVLayout = LAYOUT, ns: bytes = NS, host_layout: str = "page_first",
             compression: str = "none", **options: Any) -> StorageBackend:
        ctx = StorageContext(ns, layout, host_layout=host_layout, compression=compression)
        b = create_backend(url, ctx, **options)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


# cache helpers (what an engine does) are shared with the core tests
from kvhelpers import read_kv, serve, small_config, write_kv  # noqa: E402

__all__ = ["read_kv", "serve", "small_config", "write_kv"]
