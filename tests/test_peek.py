"""A peek (a router's or scheduler's "how much is cached?") answers what a Match would find, per tier, and
changes nothing: no recency, no hit counts, nothing the eviction policy sees, no lock or pin left behind.
It is a walk under the tree lock, not a match and a release: these tests hold it to the match's answers."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from hicache.cache import HiCache
from kvhelpers import commit_fresh, small_config

P = 4  # tokens per page (small_config)


@pytest.fixture
def cache() -> Iterator[HiCache]:
    c = HiCache(small_config(cache={"write_policy": "write_through"}, storage={"url": "memory://"}))
    yield c
    c.close()


def state(cache: HiCache) -> list[tuple[int, int, int, int]]:
    out = []
    stack = list(cache.tree.roots.values())
    while stack:
        n = stack.pop()
        out.append((id(n), n.last_access, n.hit_count, n.lock_ref))
        stack.extend(n.children.values())
    return sorted(out)


@pytest.mark.parametrize("l3", [False, True])
@pytest.mark.parametrize("keys", [False, True])
def test_peek_answers_what_a_match_finds_and_touches_nothing(cache: HiCache, l3: bool, keys: bool) -> None:
    doc = list(range(1000, 1000 + 6 * P))
    commit_fresh(cache, doc, 1)
    cache.flush(timeout_s=10)  # write-through's backup holds a lock until its copy lands: let it finish first
    for probe in (doc, doc[: 3 * P], doc[: 3 * P] + [7] * (2 * P), [9] * (3 * P), [*doc, 1, 2]):
        before = state(cache)
        peeks = cache.metrics.peeks._value.get()
        p = cache.peek(np.asarray(probe, dtype=np.uint32), l3=l3, keys=keys)
        assert state(cache) == before or len(state(cache)) > len(before)  # a partial page run may split a node
        assert cache.metrics.peeks._value.get() == peeks + 1
        assert p.released and p.lock_node is None and p.pin_node is None
        m = cache.match(probe, l3=l3, keys=keys, count=False)
        try:
            assert (p.l1_pages, p.l2_pages, p.l3_pages, p.num_pages) == (m.l1_pages, m.l2_pages, m.l3_pages,
                                                                         m.num_pages)
            assert np.array_equal(p.device_indices, m.device_indices)
            assert p.keys == m.keys
        finally:
            cache.release(m)


def test_peek_leaves_recency_and_hits_alone(cache: HiCache) -> None:
    doc = list(range(2000, 2000 + 4 * P))
    commit_fresh(cache, doc, 2)
    cache.flush(timeout_s=10)
    before = state(cache)
    for _ in range(5):
        cache.peek(doc)
    assert state(cache) == before
    cache.release(cache.match(doc))
    assert state(cache) != before  # a real match does touch
