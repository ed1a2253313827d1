"""The ``arc`` eviction policy on a real RadixTree: what it evicts first on hand-built scenarios, and that
the tree's invariants and the policy's own bookkeeping hold under random request sequences with L1 and L2
eviction. (``lru2`` left the package; ``benchmarks/policy_eval.py`` still compares it.)"""

from __future__ import annotations

import treecache
from hypothesis import given, settings
from hypothesis import strategies as st
from treecache import NS, TreeCache, tb

from hicache.eviction import ARC, make_policy, policy_names
from hicache.radix import RadixTree

PAGE = 2


def keys(tokens: list[int]) -> list[bytes]:
    return treecache.keys(tokens, PAGE)


def content(tag: int, pages: int) -> list[int]:
    """``pages`` pages of tokens unique to ``tag``."""
    return treecache.content(tag, pages, PAGE)


def Cache(policy: str, capacity: int, backup: bool = False) -> TreeCache:
    return TreeCache(policy, capacity, PAGE, backup)


def test_registered() -> None:
    assert "arc" in policy_names()
    assert isinstance(make_policy("arc"), ARC)
    assert make_policy("arc") is not make_policy("arc")


# ---------------------------------------------------------------------------------------------- ARC
def test_arc_evicts_unhit_content_first_while_t1_is_over_target() -> None:
    a, b, c, d = (content(t, 2) for t in range(4))
    lru, arc = Cache("lru", 6), Cache("arc", 6)
    for cache in (lru, arc):
        cache.serve(a)
        cache.serve(a)  # A is hit: T2
        cache.serve(b)
        cache.serve(c)  # B and C: T1; the cache is full
        cache.serve(d)  # needs 2 pages
    assert lru.cached(a) == 0 and lru.cached(b) == 2  # LRU drops A, the oldest
    assert arc.cached(a) == 2 and arc.cached(b) == 0  # ARC drops B: T1 holds 6 > p = 0 pages
    policy = arc.tree.policy
    assert isinstance(policy, ARC) and policy.p == 0 and policy.t1_pages == 4
    assert set(policy.b1) == set(keys(b)) and not policy.b2


def test_arc_ghost_hit_in_b1_grows_t1_target_and_enters_t2() -> None:
    a, b, c, d = (content(t, 2) for t in range(4))
    arc = Cache("arc", 6)
    for x in (a, a, b, c, d):
        arc.serve(x)  # B evicted from T1 into B1, as above
    policy = arc.tree.policy
    assert isinstance(policy, ARC)
    assert arc.serve(b) == 0  # B comes back (a B1 ghost hit of 2 pages); C, the LRU of T1, makes room
    assert arc.cached(c) == 0 and policy.p == 2 and not policy.b1.keys() & set(keys(b))
    node = arc.tree.match(NS, tb(b), touch=False).l1_node
    assert node is not None and node.meta.t2  # recency would have kept it: it starts in T2
    # T1 (D, 2 pages) is now within its target p = 2: T2 goes first, its LRU (A) before B
    arc.serve(content(9, 2))
    assert arc.cached(a) == 0 and arc.cached(b) == 2 and arc.cached(d) == 2


def test_arc_evicts_t2_first_when_t1_is_within_target() -> None:
    arc = Cache("arc", 4)
    policy = arc.tree.policy
    assert isinstance(policy, ARC)
    a, b = content(0, 2), content(1, 2)
    arc.serve(a)
    arc.serve(a)  # A in T2 (2 pages), older
    arc.serve(b)  # B in T1 (2 pages), newer
    policy.p = 3.0  # T1 (2 pages) is within its target
    arc.serve(content(2, 2))
    assert arc.cached(a) == 0 and arc.cached(b) == 2  # T2 went first
    assert set(policy.b2) == set(keys(a))


# ------------------------------------------------------------------------------------- properties
requests_st = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 3)), min_size=1, max_size=60
)


def _arc_books(tree: RadixTree) -> None:
    policy = tree.policy
    assert isinstance(policy, ARC)
    t1 = sum(n.n_pages for n in tree.nodes() if n.meta is not None and not n.meta.t2)
    assert policy.t1_pages == t1
    assert 0.0 <= policy.p <= policy.peak
    assert len(policy.b1) <= policy.peak and len(policy.b2) <= policy.peak
    in_tree = {k for n in tree.nodes() for k in n.page_keys}
    assert not in_tree & (policy.b1.keys() | policy.b2.keys())


@settings(max_examples=80, deadline=None)
@given(policy=st.sampled_from(["arc"]), capacity=st.integers(1, 12), backup=st.booleans(),
       requests=requests_st, host_evictions=st.lists(st.integers(0, 4), min_size=60, max_size=60))
def test_invariants_hold_under_random_requests(policy: str, capacity: int, backup: bool,
                                               requests: list[tuple[int, int, int]],
                                               host_evictions: list[int]) -> None:
    """Requests are a shared head (one of 4), a body (one of 5) and a tail (one of 4): prefixes are shared,
    split and extended; with ``backup`` evicted L1 nodes go to L2, and L2 is trimmed now and then."""
    cache = Cache(policy, capacity, backup)
    books = _arc_books
    for (h, body, tail), n_host in zip(requests, host_evictions, strict=False):
        tokens = content(h, 1) + content(10 + body, 1 + body % 2) + content(20 + tail, tail % 3)
        hit = cache.serve(tokens)
        assert 0 <= hit <= len(tokens) // PAGE
        if n_host:
            cache.tree.evict_host(n_host)
            cache.tree.check_invariants()
        books(cache.tree)
        assert len(set(cache.free)) == len(cache.free)  # no L1 page freed twice
