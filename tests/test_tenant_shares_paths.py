"""``cache.tenant_shares`` beyond the flood of tests/test_tenant_shares.py: every way the cache evicts,
which tenant a namespace's pages count for, and the shares as numbers.

* Every eviction path of the cache passes the caps: an allocation under pressure, a ``write_back``
  eviction backing pages up into a full L2, a prefetch's L2 allocation, ``evict()``; ``clear()`` and
  the caps together still leave what locks and pins hold.
* Whose pages: the cache remembers the tenant of each namespace it has seen (the tree knows digests
  only). A namespace holding pages is never forgotten, however many tenants come and go; requests without
  a tenant are ``model.tenant``'s; a namespace whose root was dropped and re-created keeps its share.
* The numbers: the cap is the share of the tier's pages, rounded down from the decimal the config wrote
  (0.29 of 100 pages is 29, not 28); shares of 1 are no cap at all; shares may sum past 1.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
from tenantkit import L1_PAGES, PS, compute, held, hits, make, prompt

import hicache.tenants as tenants_mod
from kvhelpers import kv_equal, read_kv, write_kv

# ------------------------------------------------------------------ the eviction paths


@pytest.mark.parametrize("capped", [True, False])
def test_write_back_evictions_into_a_full_l2_evict_the_tenant_over_its_l2_share_first(capped: bool) -> None:
    """Under write_back an L1 eviction backs the page up into L2 first; with L2 full, that backup's own
    L2 eviction takes the flooding tenant's L2 pages, not acme's."""
    cache = make({"noisy": 0.25} if capped else None, l2=16, write_policy="write_back")
    acme, busy, noisy = cache.namespace("acme"), cache.namespace("busy"), cache.namespace("noisy")
    docs = [prompt(i, 3) for i in range(3)]
    for i, d in enumerate(docs):
        compute(cache, d, acme, seed=i)
    for i in range(8):  # busy takes L1: acme's prompts are written back to L2
        compute(cache, prompt(400 + i, 2), busy, seed=400 + i)
    assert [hits(cache, d, acme) for d in docs] == [(0, 3)] * 3
    for i in range(24):  # 48 one-off pages written back through a 16-page L2
        compute(cache, prompt(500 + i, 2), noisy, seed=500 + i)
    cache.check_integrity()
    assert [hits(cache, d, acme)[1] for d in docs] == ([3, 3, 3] if capped else [0, 0, 0])
    if capped:
        assert held(cache, noisy)[1] <= 16 // 4 + 2  # at its cap, give or take the last 2-page backup
    cache.close()


@pytest.mark.parametrize("capped", [True, False])
def test_a_prefetch_takes_its_l2_pages_from_the_tenant_over_its_share(capped: bool) -> None:
    """acme's prompt is on L3 only; L2 is full of busy's 6 older pages and noisy's 10 newer ones. The
    prefetch of acme's 6 pages takes them from noisy (over its 4-page share), not from busy (least recent),
    and what acme loads is what it computed."""
    with tempfile.TemporaryDirectory() as d:
        cache = make({"noisy": 0.25} if capped else None, l2=16, storage=f"file://{d}", write_policy="write_through")
        acme, busy, noisy = cache.namespace("acme"), cache.namespace("busy"), cache.namespace("noisy")
        doc = prompt(1, 6)
        kv = compute(cache, doc, acme, seed=1)
        cache.flush()
        cache.clear()  # acme's prompt is on L3 only
        compute(cache, prompt(2, 6), busy, seed=2)
        for i in range(10):
            compute(cache, prompt(100 + i, 1), noisy, seed=100 + i)
        cache.flush()
        cache.evict(l1_pages=L1_PAGES)  # everything is on L2 only now, L2 full
        assert cache.stats()["l2_pages_cached"] == 16 and cache.stats()["l1_pages_cached"] == 0
        req = cache.match(doc, acme)
        assert req.l3_pages == 6 and cache.prefetch(req) == 6
        load = cache.load_back(req)
        load.wait()
        assert load.l3_pages == 6 and kv_equal(read_kv(cache, load.device_indices), kv)
        cache.release(req)
        cache.check_integrity()
        assert hits(cache, prompt(2, 6), busy) == ((0, 6) if capped else (0, 0))
        assert held(cache, noisy)[1] == (4 if capped else 10)
        cache.close()


def test_evict_takes_the_tenant_over_its_share_first_and_clear_leaves_locks_and_pins() -> None:
    cache = make({"noisy": 0.25})
    acme, noisy = cache.namespace("acme"), cache.namespace("noisy")
    for i in range(4):  # acme's 4 pages are the least recent
        compute(cache, prompt(i, 1), acme, seed=i)
    for i in range(8):
        compute(cache, prompt(100 + i, 1), noisy, seed=100 + i)
    assert cache.evict(l1_pages=3) == (3, 0)
    assert held(cache, noisy)[0] == 5 and held(cache, acme)[0] == 4
    # noisy is over its cap (4) by one: evict(2) takes noisy's oldest, then the least recent of all (acme's)
    assert cache.evict(l1_pages=2) == (2, 0)
    assert held(cache, noisy)[0] == 4 and held(cache, acme)[0] == 3
    assert [hits(cache, prompt(i, 1), acme)[0] for i in range(4)] == [0, 1, 1, 1]

    # a pinned and a locked page of the capped tenant stay through evict and clear
    pin = cache.pin(prompt(107, 1), noisy)
    live = cache.match(prompt(106, 1), noisy)
    assert live.l1_pages == 1
    assert cache.evict(l1_pages=L1_PAGES) == (5, 0)
    assert held(cache, noisy)[0] == 2 and held(cache, acme)[0] == 0
    assert cache.clear() == (0, 0)
    cache.check_integrity([live])
    cache.release(live)
    cache.unpin(pin.pin_id)
    assert cache.clear() == (2, 0)
    cache.check_integrity()


def test_a_tenant_over_its_share_with_its_pages_locked_or_pinned_loses_only_the_others() -> None:
    """noisy holds 8 pages (cap 4), 6 of them pinned or locked by a request in flight: an allocation takes
    noisy's 2 free pages first, then the least recent pages of the others, never a held page."""
    cache = make({"noisy": 0.25})
    acme, noisy = cache.namespace("acme"), cache.namespace("noisy")
    for i in range(8):
        compute(cache, prompt(i, 1), acme, seed=i)
    long = prompt(100, 6)
    compute(cache, long, noisy, seed=100)
    for i in range(2):
        compute(cache, prompt(200 + i, 1), noisy, seed=200 + i)
    pin = cache.pin(long[: 3 * PS], noisy)
    live = cache.match(long, noisy)
    assert live.l1_pages == 6
    compute(cache, prompt(300, 4), acme, seed=300)
    assert held(cache, noisy)[0] == 6
    assert [hits(cache, prompt(i, 1), acme)[0] for i in range(8)] == [0, 0] + [1] * 6
    cache.check_integrity([live])
    cache.release(live)
    cache.unpin(pin.pin_id)
    cache.check_integrity()


