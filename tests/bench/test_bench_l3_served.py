"""The bench's L3 column counts tokens served from L3, not tokens the store reported at match time.

A page the store holds at match but fails to deliver (here: damaged on disk, so ``exists`` still says yes
and the read's verification says no) is recomputed, so it is not a hit: the in-process target reports what
the request's prefetch landed and loaded back, and the hit rate follows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hicache.bench.replay import replay
from hicache.bench.run import replay_config
from hicache.bench.targets import InProcessTarget
from hicache.bench.workloads import TraceRequest
from hicache.keys import page_keys_from_bytes, tokens_to_bytes

PAGE = 8


def damage(target: InProcessTarget, tokens: np.ndarray, page: int) -> None:
    cache = target.cache
    k = page_keys_from_bytes(cache.ns.digest, tokens_to_bytes(tokens), PAGE)[page]
    path = Path(cache.storage.path(k))  # type: ignore[union-attr]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_in_process_l3_hits_are_tokens_served(tmp_path: Path) -> None:
    doc = np.arange(8 * PAGE, dtype=np.uint32)  # 8 pages
    req = TraceRequest(doc)
    cfg = replay_config(PAGE, 256, 256, f"file://{tmp_path / 'l3'}", write_policy="write_through")
    with InProcessTarget(cfg) as t:
        first = replay([req], t, settle=True)
        assert first.hit.tolist() == [0]
        t.cache.clear()  # the document is on L3 only now
        whole = replay([req], t, settle=True)
        assert (whole.l3.tolist(), whole.reused.tolist()) == ([64], [64])

        t.cache.clear()
        damage(t, doc, 3)
        got = replay([req], t, settle=True)
    # the store reported all 8 pages; pages 0-2 were served, page 3 failed verification (and so nothing after)
    assert got.l3.tolist() == [24] and got.reused.tolist() == [24]
    assert got.hit_rate == 24 / 64
    assert got.stats["storage"]["corrupt_pages"] == 1
