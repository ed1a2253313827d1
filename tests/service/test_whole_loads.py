"""A Prefetch replies once every layer is on L1, so the node asks its transfer engine for a whole load
(``layer_wise=False``: the engine may move whole pages instead of making early layers ready first);
an in-process caller that computes layer by layer gets the default, layer-wise load."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from hicache.client import AsyncHiCacheClient
from hicache.config import config_from_dict
from hicache.service.server import NodeServer

PS = 4
PAGES = 8


def config() -> Any:
    return config_from_dict({
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": PS},
        "cache": {"l1_tokens": 64 * PS, "l2_tokens": 64 * PS, "write_policy": "write_through"},
        "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0},
    })


def test_prefetch_asks_for_whole_loads_and_gets_the_pages_back() -> None:
    async def main() -> None:
        node = NodeServer(config())
        await node.start()
        try:
            cache = node.cache
            assert cache is not None
            hints: list[bool] = []
            load = cache.transfer.load

            def recording_load(host_idx: np.ndarray, device_idx: np.ndarray, layer_wise: bool = True) -> Any:
                hints.append(layer_wise)
                return load(host_idx, device_idx, layer_wise=layer_wise)

            cache.transfer.load = recording_load  # type: ignore[method-assign]
            toks = np.arange(1, PAGES * PS + 1, dtype=np.uint32)
            async with AsyncHiCacheClient(f"127.0.0.1:{node.port}") as c:
                m = await c.match(toks, "w")
                new = await c.allocate("w", m.num_pages)
                kv = cache.device_pool.kv
                rng = np.random.default_rng(0)
                written = []
                for row in kv:  # the "model" writes the prompt's KV into the pages it was given
                    for t in row:
                        t[new] = torch.from_numpy(rng.standard_normal(t[new].shape).astype(np.float32))
                        written.append(t[new].clone())
                await c.commit("w", toks, new)
                await c.release("w")
                cache.flush()
                cache.evict(l1_pages=10**6)  # only L2 holds the pages now
                m = await c.match(toks, "r")
                assert (m.l1_pages, m.l2_pages) == (0, PAGES)
                done = [p async for p in c.prefetch("r")]
                assert done[-1].done
                m2 = await c.match(toks, "again")
                assert m2.l1_pages == PAGES
                got = [t[torch.from_numpy(m2.device_indices)] for row in kv for t in row]
                assert all(torch.equal(a, b) for a, b in zip(got, written, strict=True))
                await c.release("r")
                await c.release("again")
            assert hints == [False]  # the gRPC Prefetch asked for one whole load
            cache.check_integrity()

            # an in-process caller (match + load_back, computing layer by layer) gets the default,
            # layer-wise load from the same node's cache
            cache.evict(l1_pages=10**6)
            req = cache.match(toks)
            assert (req.l1_pages, req.l2_pages) == (0, PAGES)
            res = cache.load_back(req)
            for layer in range(len(kv)):
                res.wait_layer(layer)
            res.wait()
            assert hints == [False, True]
            idx = torch.from_numpy(np.asarray(res.device_indices))
            assert len(idx) == PAGES
            got = [t[idx] for row in kv for t in row]
            assert all(torch.equal(a, b) for a, b in zip(got, written, strict=True))
            cache.release(req)
            cache.check_integrity()
        finally:
            await node.stop()

    asyncio.run(main())
