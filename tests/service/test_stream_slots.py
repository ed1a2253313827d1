"""Long-lived streams and dead clients.

* An open MatchStream takes no ``serve.max_concurrency`` slot while idle: with ``max_concurrency: 4``, four
  idle streams leave room for Stats, Match, Allocate and Commit. Its messages count while handled: one that
  finds no room gets a RESOURCE_EXHAUSTED reply and the stream goes on.
* The requests a MatchStream opened and that are still open when it ends (closed by its client, or the client
  gone) are released then, and only those: one released since, or reopened under the same id by another
  call, is left alone.
* The idle TTL that catches a dead unary client is short by default (two minutes, not ten), the same for
  ``hicache serve`` and ``NodeServer``, documented, and it does release an abandoned request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hicache.client import AsyncHiCacheClient, CallError
from hicache.config import config_from_dict
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.service.requests import DEFAULT_REQUEST_TTL_S
from hicache.service.server import NodeServer

C = grpc.StatusCode
PS = 4
REPO = Path(__file__).resolve().parents[2]


def node_config(**serve: Any) -> Any:
    return config_from_dict({
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": PS},
        "cache": {"l1_tokens": 512, "l2_tokens": 512},
        "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0, **serve},
    })


@asynccontextmanager
async def node(request_ttl_s: float = DEFAULT_REQUEST_TTL_S, **serve: Any) -> AsyncIterator[NodeServer]:
    server = NodeServer(node_config(**serve), request_ttl_s=request_ttl_s)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.1)


def toks(seed: int, pages: int = 2) -> np.ndarray:
    return (np.arange(pages * PS, dtype=np.uint32) + 1000 * seed).astype(np.uint32)


async def settle(cond: Any, timeout_s: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


def test_idle_match_streams_leave_room_for_unary_calls() -> None:
    async def main() -> None:
        async with node(max_concurrency=4) as n, AsyncHiCacheClient(f"127.0.0.1:{n.port}", timeout_s=5) as c:
            streams = [c.match_stream() for _ in range(4)]
            for s in streams:  # each stream open on the node (a message answered), then idle
                assert (await s.match(toks(1), peek=True)).num_pages == 2
            assert n.servicer.inflight == 0
            await c.stats()
            m = await c.match(toks(2), "r")
            new = await c.allocate("r", m.num_pages)
            await c.commit("r", toks(2), np.concatenate([m.device_indices, new]))
            await c.release("r")
            # a message that finds every slot taken is refused in band; the stream goes on
            n.servicer.inflight = 4
            try:
                with pytest.raises(CallError) as ei:
                    await streams[0].match(toks(1), peek=True)
                assert ei.value.code() == C.RESOURCE_EXHAUSTED and "max_concurrency" in ei.value.details()
            finally:
                n.servicer.inflight = 0
            assert (await streams[0].match(toks(2), peek=True)).l1_pages == 2
            for s in streams:
                await s.close()

    asyncio.run(main())


def test_what_a_stream_opened_is_released_when_it_ends() -> None:
    async def main() -> None:
        async with node() as n, AsyncHiCacheClient(f"127.0.0.1:{n.port}", timeout_s=5) as c:
            cache = n.cache
            assert cache is not None
            for seed in (3, 4):  # cached, so the streams' matches lock L1 pages
                m = await c.match(toks(seed), f"w{seed}")
                await c.commit(f"w{seed}", toks(seed),
                               np.concatenate([m.device_indices, await c.allocate(f"w{seed}", m.num_pages)]))
                await c.release(f"w{seed}")
            cache.flush()
            assert cache.tree.locked_device_pages == 0
            s = c.match_stream()
            named = await s.match(toks(3), "named")
            made_up = await s.match(toks(4))
            again = await s.match(toks(3), "again")
            assert named.l1_pages == made_up.l1_pages == again.l1_pages == 2
            await c.release("again")  # released since: its id reopened by a unary Match, not the stream's now
            kept = await c.match(toks(4), "again")
            assert n.servicer.open_requests == 3
            await s.close()
            await settle(lambda: n.servicer.open_requests == 1)
            assert kept.l1_pages == 2
            await c.release("again")  # the unary one was still open
            assert n.servicer.open_requests == 0
            await settle(lambda: cache.tree.locked_device_pages == 0)
            cache.check_integrity()

    asyncio.run(main())


def test_a_dead_clients_stream_releases_what_it_opened() -> None:
    async def main() -> None:
        async with node() as n:
            ch = grpc.aio.insecure_channel(f"127.0.0.1:{n.port}")
            stub = pb_grpc.HiCacheStub(ch)
            call = stub.MatchStream()
            await call.write(pb.MatchRequest(request_id="gone", tokens=toks(5).tobytes()))
            assert (await call.read()).request_id == "gone"
            assert n.servicer.open_requests == 1
            await ch.close()  # no half-close, no Release: the client is gone
            await settle(lambda: n.servicer.open_requests == 0)
            assert n.cache is not None
            await settle(lambda: n.cache is not None and n.cache.tree.locked_device_pages == 0)
            n.cache.check_integrity()

    asyncio.run(main())


def test_the_idle_ttl_is_short_by_default_and_releases_an_abandoned_request() -> None:
    from hicache.cli import build_parser

    assert DEFAULT_REQUEST_TTL_S <= 120
    assert NodeServer.__init__.__defaults__ is not None and DEFAULT_REQUEST_TTL_S in NodeServer.__init__.__defaults__
    args = build_parser("serve").parse_args(["serve"])
    assert args.request_ttl_s == DEFAULT_REQUEST_TTL_S
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"`--request-ttl-s`, {DEFAULT_REQUEST_TTL_S:g} s by default" in readme

    async def main() -> None:
        async with node(request_ttl_s=0.2) as n, AsyncHiCacheClient(f"127.0.0.1:{n.port}", timeout_s=5) as c:
            await c.match(toks(6), "abandoned")
            assert n.servicer.open_requests == 1
            cache = n.cache
            assert cache is not None
            expired = lambda: cache.metrics.registry.get_sample_value("hicache_expired_requests_total")  # noqa: E731
            await settle(lambda: expired() == 1)  # expiry runs every 0.5 s at least
            assert n.servicer.open_requests == 0 and cache.tree.locked_device_pages == 0

    asyncio.run(main())
