"""A node's L3 hit figures -- ``Stats.hit_tokens_l3``, ``hicache_hit_tokens_total{tier="l3"}``,
``PrefetchProgress.loaded_l3_pages`` and the bench's gRPC target -- count tokens served from L3, not tokens
the store reported at Match. A real ``hicache serve`` over a file store; a page leaves the store, or is
damaged, between the Match and the Prefetch that follows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from metricskit import key, scrape

from hicache.bench.targets import GrpcTarget
from hicache.bench.workloads import TraceRequest
from hicache.client import HiCacheClient
from service.service_harness import ServerProc, serve_prompt, start_server

PS = 16  # the harness's page size
PAGES = 8


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[ServerProc, Path]]:
    store = tmp_path / "l3"
    server = start_server(tmp_path, cache={"write_policy": "write_through"},
                          storage={"url": f"file://{store}", "prefetch_policy": "wait_complete",
                                   "prefetch_threshold_tokens": 0})
    try:
        yield server, store
    finally:
        server.terminate()


def page_file(store: Path, page_key: bytes) -> Path:
    return next(store.rglob(page_key.hex() + ".page"))


def test_stats_and_metrics_count_only_served_l3_tokens(node: tuple[ServerProc, Path]) -> None:
    server, store = node
    with HiCacheClient(server.target) as c:
        c.wait_ready(timeout_s=30)
        tokens = np.arange(1, PAGES * PS + 1, dtype=np.uint32)
        serve_prompt(c, tokens, "w")
        assert c.flush().complete
        c.clear()  # on L3 only now

        m = c.match(tokens, "a", return_keys=True)
        assert m.l3_pages == PAGES
        page_file(store, m.page_keys[5]).unlink()  # gone before the prefetch reads it
        last = list(c.prefetch("a"))[-1]
        assert last.done and last.loaded_l3_pages == 5 and len(last.device_indices) == 5
        st = c.stats()
        assert st.hit_tokens_l3 == 5 * PS
        got = scrape(server.metrics_port)
        assert got[key("hicache_hit_tokens_total", tier="l3")] == 5 * PS
        assert got[key("hicache_l3_matched_tokens_total")] == PAGES * PS
        assert got[key("hicache_l3_unserved_tokens_total", reason="missing")] == 3 * PS
        c.release("a")

        # the bench's gRPC target reports the served figure too: page 2 damaged (the store still lists it)
        other = tokens + 10_000
        serve_prompt(c, other, "w2")
        assert c.flush().complete
        c.clear()
        keys = c.match(other, peek=True, skip_l3=True, return_keys=True).page_keys
        f = page_file(store, keys[2])
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    with GrpcTarget(f"grpc://{server.target}") as t:
        out = t.serve(TraceRequest(other))
    assert (out.l3, out.reused) == (2 * PS, 2 * PS)
    with HiCacheClient(server.target) as c:
        assert c.stats().hit_tokens_l3 == 7 * PS
    got = scrape(server.metrics_port)
    assert got[key("hicache_l3_matched_tokens_total")] == 2 * PAGES * PS
    assert got[key("hicache_l3_unserved_tokens_total", reason="missing")] == 9 * PS