# ------------------------------------------------------------------ whose pages


def test_a_tenant_holding_pages_keeps_its_share_however_many_tenants_come_by(monkeypatch: pytest.MonkeyPatch) -> None:
    """More tenants than the cache remembers look up (and miss): noisy, which holds pages, is still
    capped, and ``tenant_pages`` still counts its pages."""
    monkeypatch.setattr(tenants_mod, "TENANT_MEMORY", 2)
    cache = make({"noisy": 0.25, "*": 1.0})
    acme, noisy = cache.namespace("acme"), cache.namespace("noisy")
    docs = [prompt(i, 3) for i in range(3)]
    for i, d in enumerate(docs):
        compute(cache, d, acme, seed=i)
    for i in range(7):
        compute(cache, prompt(100 + i, 1), noisy, seed=100 + i)
    for t in range(6):  # passers-by: lookups that miss and leave nothing
        assert hits(cache, prompt(900, 1), cache.namespace(f"t{t}")) == (0, 0)
    assert cache.tenant_pages() == {"noisy": (7, 0)}
    assert len(cache._tenant_of) <= 2 + len(cache.tree.roots)  # the passers-by are forgotten
    compute(cache, prompt(50, 3), acme, seed=50)  # 3 pages: noisy's 3 oldest go (it holds 7, cap 4)
    assert [hits(cache, d, acme)[0] for d in docs] == [3, 3, 3]
    assert held(cache, noisy)[0] == 4
    cache.check_integrity()


