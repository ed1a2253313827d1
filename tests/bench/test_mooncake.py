"""Replaying the Mooncake trace with unbounded capacity reproduces an independent prefix count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench.optimal import page_trace
from hicache.bench.replay import replay
from hicache.bench.run import replay_config
from hicache.bench.targets import InProcessTarget
from hicache.bench.traces import MOONCAKE_BLOCK, load_trace

TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "synthetic_trace.jsonl"


def independent_ratio(path: Path) -> float:
    """Per request: the leading hash_ids already seen as a prefix chain; only whole 512-token blocks are
    cached (a request's cut last block is not), so a block counts 512 tokens if it is whole here."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for line in path.read_text().splitlines():
        row = json.loads(line)
        ids, n = row["hash_ids"], row["input_length"]
        whole = n // MOONCAKE_BLOCK
        k = 0
        while k < whole and tuple(ids[: k + 1]) in seen:
            k += 1
        hit += k * MOONCAKE_BLOCK
        total += n
        for i in range(whole):
            seen.add(tuple(ids[: i + 1]))
    return hit / total


def test_unbounded_replay_matches_independent_count() -> None:
    reqs = load_trace(TRACE)
    assert len(reqs) == 3993
    distinct = page_trace(reqs, MOONCAKE_BLOCK).num_pages
    cfg = replay_config(MOONCAKE_BLOCK, distinct * MOONCAKE_BLOCK, 0)  # L1 holds every distinct page: no eviction
    with InProcessTarget(cfg) as target:
        res = replay(reqs, target)
    expected = independent_ratio(TRACE)
    assert res.hit_rate == pytest.approx(expected, abs=1e-12)
    assert 0.6 < expected < 0.7  # Mooncake reports ~66% for its synthetic trace (blocks)
    assert res.l2.sum() == res.l3.sum() == 0
    assert res.stats["l1_pages_cached"] == distinct
