"""``cache.tenant_shares``: a tenant holding more than its share of a tier is evicted first.

A noisy tenant flooding the cache with one-off prompts evicts the other tenants' prefixes under any
recency policy; capped at a share, it evicts its own pages instead, and the others keep hitting (with the
KV they cached, unchanged). The cap is soft: alone, a tenant fills the whole cache. Over its cap a tenant
loses its pages first, in policy order, only down to the cap; past that every tenant's pages are evicted
together in policy order. The same holds on L2. Bad shares are refused with the field named.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tenantkit import L1_PAGES, compute, hits, make, prompt

from hicache.config import ConfigError
from kvhelpers import kv_equal, read_kv, small_config


@pytest.mark.parametrize("shares, noisy", [
    ({"noisy": 0.25}, "noisy"),
    ({"*": 0.25, "acme": 1.0}, "noisy"),  # every tenant not listed
    ({"": 0.25}, ""),  # requests without a tenant
    (None, "noisy"),  # no shares: the flood evicts acme's prefixes
])
def test_a_flooding_tenant_capped_at_its_share_leaves_the_others_their_prefixes(
        shares: dict[str, float] | None, noisy: str) -> None:
    cache = make(shares)
    acme, other = cache.namespace("acme"), cache.namespace(noisy)
    docs = [prompt(i, 3) for i in range(3)]  # 9 pages: acme's working set
    kv = [compute(cache, d, acme, seed=i) for i, d in enumerate(docs)]
    for i in range(20):  # one-off prompts, 2 pages each: 40 pages through a 16-page L1
        compute(cache, prompt(100 + i, 2), other, seed=100 + i)
    cache.check_integrity()
    found = [hits(cache, d, acme)[0] for d in docs]
    if shares is None:
        assert found == [0, 0, 0]
        return
    assert found == [3, 3, 3]
    for d, want in zip(docs, kv, strict=True):
        req = cache.match(d, acme)
        assert kv_equal(read_kv(cache, req.device_indices), want)
        cache.release(req)
    # the flood kept to its cap (4 pages) once it had to evict: 16 - 9 = 7 pages are free for it to
    # fill, so it holds between 4 and 7 pages now
    held = sum(hits(cache, prompt(100 + i, 2), other)[0] for i in range(20))
    assert 4 <= held <= L1_PAGES - 9


def test_a_tenant_alone_fills_the_cache_past_its_share() -> None:
    cache = make({"solo": 0.25})
    solo = cache.namespace("solo")
    for i in range(8):
        compute(cache, prompt(i, 2), solo, seed=i)
    assert cache.device_pool.allocator.free_pages == 0
    assert sum(hits(cache, prompt(i, 2), solo)[0] for i in range(8)) == L1_PAGES
    compute(cache, prompt(50, 2), solo, seed=50)  # over its share with nobody else: plain LRU
    assert [hits(cache, prompt(i, 2), solo)[0] for i in range(9)] == [0] + [2] * 7 + [0]
    assert hits(cache, prompt(50, 2), solo)[0] == 2
    cache.check_integrity()


def test_over_its_cap_a_tenant_loses_pages_only_down_to_the_cap_then_policy_order_rules() -> None:
    """a (share 0.5: 8 pages) holds 12 one-page prompts, b holds 4 older ones; b's 6-page prompt needs 6
    pages: a's 4 least recent go (a is back at its cap), then the 2 least recent of all, b's oldest."""
    cache = make({"a": 0.5})
    a, b = cache.namespace("a"), cache.namespace("b")
    for i in range(4):
        compute(cache, prompt(200 + i, 1), b, seed=200 + i)
    for i in range(12):
        compute(cache, prompt(i, 1), a, seed=i)
    assert cache.device_pool.allocator.free_pages == 0
    compute(cache, prompt(300, 6), b, seed=300)
    assert [hits(cache, prompt(i, 1), a)[0] for i in range(12)] == [0] * 4 + [1] * 8
    assert [hits(cache, prompt(200 + i, 1), b)[0] for i in range(4)] == [0, 0, 1, 1]
    assert hits(cache, prompt(300, 6), b)[0] == 6
    cache.check_integrity()


@pytest.mark.parametrize("capped", [True, False])
def test_shares_hold_on_l2(capped: bool) -> None:
    """acme's prompts live on L2 only (another tenant took L1); a flooding tenant over its L2 share loses
    its own L2 pages first, so acme's prompts are still found there."""
    cache = make({"noisy": 0.25} if capped else None, l2=32, write_policy="write_through")
    acme, busy, noisy = cache.namespace("acme"), cache.namespace("busy"), cache.namespace("noisy")
    docs = [prompt(i, 3) for i in range(3)]
    for i, d in enumerate(docs):
        compute(cache, d, acme, seed=i)
    for i in range(8):  # busy takes L1 (16 pages); acme's prompts stay on L2
        compute(cache, prompt(400 + i, 2), busy, seed=400 + i)
    cache.flush()
    assert [hits(cache, d, acme) for d in docs] == [(0, 3)] * 3
    for i in range(24):  # 48 one-off pages through L1 and a 32-page L2
        compute(cache, prompt(500 + i, 2), noisy, seed=500 + i)
        cache.flush()
    cache.check_integrity()
    found = [hits(cache, d, acme)[1] for d in docs]
    assert found == ([3, 3, 3] if capped else [0, 0, 0])


