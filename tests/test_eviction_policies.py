"""Eviction policies on a real RadixTree: what ``reuse_lru`` keeps, what it evicts first, and that no policy
touches locked or pinned pages."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import treecache
from treecache import NS, TreeCache, tb

from hicache.config import CacheConfig
from hicache.eviction import ReuseLRU, get_policy, make_policy, policy_names
from hicache.radix import RadixTree, TreeNode

PAGE = 4


def keys(tokens: list[int]) -> list[bytes]:
    return treecache.keys(tokens, PAGE)


def content(tag: int, pages: int) -> list[int]:
    """``pages`` pages of tokens unique to ``tag``."""
    return treecache.content(tag, pages, PAGE)


def L1(policy: str, capacity: int) -> TreeCache:
    return TreeCache(policy, capacity, PAGE)


def test_registry_builds_one_policy_per_tree() -> None:
    assert "reuse_lru" in policy_names() and CacheConfig.eviction_policy in policy_names()
    a, b = make_policy("reuse_lru"), make_policy("reuse_lru")
    assert isinstance(a, ReuseLRU) and a is not b and a.observes
    assert not make_policy("lru").observes and get_policy("lru")(_leaf(7)) == 7
    assert callable(get_policy("reuse_lru"))
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


def _leaf(last_access: int) -> TreeNode:
    node = TreeNode(None, b"", [])
    node.last_access = last_access
    return node


def _one_off_stream(c: TreeCache, start: int, n: int, pages: int) -> None:
    for i in range(n):
        assert c.serve(content(start + i, pages)) == 0


@pytest.mark.parametrize("policy", ["lru", "reuse_lru"])
def test_reused_prefix_outlives_a_stream_of_one_offs(policy: str) -> None:
    c = L1(policy, capacity=16)
    _one_off_stream(c, 50, 8, 4)  # first, prompts that never come back: "fresh" leaves are one-offs
    docs = content(1, 6)
    c.serve(docs + content(2, 1))  # documents and a first question ...
    assert c.serve(docs + content(3, 1)) == 6  # ... asked about again: a reused prefix
    _one_off_stream(c, 100, 12, 4)  # 48 pages of prompts nobody asks for again
    if policy == "lru":
        assert c.cached(docs) == 0  # recency alone lets the stream push the documents out
    else:
        assert c.cached(docs) == 6
        assert c.tree.policy.reuse_share("fresh") < ReuseLRU.ONE_OFF_SHARE  # type: ignore[attr-defined]


def test_question_tails_under_shared_documents_go_first() -> None:
    c = L1("reuse_lru", capacity=14)
    docs = content(1, 8)
    for q in range(2, 12):  # every question is new: the "branch" origin is learned to be one-off
        c.serve(docs + content(q, 2))
    policy = c.tree.policy
    assert isinstance(policy, ReuseLRU)
    assert policy.reuse_share("branch") < ReuseLRU.ONE_OFF_SHARE
    assert c.cached(docs) == 8
    assert c.tree.device_pages <= 14


def test_content_reused_after_its_eviction_is_protected_when_it_returns() -> None:
    c = L1("reuse_lru", capacity=12)
    _one_off_stream(c, 100, 4, 4)  # "fresh" is now known to be mostly one-off
    report = content(7, 4)
    c.serve(report)
    _one_off_stream(c, 200, 3, 4)
    assert c.cached(report) == 0  # evicted while it looked like a one-off
    assert c.serve(report) == 0  # asked for again: the ghost list remembers it
    node = c.tree.match(NS, tb(report), touch=False).l1_node
    assert node is not None and node.meta.hit
    policy = c.tree.policy
    assert isinstance(policy, ReuseLRU) and not policy.probation(node)
    _one_off_stream(c, 300, 6, 4)
    assert c.cached(report) == 4


def test_conversations_are_ordered_as_lru_orders_them() -> None:
    """Multi-turn chat: new turns are nearly always continued, so nothing is put on probation."""
    order = [int(x) for x in np.random.default_rng(0).integers(6, size=120)]
    hits = {}
    for policy in ("lru", "reuse_lru"):
        c = L1(policy, capacity=40)
        convs: list[list[int]] = [[] for _ in range(6)]
        total = 0
        for step, i in enumerate(order):
            convs[i] = convs[i] + content(10 * step + i + 1, 1 + step % 3)
            total += c.serve(convs[i])
            if len(convs[i]) > 24 * PAGE or step % 25 == 24:
                convs[i] = []  # that conversation ends; a new one takes its slot
        hits[policy] = total
    assert hits["lru"] > 0 and abs(hits["reuse_lru"] - hits["lru"]) <= 0.02 * hits["lru"]  # ties: node ids


@pytest.mark.parametrize("step", [100, 1])  # pages asked of each evict call: all at once, or one by one
@pytest.mark.parametrize("policy", policy_names())
def test_locked_and_pinned_nodes_are_never_evicted(policy: str, step: int) -> None:
    """Whatever the policy ranks first, a locked path stays on L1 and a host-pinned path on L2 (or L1),
    while every other page can go."""
    tree = RadixTree(PAGE, policy)
    dev, host = iter(range(100)), iter(range(100))
    a, b, c, d = content(1, 3), content(2, 3), content(3, 2), content(4, 2)
    a2, b2 = a + content(11, 2), b + content(12, 1)  # below the held nodes: free to go
    for toks in (a, a2, b, b2, c, d):
        m = tree.match(NS, tb(toks), touch=False)
        new = np.asarray([next(dev) for _ in range(len(keys(toks)) - m.l1_pages)], dtype=np.int64)
        tree.insert(NS, tb(toks), keys(toks), device=np.concatenate([m.device_indices, new]))
    for toks in (c, d, c, d, c):  # only unheld nodes are hit: the held ones rank first for LRU/LFU/...
        tree.match(NS, tb(toks))
    a_node, b_node, b2_node, d_node = (tree.match(NS, tb(t), touch=False).l1_node for t in (a, b, b2, d))
    assert a_node is not None and b_node is not None and b2_node is not None and d_node is not None
    assert b2_node.parent is b_node and a_node.n_pages == 3
    for node in (b_node, b2_node, d_node):  # backed up on L2; only b's path is pinned there
        tree.set_host(node, np.asarray([next(host) for _ in range(node.n_pages)]))
    for node in (a_node, b_node, b2_node):
        node.priority = -1  # ... and for ``priority``
    tree.lock(a_node)
    tree.pin_host(b2_node)

    def held() -> None:
        if a_node.lock_ref:
            assert tree.match(NS, tb(a), touch=False).l1_pages == 3, f"{policy}: locked path left L1"
        if b2_node.host_pin:
            m = tree.match(NS, tb(b2), touch=False)
            assert m.l1_pages + m.l2_pages == 4, f"{policy}: pinned path left L2"
        tree.check_invariants()

    def evict_all(evict: Callable[[int], list[np.ndarray]]) -> int:
        """Evict ``step`` pages at a time until nothing more goes; the pages freed."""
        total = 0
        while freed := sum(len(f) for f in evict(step)):
            total += freed
            held()
        return total

    assert evict_all(lambda n: tree.evict_device(n, lambda node: False)) == 2 + 4 + 2 + 2  # a2, b+b2, c, d
    assert evict_all(tree.evict_host) == 2  # d only: b's path is pinned
    assert tree.match(NS, tb(a2), touch=False).l1_pages == 3
    m = tree.match(NS, tb(b2), touch=False)
    assert (m.l1_pages, m.l2_pages) == (0, 4)
    assert tree.match(NS, tb(c), touch=False).l1_pages == tree.match(NS, tb(d), touch=False).l2_pages == 0

    tree.unlock(a_node)
    tree.unpin_host(b2_node)
    assert evict_all(lambda n: tree.evict_device(n, lambda node: False)) == 3
    assert evict_all(tree.evict_host) == 4
    assert list(tree.nodes()) == [] and tree.device_pages == tree.host_pages == tree.locked_device_pages == 0
    tree.check_invariants()


def test_split_halves_share_their_birth_but_not_their_hits() -> None:
    tree = RadixTree(PAGE, "reuse_lru")
    long = content(1, 4)
    tree.insert(NS, tb(long), keys(long), device=np.arange(4))
    other = long[: 2 * PAGE] + content(2, 1)
    m = tree.match(NS, tb(other))  # splits after two pages and hits the upper half only
    upper = m.l1_node
    assert upper is not None and upper.n_pages == 2
    (lower,) = upper.children.values()
    assert upper.meta.hit and not lower.meta.hit and upper.meta.birth is lower.meta.birth


def test_ghost_list_is_bounded() -> None:
    c = L1("reuse_lru", capacity=8)
    _one_off_stream(c, 100, 50, 2)
    policy = c.tree.policy
    assert isinstance(policy, ReuseLRU)
    assert 0 < len(policy.ghost) <= ReuseLRU.GHOST_FACTOR * policy.peak_pages <= ReuseLRU.GHOST_FACTOR * 8