def test_a_tenant_forgotten_between_its_match_and_its_commit_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """noisy's first request matches (nothing: its namespace has no pages yet), other tenants pass by, and
    only then does it commit: its pages still count against its share."""
    monkeypatch.setattr(tenants_mod, "TENANT_MEMORY", 1)
    cache = make({"noisy": 0.25, "*": 1.0})
    acme, noisy = cache.namespace("acme"), cache.namespace("noisy")
    docs = [prompt(i, 3) for i in range(3)]
    for i, d in enumerate(docs):
        compute(cache, d, acme, seed=i)
    tokens = prompt(100, 7)
    req = cache.match(tokens, noisy)
    for t in range(3):
        hits(cache, prompt(900, 1), cache.namespace(f"t{t}"))
    pages = cache.alloc(req, 7)
    write_kv(cache, pages, seed=100)
    cache.commit(req, tokens, pages)
    cache.release(req)
    assert cache.tenant_pages() == {"noisy": (7, 0)}
    compute(cache, prompt(50, 3), acme, seed=50)
    assert [hits(cache, d, acme)[0] for d in docs] == [3, 3, 3]
    cache.check_integrity()


def test_a_tenant_forgotten_before_its_prefetch_lands_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but noisy's first pages in the tree are the L3 run its prefetch brings back."""
    monkeypatch.setattr(tenants_mod, "TENANT_MEMORY", 1)
    with tempfile.TemporaryDirectory() as d:
        cache = make({"noisy": 0.25, "*": 1.0}, l2=16, storage=f"file://{d}")
        acme, noisy = cache.namespace("acme"), cache.namespace("noisy")
        tokens = prompt(100, 7)
        compute(cache, tokens, noisy, seed=100)
        cache.flush()
        cache.clear()  # noisy's prompt is on L3 only
        docs = [prompt(i, 3) for i in range(3)]
        for i, doc in enumerate(docs):
            compute(cache, doc, acme, seed=i)
        req = cache.match(tokens, noisy)
        assert req.l3_pages == 7
        for t in range(3):
            hits(cache, prompt(900, 1), cache.namespace(f"t{t}"))
        assert cache.prefetch(req) == 7
        cache.load_back(req).wait()
        cache.release(req)
        assert cache.tenant_pages()["noisy"] == (7, 7)
        compute(cache, prompt(50, 3), acme, seed=50)
        assert [hits(cache, doc, acme)[0] for doc in docs] == [3, 3, 3]
        cache.check_integrity()
        cache.close()


def test_a_namespace_dropped_from_the_tree_and_filled_again_keeps_its_share() -> None:
    cache = make({"noisy": 0.25})
    acme, noisy = cache.namespace("acme"), cache.namespace("noisy")
    compute(cache, prompt(100, 2), noisy, seed=100)
    req = cache.match(prompt(101, 7), noisy)  # noisy's next request is under way ...
    cache.clear()  # ... when its namespace leaves the tree
    assert noisy.digest not in cache.tree.roots
    docs = [prompt(i, 3) for i in range(3)]
    for i, d in enumerate(docs):
        compute(cache, d, acme, seed=i)
    pages = cache.alloc(req, 7)
    cache.commit(req, prompt(101, 7), pages)  # its root is created again
    cache.release(req)
    compute(cache, prompt(50, 3), acme, seed=50)  # noisy is over its cap: its 7-page run goes (whole)
    assert [hits(cache, d, acme)[0] for d in docs] == [3, 3, 3]
    assert held(cache, noisy)[0] == 0
    cache.check_integrity()


@pytest.mark.parametrize("shares, capped", [
    ({"acme": 0.25}, True),  # model.tenant is the tenant of requests that name none
    ({"*": 0.25, "other": 1.0}, True),
    ({"": 0.25}, False),  # "" is a tenant of its own, not the default one here
])
def test_requests_without_a_tenant_are_model_tenants(shares: dict[str, float], capped: bool) -> None:
    cache = make(shares, model={"tenant": "acme"})
    assert cache.namespace().tenant == "acme"
    other = cache.namespace("other")
    docs = [prompt(i, 3) for i in range(3)]
    for i, d in enumerate(docs):
        compute(cache, d, other, seed=i)
    for i in range(20):  # requests naming no tenant flood L1
        compute(cache, prompt(100 + i, 2), None, seed=100 + i)
    assert [hits(cache, d, other)[0] for d in docs] == ([3, 3, 3] if capped else [0, 0, 0])
    if "acme" in shares:
        assert cache.tenant_pages()["acme"] == held(cache, cache.namespace())
    cache.check_integrity()