@pytest.mark.parametrize("shares, field", [
    ({"a": 0}, "cache.tenant_shares.a"),
    ({"a": 1.5}, "cache.tenant_shares.a"),
    ({"a": float("nan")}, "cache.tenant_shares.a"),
    ({"a": True}, "cache.tenant_shares.a"),
    ({"": "half"}, 'cache.tenant_shares.""'),
    ({1: 0.5}, "cache.tenant_shares"),
    (["a"], "cache.tenant_shares"),
])
def test_bad_shares_are_refused_naming_the_field(shares: Any, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        small_config(cache={"tenant_shares": shares})
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_the_caps_follow_the_tiers_and_forget_nothing_a_tree_holds() -> None:
    cache = make({"a": 0.5, "*": 0.25}, l2=32)
    a, b = cache.namespace("a"), cache.namespace("b")
    compute(cache, prompt(1, 1), a, seed=1)
    compute(cache, prompt(2, 1), b, seed=2)
    compute(cache, prompt(3, 1), cache.namespace(), seed=3)  # "" is not listed: "*" applies
    assert cache._caps(L1_PAGES) == {a.digest: 8, b.digest: 4, cache.namespace().digest: 4}
    assert cache._caps(32) == {a.digest: 16, b.digest: 8, cache.namespace().digest: 8}
    assert make(None)._caps(L1_PAGES) is None
    assert np.all(cache.tree.all_device_pages() >= 0)


def test_tenant_usage_is_counted_and_exported_at_a_scrape() -> None:
    from prometheus_client import generate_latest

    cache = make({"acme": 0.5, "": 0.25, "*": 0.25})
    acme, other = cache.namespace("acme"), cache.namespace("other")
    compute(cache, prompt(1, 3), acme, seed=1)
    compute(cache, prompt(2, 2), cache.namespace(), seed=2)
    compute(cache, prompt(3, 4), other, seed=3)  # "*" only: not shown
    assert cache.tenant_pages() == {"acme": (3, 0), "": (2, 0)}
    cache._refresh_metrics()
    text = generate_latest(cache.metrics.registry).decode()
    assert 'hicache_tenant_pages{tenant="acme",tier="l1"} 3.0' in text
    assert 'hicache_tenant_pages{tenant="",tier="l1"} 2.0' in text
    assert 'hicache_tenant_share{tenant="acme"} 0.5' in text
    assert 'tenant="other"' not in text
