"""L3 faults from outside, through the node's gRPC service: a real redis-server killed and started again
while pages are written (the writeback retries them from L2: L3 ends complete, byte for byte), and page
files of the file store corrupted, cut short or deleted (each a miss, the first two counted as corrupt;
never a wrong byte). Every case reads the pages back with ReadPages after an admin Clear emptied L1 and L2,
so what it gets came from L3, and ends with the node whole (:func:`probekit.assert_whole`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.service.server import NodeServer
from hicache.storage.file_backend import FileBackend
from hicache.storage.redis_local import LocalRedis, redis_server_binary

from .probekit import PS, Background, assert_whole, bearer, start_node, stats

ACME = pb.NamespaceRef(tenant="acme")
PAGES = 3  # per prompt
# the store fails fast while it is down, and the writeback's retries back off briefly
FAST_FAIL = {"timeout_s": 0.5, "connect_timeout_s": 0.2, "retry_attempts": 1, "breaker_base_s": 0.05,
             "breaker_max_s": 0.2}
CACHE = {"write_policy": "write_through", "l1_tokens": 64 * PS, "l2_tokens": 128 * PS}
L3 = {"prefetch_threshold_tokens": 1}  # fetch a prompt's few pages back (the default skips runs this short)


def tokens(p: int) -> bytes:
    return (np.arange(PAGES * PS, dtype=np.uint32) + 1000 * (p + 1)).tobytes()


def page_bytes(p: int, bpp: int) -> bytes:
    return np.random.default_rng(p).integers(0, 256, PAGES * bpp, dtype=np.uint8).tobytes()


def write(stub: pb_grpc.HiCacheStub, p: int, bpp: int) -> None:
    head = pb.WritePagesChunk(header=pb.WritePagesHeader(namespace=ACME, tokens=tokens(p)))
    r = stub.WritePages(iter([head, pb.WritePagesChunk(data=page_bytes(p, bpp))]), metadata=bearer("acme"),
                        timeout=5)
    assert r.new_pages == PAGES


def read(stub: pb_grpc.HiCacheStub, p: int) -> tuple[bytes, list[bytes]]:
    """The bytes and keys ReadPages returns for prompt ``p``'s prefix."""
    data, keys = b"", []
    for chunk in stub.ReadPages(pb.ReadPagesRequest(namespace=ACME, tokens=tokens(p)), metadata=bearer("acme"),
                                timeout=10):
        data += chunk.data
        keys += list(chunk.page_keys)
    return data, keys


def clear(stub: pb_grpc.HiCacheStub) -> None:
    stub.Clear(pb.ClearRequest(), metadata=bearer("ops"), timeout=5)


def flush(stub: pb_grpc.HiCacheStub, timeout_s: float = 2.0) -> pb.FlushResponse:
    return stub.Flush(pb.FlushRequest(timeout_s=timeout_s), metadata=bearer("ops"), timeout=timeout_s + 5)


@pytest.fixture
def bg() -> Iterator[Background]:
    b = Background()
    yield b
    b.close()


@pytest.mark.redis
@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")
def test_redis_killed_and_restarted_under_writeback_ends_with_l3_complete(bg: Background, tmp_path: Path) -> None:
    r = LocalRedis().start()
    node: NodeServer | None = None
    try:
        node = start_node(bg, tmp_path, cache=CACHE, storage={"url": r.url, "options": FAST_FAIL, **L3})
        assert node.cache is not None
        bpp = node.cache.layout.bytes_per_page
        n = 12
        with grpc.insecure_channel(f"127.0.0.1:{node.port}") as ch:
            stub = pb_grpc.HiCacheStub(ch)
            write(stub, 0, bpp)  # one prompt before the outage
            assert flush(stub).complete
            before = stats(ch)
            r.kill()
            for p in range(1, n):
                write(stub, p, bpp)  # the node keeps serving; every L3 write fails
            rep = flush(stub, 1.0)
            assert not rep.complete and rep.failed_pages >= (n - 1) * PAGES, rep
            assert stats(ch).storage_errors > before.storage_errors
            r.start()  # back, empty (no persistence): the retries must fill it again
            deadline = time.monotonic() + 15
            while not (rep := flush(stub)).complete:
                assert time.monotonic() < deadline, f"L3 not complete after Redis came back: {rep}"
                time.sleep(0.05)
            assert rep.dropped_pages == 0, rep
            assert r.client().dbsize() >= (n - 1) * PAGES  # every page written during the outage is in Redis
            clear(stub)  # L1 and L2 empty: what ReadPages returns now came from Redis
            for p in range(1, n):
                assert read(stub, p)[0] == page_bytes(p, bpp), p
            after = stats(ch)
            assert after.hit_tokens_l3 - before.hit_tokens_l3 == (n - 1) * PAGES * PS
            assert after.storage_corrupt_pages == before.storage_corrupt_pages
            assert_whole(node, ch, "redis outage")
    finally:
        if node is not None:
            bg.run(node.stop(0.1))
        r.stop()


def test_damaged_page_files_are_misses_and_counted_never_wrong_bytes(bg: Background, tmp_path: Path) -> None:
    store = tmp_path / "l3"
    node = start_node(bg, tmp_path, cache=CACHE, storage={"url": f"file://{store}", **L3})
    try:
        assert node.cache is not None and isinstance(node.cache.storage, FileBackend)
        fs = node.cache.storage
        bpp = node.cache.layout.bytes_per_page
        cases = ("corrupt", "truncated", "deleted", "intact")
        with grpc.insecure_channel(f"127.0.0.1:{node.port}") as ch:
            stub = pb_grpc.HiCacheStub(ch)
            keys = {}
            for p in range(len(cases)):
                write(stub, p, bpp)
                data, keys[p] = read(stub, p)
                assert data == page_bytes(p, bpp) and len(keys[p]) == PAGES
            assert flush(stub).complete
            clear(stub)
            before = stats(ch)
            for p, case in enumerate(cases):  # page 1 of each prompt damaged (page 0 stays good)
                f = Path(fs.path(keys[p][1]))
                raw = f.read_bytes()
                if case == "corrupt":  # one byte flipped in the page's data
                    i = len(raw) - bpp // 2
                    f.write_bytes(raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1:])
                elif case == "truncated":
                    f.write_bytes(raw[: len(raw) - 7])
                elif case == "deleted":
                    f.unlink()
            for p, case in enumerate(cases):
                data, _ = read(stub, p)
                whole = page_bytes(p, bpp)
                want = whole if case == "intact" else whole[:bpp]  # the prefix up to the damaged page
                assert data == want, (case, len(data))
            after = stats(ch)
            assert after.storage_corrupt_pages - before.storage_corrupt_pages == 2, after
            assert after.hit_tokens_l3 - before.hit_tokens_l3 == (3 * 1 + PAGES) * PS, after
            for p, case in enumerate(cases[:3]):  # the damaged files are gone: a plain miss now, not counted again
                clear(stub)
                assert read(stub, p)[0] == page_bytes(p, bpp)[:bpp], case
            assert stats(ch).storage_corrupt_pages == after.storage_corrupt_pages
            assert_whole(node, ch, "damaged files")
    finally:
        bg.run(node.stop(0.1))
