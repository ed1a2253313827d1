"""A Prefetch the client cut short (cancelled, or past its deadline) leaves its L3 fetch running for the
request, to be finished by the request's next Prefetch. Meanwhile the request's tokens must not change
under it: a Commit of fewer tokens than were matched would make the fetched pages land on pages of other
tokens (or not fit at all). The node refuses such a commit (FAILED_PRECONDITION); whatever the client
tries next, no call ends INTERNAL, no page of other tokens is served, and the cache stays consistent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from hicache.config import config_from_dict
from hicache.pool import HostPool
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.service.pages import scatter_pages
from hicache.service.server import NodeServer
from hicache.storage.base import StorageContext
from hicache.storage.memory import MemoryBackend

PS = 4
PAGES = 8
SLOW_S = 0.05  # per page read: a prefetch of the prompt takes 0.4 s
C = grpc.StatusCode


class SlowStore(MemoryBackend):
    def batch_get(self, keys: Sequence[bytes], host_pool: HostPool, host_indices: Sequence[int]) -> int:
        time.sleep(SLOW_S * len(keys))
        return super().batch_get(keys, host_pool, host_indices)


def config() -> Any:
    return config_from_dict({
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": PS},
        # write_back: a commit's pages stay on L1 only, so a stray L2 insert would give them a second copy
        "cache": {"l1_tokens": 64 * PS, "l2_tokens": 64 * PS, "write_policy": "write_back"},
        "storage": {"prefetch_policy": "wait_complete", "prefetch_threshold_tokens": 0, "io_batch_pages": 1},
        "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0},
    })


async def call(fn: Any, req: Any) -> tuple[grpc.StatusCode, Any]:
    """OK and the reply, or a refusal's code; never INTERNAL or UNKNOWN."""
    try:
        return C.OK, await fn(req, timeout=10)
    except grpc.aio.AioRpcError as e:
        assert e.code() not in (C.INTERNAL, C.UNKNOWN), f"{e.code()}: {e.details()}"
        return e.code(), None


async def prefetch(stub: pb_grpc.HiCacheStub, rid: str) -> tuple[grpc.StatusCode, list[int]]:
    """A whole Prefetch: its status and the request's prefix on L1 after it."""
    try:
        msgs = [m async for m in stub.Prefetch(pb.PrefetchRequest(request_id=rid), timeout=10)]
        return C.OK, list(msgs[-1].device_indices)
    except grpc.aio.AioRpcError as e:
        assert e.code() not in (C.INTERNAL, C.UNKNOWN), f"Prefetch: {e.code()}: {e.details()}"
        return e.code(), []


async def cut_prefetch(node: NodeServer, stub: pb_grpc.HiCacheStub, rid: str) -> None:
    """Start a Prefetch of ``rid`` with progress messages and cancel it after the first one."""
    stream = stub.Prefetch(pb.PrefetchRequest(request_id=rid, stream_progress=True), timeout=10)
    first = await stream.read()
    assert not first.done and first.pages_total == PAGES
    stream.cancel()
    while node.servicer.inflight:  # the handler lets go of the request
        await asyncio.sleep(0.01)


def test_a_commit_of_fewer_tokens_during_a_cut_prefetch_changes_nothing() -> None:
    async def main() -> None:
        cfg = config()
        ns = cfg.namespace()
        node = NodeServer(cfg, storage=SlowStore("memory://", StorageContext(ns.digest, ns.layout)))
        await node.start()
        cache = node.cache
        assert cache is not None
        bpp = cache.layout.bytes_per_page
        rng = np.random.default_rng(3)
        prompt = np.arange(1, PAGES * PS + 1, dtype=np.uint32)
        other = prompt + 1000  # another prompt of as many pages
        other_bytes = rng.standard_normal(PAGES * bpp // 4).astype(np.float32).tobytes()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
                stub = pb_grpc.HiCacheStub(ch)
                # the prompt's pages are on L3 only
                code, _ = await call(stub.WritePages, _write(prompt, rng.bytes(PAGES * bpp)))
                assert code == C.OK
                cache.evict(l1_pages=10**6)
                cache.flush()
                cache.evict(l2_pages=10**6)

                # a commit of fewer tokens, then another Prefetch: the fetched pages do not fit the tokens
                code, m = await call(stub.Match, pb.MatchRequest(request_id="a", tokens=prompt.tobytes()))
                assert code == C.OK and m.l3_pages == PAGES
                await cut_prefetch(node, stub, "a")
                short = pb.CommitRequest(request_id="a", tokens=prompt[: PS - 1].tobytes())  # no full page
                await call(stub.Commit, short)
                code, dev = await prefetch(stub, "a")
                assert code == C.OK and len(dev) == PAGES
                code, r = await call(stub.Commit, pb.CommitRequest(request_id="a", tokens=prompt.tobytes(),
                                                                   device_indices=dev))
                assert code == C.OK and r.new_pages == 0, "the request is still usable"
                assert (await call(stub.Release, pb.ReleaseRequest(request_id="a")))[0] == C.OK
                cache.clear()

                # the same, then a commit of other tokens: their L1 pages must not get the fetched ones as
                # their L2 copies
                code, m = await call(stub.Match, pb.MatchRequest(request_id="b", tokens=prompt.tobytes()))
                assert code == C.OK and m.l3_pages == PAGES
                await cut_prefetch(node, stub, "b")
                await call(stub.Commit, pb.CommitRequest(request_id="b", tokens=prompt[: PS - 1].tobytes()))
                code, new = await call(stub.Allocate, pb.AllocateRequest(request_id="b", num_pages=PAGES))
                assert code == C.OK
                scatter_pages(cache.device_pool, np.asarray(new.device_indices), other_bytes)
                await call(stub.Commit, pb.CommitRequest(request_id="b", tokens=other.tobytes(),
                                                         device_indices=new.device_indices))
                assert (await prefetch(stub, "b"))[0] == C.OK
                assert (await call(stub.Release, pb.ReleaseRequest(request_id="b")))[0] == C.OK
                cache.evict(l1_pages=10**6)  # what is still cached of `other` is served from L2 now
                data = b"".join([c.data async for c in stub.ReadPages(
                    pb.ReadPagesRequest(tokens=other.tobytes()), timeout=10)])
                assert data == other_bytes[: len(data)], "pages of other tokens were served"

            cache.check_integrity()
            cache.clear()
            assert cache.device_pool.allocator.used_pages == 0
            assert cache.host_pool.allocator.used_pages == 0
        finally:
            await node.stop(0.1)

    asyncio.run(main())


def _write(tokens: np.ndarray, data: bytes) -> Any:
    return iter([pb.WritePagesChunk(header=pb.WritePagesHeader(tokens=tokens.tobytes())),
                 pb.WritePagesChunk(data=data)])
