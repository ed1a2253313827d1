"""The default policy (``hedge_lru``) on the bench's workloads: never below LRU, never above the optimum;
the tree's invariants hold under it and ``reuse_lru``; and the bench's fast tree replay gives the in-process
cache's hit rate."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.bench.optimal import belady, page_trace
from hicache.bench.policy_table import FLOOR_POINTS, tree_hit_rate
from hicache.bench.run import policy_hit_rate, replay_config
from hicache.bench.targets import InProcessTarget
from hicache.bench.traces import generated_trace
from hicache.bench.workloads import TraceRequest, WorkloadSpec, generate
from hicache.config import CacheConfig


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=10)), min_size=1,
                     max_size=25),
       l1=st.integers(1, 8), l2=st.integers(0, 8), policy=st.sampled_from(["hedge_lru", "reuse_lru"]))
def test_invariants_hold_under_learned_policies(data: list[tuple[int, list[int]]], l1: int, l2: int,
                                                policy: str) -> None:
    cfg = replay_config(2, l1 * 2, l2 * 2, eviction_policy=policy, write_policy="write_through")
    with InProcessTarget(cfg) as t:
        for stem, tail in data:
            t.serve(TraceRequest(np.array([stem] * 4 + tail, np.uint32), np.array(tail[:2], np.uint32)))
            t.cache.check_integrity()


def test_default_policy_is_not_below_lru_on_rag_nor_above_the_optimum() -> None:
    default = CacheConfig().eviction_policy
    assert default == "hedge_lru"
    reqs = generate(WorkloadSpec("rag", 300))
    pt = page_trace(reqs, 64)
    cap = pt.num_pages // 10
    lru = policy_hit_rate(reqs, 64, cap * 64, "lru")
    rate = policy_hit_rate(reqs, 64, cap * 64, default)
    assert lru - FLOOR_POINTS / 100 <= rate <= belady(pt, cap).hit_rate


@pytest.mark.parametrize("policy", ["lru", "hedge_lru", "arc"])
def test_tree_replay_is_the_in_process_cache(policy: str) -> None:
    """``tree_hit_rate`` (the policy evaluation's replay) hits exactly what the in-process L1-only cache hits,
    outputs and all-locked requests included."""
    for reqs, ps in ((generate(WorkloadSpec("mixed", 120, seed=3)), 64), (generated_trace("agent", 5, 300), 16)):
        pt = page_trace(reqs, ps)
        for cap in (2, max(2, pt.num_pages // 20), pt.num_pages // 5):
            assert tree_hit_rate(reqs, ps, cap, policy) == policy_hit_rate(reqs, ps, cap * ps, policy)
