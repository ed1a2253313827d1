"""A node's L2 hit figures -- ``Stats.hit_tokens_l2``, ``hicache_hit_tokens_total{tier="l2"}`` and the bench's
gRPC target -- count tokens loaded back onto L1, not tokens Match found on L2; peeks count in
``hicache_peeks_total`` only, not as lookups or hits. A real ``hicache serve`` whose L1 is taken whole by a
request in flight when another request's Prefetch (or a Match that loads) tries to load its L2 run; a Match
refused for it counts nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from metricskit import key, scrape

from hicache.bench.targets import GrpcTarget
from hicache.bench.workloads import TraceRequest
from hicache.client import HiCacheClient
from service.service_harness import ServerProc, serve_prompt, start_server

PS = 16  # the harness's page size
L1 = 16  # pages


@pytest.fixture
def node(tmp_path: Path) -> Iterator[ServerProc]:
    server = start_server(tmp_path, cache={"write_policy": "write_through", "l1_tokens": L1 * PS,
                                           "l2_tokens": 64 * PS})
    try:
        yield server
    finally:
        server.terminate()


def hog(c: HiCacheClient, rid: str) -> None:
    """Open ``rid`` and have it own every L1 page (evicting what is cached there, backed up to L2)."""
    c.match(np.arange(900_000, 900_000 + PS, dtype=np.uint32), rid)
    c.allocate(rid, L1)


def test_l2_hits_are_tokens_loaded_back(node: ServerProc) -> None:
    doc = np.arange(1, 6 * PS + 1, dtype=np.uint32)
    with HiCacheClient(node.target) as c:
        c.wait_ready(timeout_s=30)
        serve_prompt(c, doc, "w")  # 6 pages on L1, backed up to L2
        hog(c, "hog")  # ... and off L1 now: the document is on L2 only
        base = c.stats()

        # peeks: nothing is served, so no lookup and no hit
        p = c.match(doc, peek=True)
        assert (p.l1_pages, p.l2_pages) == (0, 6)
        st = c.stats()
        assert (st.lookups, st.lookup_tokens, st.hit_tokens_l1, st.hit_tokens_l2) == (
            base.lookups, base.lookup_tokens, base.hit_tokens_l1, base.hit_tokens_l2)
        assert scrape(node.metrics_port)[key("hicache_peeks_total")] == 1

        # a Match that would load the run onto L1 and finds no room is refused, opens nothing, counts nothing
        with pytest.raises(grpc.RpcError) as ei:
            c.match(doc, "refused", load=True)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        st = c.stats()
        assert (st.lookups, st.lookup_tokens, st.hit_tokens_l1, st.hit_tokens_l2, st.open_requests) == (
            base.lookups, base.lookup_tokens, base.hit_tokens_l1, base.hit_tokens_l2, base.open_requests)
        assert scrape(node.metrics_port).get(key("hicache_l2_unserved_tokens_total", reason="no_room"), 0) == 0

        # the L2 run finds no room on L1: recomputed, not a hit
        m = c.match(doc, "a")
        assert (m.l1_pages, m.l2_pages) == (0, 6)
        with pytest.raises(grpc.RpcError) as ei:
            list(c.prefetch("a"))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        c.release("a")
        st = c.stats()
        assert (st.lookups, st.hit_tokens_l2) == (base.lookups + 1, base.hit_tokens_l2)
        got = scrape(node.metrics_port)
        assert got[key("hicache_l2_unserved_tokens_total", reason="no_room")] == 6 * PS
        assert got[key("hicache_hit_tokens_total", tier="l2")] == base.hit_tokens_l2

    # the bench's gRPC target: the same request recomputed while L1 is taken, served once it is free
    with GrpcTarget(f"grpc://{node.target}") as t:
        full = t.serve(TraceRequest(doc))
        assert (full.l2, full.reused) == (0, 0)
        t.client.release("hog")
        roomy = t.serve(TraceRequest(doc))
        assert (roomy.l2, roomy.reused) == (6 * PS, 6 * PS)
        st = t.client.stats()
    assert st.hit_tokens_l2 == base.hit_tokens_l2 + 6 * PS
    got = scrape(node.metrics_port)
    assert got[key("hicache_l2_unserved_tokens_total", reason="no_room")] == 2 * 6 * PS
    assert got[key("hicache_l2_unserved_tokens_total", reason="not_loaded")] == 0
