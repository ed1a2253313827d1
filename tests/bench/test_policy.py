"""``tail_lru``: one-off tails go first; everything else is LRU. ``reuse_lru`` (the default) learns which
leaves are one-offs. Tree invariants hold under both."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.bench.optimal import belady, page_trace
from hicache.bench.run import policy_hit_rate, replay_config
from hicache.bench.targets import InProcessTarget
from hicache.bench.workloads import TraceRequest, WorkloadSpec, generate
from hicache.config import CacheConfig
from hicache.eviction import is_one_off_tail
from hicache.keys import page_keys_from_bytes, tokens_to_bytes
from hicache.radix import RadixTree


def _insert(tree: RadixTree, tokens: list[int]) -> None:
    tb = tokens_to_bytes(tokens)
    keys = page_keys_from_bytes(b"n" * 32, tb, 2)
    tree.insert(b"n" * 32, tb, keys, device=np.arange(len(keys)) + 1000 * len(tree.roots))


def test_rag_question_is_a_one_off_tail_and_a_chat_turn_is_not() -> None:
    tree = RadixTree(2, "tail_lru")
    docs = [1, 1, 2, 2, 3, 3]
    for q in range(4):
        _insert(tree, [*docs, 50 + q, 50 + q])  # three questions under the same documents
    chat = [1, 1, 9, 9]
    _insert(tree, chat)
    _insert(tree, [*chat, 7, 7])  # the conversation went on: its first turn now has a child
    _insert(tree, [1, 1, 8, 8])  # a fresh conversation
    doc_node = next(iter(tree.roots.values())).children[tokens_to_bytes([1, 1])]
    under_docs = doc_node.children[tokens_to_bytes([2, 2])]
    questions = list(under_docs.children.values())
    assert len(questions) == 4 and all(is_one_off_tail(q) for q in questions)
    turns = [c for c in doc_node.children.values() if c is not under_docs]
    assert turns and not any(is_one_off_tail(t) for t in turns)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=10)), min_size=1,
                     max_size=25),
       l1=st.integers(1, 8), l2=st.integers(0, 8), policy=st.sampled_from(["tail_lru", "reuse_lru"]))
def test_invariants_hold_under_tail_lru(data: list[tuple[int, list[int]]], l1: int, l2: int, policy: str) -> None:
    cfg = replay_config(2, l1 * 2, l2 * 2, eviction_policy=policy, write_policy="write_through")
    with InProcessTarget(cfg) as t:
        for stem, tail in data:
            t.serve(TraceRequest(np.array([stem] * 4 + tail, np.uint32), np.array(tail[:2], np.uint32)))
            t.cache.check_integrity()


def test_default_policy_beats_lru_on_rag_and_is_near_optimal() -> None:
    default = CacheConfig().eviction_policy
    assert default == "reuse_lru"
    reqs = generate(WorkloadSpec("rag", 300))
    pt = page_trace(reqs, 64)
    cap = pt.num_pages // 10
    lru = policy_hit_rate(reqs, 64, cap * 64, "lru")
    opt = belady(pt, cap).hit_rate
    for policy in ("tail_lru", default):
        rate = policy_hit_rate(reqs, 64, cap * 64, policy)
        assert lru < rate <= opt
        assert rate >= 0.9 * opt