def test_an_explicit_empty_tenant_is_capped_by_the_empty_share() -> None:
    cache = make({"": 0.25}, model={"tenant": "acme"})
    docs = [prompt(i, 3) for i in range(3)]
    for i, d in enumerate(docs):
        compute(cache, d, None, seed=i)  # model.tenant's requests
    blank = cache.namespace("")
    for i in range(20):
        compute(cache, prompt(100 + i, 2), blank, seed=100 + i)
    assert [hits(cache, d, None)[0] for d in docs] == [3, 3, 3]
    assert cache.tenant_pages() == {"": held(cache, blank)}


# ------------------------------------------------------------------ the numbers


@pytest.mark.parametrize("share, cap", [(0.29, 29), (0.57, 57), (0.58, 58), (0.07, 7), (0.5, 50)])
def test_the_cap_is_the_share_of_the_tier_as_written(share: float, cap: int) -> None:
    """100 L1 pages, share 0.29: the tenant may keep 29 pages (0.29 * 100 is 28.999... in floating point).
    The others' 100 - cap pages are older; one more page for them evicts their own least recent page, not
    the capped tenant's, as long as it holds exactly its cap."""
    cache = make({"a": share}, l1=100)
    a, b = cache.namespace("a"), cache.namespace("b")
    for i in range(100 - cap):
        compute(cache, prompt(1000 + i, 1), b, seed=i)
    for i in range(cap):
        compute(cache, prompt(i, 1), a, seed=i)
    compute(cache, prompt(5000, 1), b, seed=5000)
    assert held(cache, a)[0] == cap
    assert hits(cache, prompt(1000, 1), b)[0] == 0


def test_shares_of_one_are_no_cap() -> None:
    """Every tenant at share 1 (or "*" at 1): the same evictions as without shares."""
    found = []
    for shares in (None, {"a": 1.0, "b": 1}, {"*": 1.0}):
        cache = make(shares)
        rng = np.random.default_rng(7)
        for _ in range(40):
            t = "ab"[int(rng.integers(2))]
            tokens = prompt(int(rng.integers(12)), int(rng.integers(1, 4)))
            req = cache.match(tokens, cache.namespace(t))
            pages = cache.alloc(req, len(tokens) // PS - req.l1_pages)
            cache.commit(req, tokens, np.concatenate([req.device_indices, pages]))
            cache.release(req)
        cache.check_integrity()
        found.append(sorted(cache.tree.event("stored", node).page_keys for node in cache.tree.nodes()))
    assert found[0] == found[1] == found[2]


def test_shares_may_sum_past_one() -> None:
    """a and b at 0.75 each (12 of 16 pages), each cap on its own. a holds 12 (the least recent), b 4.
    b's one-page prompts take a's pages in policy order while nobody is over a cap; b passes its cap by
    the page it just committed, and from then on its own least recent page goes for each new one."""
    cache = make({"a": 0.75, "b": 0.75})
    a, b = cache.namespace("a"), cache.namespace("b")
    for i in range(12):
        compute(cache, prompt(i, 1), a, seed=i)
    for i in range(4):
        compute(cache, prompt(100 + i, 1), b, seed=100 + i)
    for i in range(12):
        compute(cache, prompt(200 + i, 1), b, seed=200 + i)
    assert held(cache, a)[0] == 3 and held(cache, b)[0] == 13
    assert [hits(cache, prompt(100 + i, 1), b)[0] for i in range(4)] == [0, 0, 0, 1]  # b's own 3 oldest
    # a's 2 pages: b's page past its cap, then the least recent of all (a's oldest)
    compute(cache, prompt(300, 2), a, seed=300)
    assert held(cache, a)[0] == 4 and held(cache, b)[0] == 12
    cache.check_integrity()
