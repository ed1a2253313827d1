"""A tenant's Clear: ``HiCache.clear(namespaces)`` drops the given namespaces' unheld, unpinned L1 and L2
pages and no other's; over gRPC, a token limited to some tenants clears those tenants' pages alone, while a
Clear of every tenant's pages (an every-tenant token, the single-token mode, auth off) needs admin rights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tenantkit import compute, held, hits, make, prompt

from hicache.client import AsyncHiCacheClient, CallError
from hicache.config import HiCacheConfig, config_from_dict
from hicache.service.server import NodeServer

C = grpc.StatusCode
PS = 4


def test_clear_of_one_namespace_leaves_the_others_on_both_tiers() -> None:
    cache = make(None, l1=16, l2=32)
    a, b = cache.ns.with_tenant("a"), cache.ns.with_tenant("b")
    try:
        for tag, ns in ((1, a), (2, a), (3, b), (4, b)):
            compute(cache, prompt(tag, 3), ns, seed=tag)
        cache.evict(l1_pages=6)  # some pages on L2 alone (the oldest: prompt 1's, prompt 2's)
        before_a, before_b = held(cache, a), held(cache, b)
        assert before_a[1] == 6 and before_b[1] == 6 and sum(before_a) + sum(before_b) > 12
        l1, l2 = cache.clear([a])
        assert (l1, l2) == before_a and held(cache, a) == (0, 0)
        assert held(cache, b) == before_b  # the other tenant's pages are where they were
        assert hits(cache, prompt(3, 3), b) == (3, 0)
        assert cache.clear([a]) == (0, 0)  # nothing of a's is left
        cache.check_integrity()
    finally:
        cache.close()


def test_a_tenants_clear_keeps_what_its_requests_hold_and_its_pins() -> None:
    cache = make(None, l1=16, l2=32)
    a = cache.ns.with_tenant("a")
    try:
        for tag in (1, 2, 3):
            compute(cache, prompt(tag, 2), a, seed=tag)
        req = cache.match(prompt(1, 2), a)  # held by a request in flight
        pin = cache.pin(prompt(2, 2), a)
        l1, _ = cache.clear([a])
        assert l1 == 2  # prompt 3's pages alone
        assert hits(cache, prompt(1, 2), a)[0] == hits(cache, prompt(2, 2), a)[0] == 2
        cache.release(req)
        cache.unpin(pin.pin_id)
        assert cache.clear([a])[0] == 4
        assert held(cache, a) == (0, 0)
        cache.check_integrity()
    finally:
        cache.close()


TOKENS_FILE = """tokens:
  - {name: acme-app, token: tok-acme, tenants: [acme]}
  - {name: duo, token: tok-duo, tenants: [acme, beta]}
  - {name: every, token: tok-every, tenants: ["*"]}
  - {name: ops, token: tok-ops, admin: true}
"""


def _config(**serve: Any) -> HiCacheConfig:
    return config_from_dict({
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": PS},
        "cache": {"l1_tokens": 64 * PS, "l2_tokens": 64 * PS},
        "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0, **serve},
    })


def toks(seed: int) -> np.ndarray:
    return (np.arange(3 * PS, dtype=np.uint32) + 1000 * seed).astype(np.uint32)


async def _code(aw: Awaitable[Any]) -> C:
    try:
        await aw
    except (grpc.aio.AioRpcError, CallError) as e:
        return e.code()
    return C.OK


async def _fill(c: AsyncHiCacheClient, bpp: int) -> None:
    for seed, tenant in enumerate(("acme", "beta", "gamma")):
        await c.write_pages(toks(seed), bytes(3 * bpp), tenant=tenant)


async def _on_l1(c: AsyncHiCacheClient) -> list[int]:
    return [(await c.match(toks(seed), tenant=t, peek=True)).l1_pages
            for seed, t in enumerate(("acme", "beta", "gamma"))]


def test_clear_over_grpc_is_scoped_to_the_tokens_tenants(tmp_path: Path) -> None:
    async def main() -> None:
        f = tmp_path / "tokens.yaml"
        f.write_text(TOKENS_FILE)
        n = NodeServer(_config(auth_tokens_file=str(f)))
        await n.start()
        assert n.cache is not None
        bpp = n.cache.layout.bytes_per_page
        c = {w: AsyncHiCacheClient(f"127.0.0.1:{n.port}", token=f"tok-{w}", timeout_s=5)
             for w in ("acme", "duo", "every", "ops")}
        try:
            await _fill(c["ops"], bpp)
            assert (await c["acme"].clear()).l1_pages == 3
            assert await _on_l1(c["ops"]) == [0, 3, 3]
            assert (await c["duo"].clear()).l1_pages == 3  # beta's; acme's are gone already
            assert await _on_l1(c["ops"]) == [0, 0, 3]
            # every tenant's pages at once is node-wide: an admin token's call, not an every-tenant token's
            assert await _code(c["every"].clear()) == C.PERMISSION_DENIED
            assert await _on_l1(c["ops"]) == [0, 0, 3]
            await _fill(c["ops"], bpp)
            cleared = await c["ops"].clear()
            assert (cleared.l1_pages, cleared.l2_pages) == (9, 9)
            st = await c["ops"].stats()
            assert (st.l1_pages_used, st.l2_pages_used, st.open_requests) == (0, 0, 0)
            n.cache.check_integrity()
        finally:
            for cl in c.values():
                await cl.close()
            await n.stop(0.1)

    asyncio.run(main())


def test_the_single_token_mode_clears_every_tenant(tmp_path: Path) -> None:
    async def main() -> None:
        n = NodeServer(_config(auth_token="tok-one"))
        await n.start()
        assert n.cache is not None
        c = AsyncHiCacheClient(f"127.0.0.1:{n.port}", token="tok-one", timeout_s=5)
        try:
            await _fill(c, n.cache.layout.bytes_per_page)
            assert (await c.clear()).l1_pages == 9
            assert await _on_l1(c) == [0, 0, 0]
        finally:
            await c.close()
            await n.stop(0.1)

    asyncio.run(main())
