"""``cache.tenant_shares`` on a running ``hicache serve``: tenants named over gRPC (``Match`` namespace)
get the shares of the node's config file; a heavier tenant capped at its share leaves another tenant's
prefixes on L1, and ``/metrics`` shows what each named tenant holds."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import numpy as np

from hicache.client import HiCacheClient

from .service_harness import LAYOUT, ServerProc, serve_prompt

PS = LAYOUT["page_size"]
L1_PAGES = 16


def prompt(tag: int, pages: int) -> np.ndarray:
    return np.arange(tag * 100_000, tag * 100_000 + pages * PS, dtype=np.uint32)


def test_a_capped_tenant_over_grpc_leaves_the_other_its_prefixes(server_factory: Callable[..., ServerProc]) -> None:
    for shares in ({"noisy": 0.25}, {}):
        srv = server_factory(cache={"l1_tokens": L1_PAGES * PS, "l2_tokens": 0, "eviction_policy": "lru",
                                    "tenant_shares": shares})
        docs = [prompt(i, 3) for i in range(3)]
        with HiCacheClient(srv.target, timeout_s=20) as c:
            for i, d in enumerate(docs):
                serve_prompt(c, d, f"a{i}", tenant="acme")
            for i in range(20):
                serve_prompt(c, prompt(100 + i, 2), f"n{i}", tenant="noisy")
            found = []
            for i, d in enumerate(docs):
                m = c.match(d, f"q{i}", tenant="acme")
                found.append(m.l1_pages)
                c.release(f"q{i}")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
        if shares:
            assert found == [3, 3, 3]
            assert 'hicache_tenant_share{tenant="noisy"} 0.25' in metrics
            series = 'hicache_tenant_pages{tenant="noisy",tier="l1"}'
            held = [ln for ln in metrics.splitlines() if ln.startswith(series)]
            assert len(held) == 1 and 4 <= float(held[0].split()[-1]) <= L1_PAGES - 9, held
        else:
            assert found == [0, 0, 0]
            assert "hicache_tenant_pages{" not in metrics


def test_a_tenant_whose_pages_come_from_a_peer_is_capped(server_factory: Callable[..., ServerProc]) -> None:
    """noisy's pages reach this node only through WritePages (a peer's computed pages, no Match of its
    own): they count against noisy's share all the same, and acme keeps its prefixes."""
    srv = server_factory(cache={"l1_tokens": L1_PAGES * PS, "l2_tokens": 0, "eviction_policy": "lru",
                                "tenant_shares": {"noisy": 0.25}})
    L = LAYOUT
    page_bytes = L["num_layers"] * 2 * PS * L["num_kv_heads"] * L["head_dim"] * 2  # float16
    docs = [prompt(i, 3) for i in range(3)]
    with HiCacheClient(srv.target, timeout_s=20) as c:
        for i, d in enumerate(docs):
            serve_prompt(c, d, f"a{i}", tenant="acme")
        for i in range(20):
            data = np.random.default_rng(i).integers(0, 256, 2 * page_bytes, dtype=np.uint8).tobytes()
            res = c.write_pages(prompt(100 + i, 2), data, tenant="noisy")
            assert res.new_pages == 2
        found = []
        for i, d in enumerate(docs):
            found.append(c.match(d, f"q{i}", tenant="acme").l1_pages)
            c.release(f"q{i}")
    assert found == [3, 3, 3]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
    series = 'hicache_tenant_pages{tenant="noisy",tier="l1"}'
    held = [ln for ln in metrics.splitlines() if ln.startswith(series)]
    assert len(held) == 1 and 4 <= float(held[0].split()[-1]) <= L1_PAGES - 9, held
