"""Belady on the prefix tree bounds every online policy; the infinite bound bounds Belady."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.bench.optimal import belady, infinite, page_trace
from hicache.bench.run import policy_hit_rate
from hicache.bench.workloads import TraceRequest
from hicache.eviction import policy_names

PAGE = 2


@st.composite
def traces(draw: st.DrawFn) -> list[TraceRequest]:
    """Requests built from a few shared prefixes, random suffixes and outputs, over a tiny alphabet."""
    stems = draw(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=8), min_size=1, max_size=4))
    reqs = []
    for _ in range(draw(st.integers(1, 14))):
        stem = draw(st.sampled_from(stems))
        tail = draw(st.lists(st.integers(0, 3), max_size=8))
        out = draw(st.lists(st.integers(0, 3), max_size=4))
        reqs.append(TraceRequest(np.array(stem + tail, np.uint32), np.array(out, np.uint32)))
    return reqs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=traces(), cap=st.integers(1, 12))
def test_optimum_bounds_every_policy(reqs: list[TraceRequest], cap: int) -> None:
    pt = page_trace(reqs, PAGE)
    opt = belady(pt, cap)
    assert opt.hit_rate <= infinite(pt).hit_rate + 1e-12
    assert belady(pt, cap + 1).hit_tokens >= opt.hit_tokens  # more room never hurts the optimum
    for policy in policy_names():
        assert policy_hit_rate(reqs, PAGE, cap * PAGE, policy) <= opt.hit_rate + 1e-12, policy


def test_optimum_beats_lru_on_a_scan() -> None:
    """A looping scan larger than the cache: LRU always misses, Belady keeps part of it."""
    reqs = [TraceRequest(np.array([k, k, 9, 9], np.uint32)) for k in range(5)] * 4
    pt = page_trace(reqs, 2)
    assert policy_hit_rate(reqs, 2, 2 * 4, "lru") == 0.0
    assert belady(pt, 4).hit_rate >= 0.3
    assert infinite(pt).hit_rate == 0.75


def brute_force_hit_pages(reqs: list[TraceRequest], page: int, cap: int) -> int:
    """Best total prompt-page hits over *every* choice of what to keep after each request (any subset of
    what was cached plus the request's own pages, at most ``cap``) -- exhaustive, for tiny traces."""
    from itertools import combinations

    pt = page_trace(reqs, page)
    states: dict[frozenset[int], int] = {frozenset(): 0}
    for pp, xx in zip(pt.prompt, pt.extra, strict=True):
        nxt: dict[frozenset[int], int] = {}
        for s, val in states.items():
            k = 0
            while k < len(pp) and pp[k] in s:
                k += 1
            avail = sorted(s | set(pp) | set(xx))
            for n in range(min(cap, len(avail)) + 1):
                for keep in combinations(avail, n):
                    f = frozenset(keep)
                    if nxt.get(f, -1) < val + k:
                        nxt[f] = val + k
        states = nxt
    return max(states.values())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=traces(), cap=st.integers(1, 4))
def test_belady_equals_exhaustive_optimum(reqs: list[TraceRequest], cap: int) -> None:
    reqs = reqs[:6]
    pt = page_trace(reqs, PAGE)
    if pt.num_pages > 9:
        reqs = reqs[:3]
        pt = page_trace(reqs, PAGE)
    assert int(belady(pt, cap).hit_pages.sum()) == brute_force_hit_pages(reqs, PAGE, cap)
