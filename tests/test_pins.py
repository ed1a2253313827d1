"""Pinned prefixes (HiCache.pin / unpin): kept on their tiers under any eviction pressure, and only while
pinned; bounded by cache.max_pinned_fraction; a hit on them computes what a fresh prefill would."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from hicache.cache import CacheFullError, HiCache
from kvhelpers import commit_fresh, kv_equal, read_kv, small_config, write_kv

PS = 4  # small_config: pages of 4 tokens, L1 16 pages, L2 32 pages


def prompt(seed: int, pages: int) -> list[int]:
    return [seed * 1000 + i for i in range(pages * PS)]


def flood(cache: HiCache, first_seed: int, n: int, pages: int = 4) -> None:
    """Commit ``n`` new prompts: enough to push everything unpinned out of L1 (and L2)."""
    for s in range(first_seed, first_seed + n):
        commit_fresh(cache, prompt(s, pages), seed=s)


def test_pinned_l1_prefix_survives_pressure_and_is_released_by_unpin() -> None:
    cache = HiCache(small_config(cache={"l2_tokens": 0, "eviction_policy": "lru"}))
    system = prompt(1, 4)
    kv = commit_fresh(cache, system, seed=1)
    pin = cache.pin(system)
    assert (pin.l1_pages, pin.l2_pages) == (4, 0)
    assert cache.pins() == [pin]
    flood(cache, 100, 12)  # 48 pages through a 16-page L1
    req = cache.match(system)
    assert req.l1_pages == 4  # still there, byte for byte
    assert kv_equal(read_kv(cache, req.device_indices), kv)
    cache.release(req)
    cache.check_integrity()

    assert cache.unpin(pin.pin_id) == pin and cache.pins() == []
    flood(cache, 200, 12)
    req = cache.match(system)
    assert req.l1_pages == 0  # evictable again, and evicted
    cache.release(req)
    cache.check_integrity()
    cache.close()


def test_unpinned_control_is_evicted() -> None:
    cache = HiCache(small_config(cache={"l2_tokens": 0, "eviction_policy": "lru"}))
    system = prompt(1, 4)
    commit_fresh(cache, system, seed=1)
    flood(cache, 100, 12)
    req = cache.match(system)
    assert req.l1_pages == 0
    cache.release(req)
    cache.close()


def test_pin_keeps_an_l2_run_on_l2() -> None:
    cache = HiCache(small_config(cache={"write_policy": "write_through", "eviction_policy": "lru"}))
    doc = prompt(2, 6)
    kv = commit_fresh(cache, doc, seed=2)
    cache.flush(5)
    assert cache.evict(l1_pages=16) == (6, 0)  # now on L2 only
    pin = cache.pin(doc)
    assert (pin.l1_pages, pin.l2_pages) == (0, 6)
    flood(cache, 300, 24)  # 96 pages through 16 L1 + 32 L2 pages
    req = cache.match(doc)
    assert (req.l1_pages, req.l2_pages) == (0, 6)
    load = cache.load_back(req)
    load.wait()
    assert kv_equal(read_kv(cache, load.device_indices), kv)  # a hit computes what the prefill did
    cache.release(req)
    cache.unpin(pin.pin_id)
    cache.check_integrity()
    cache.close()


def test_pin_errors_leave_nothing_behind() -> None:
    cache = HiCache(small_config(cache={"l2_tokens": 0, "max_pinned_fraction": 0.5}))
    with pytest.raises(ValueError, match="no page of this prefix is cached"):
        cache.pin(prompt(9, 3))
    a, b = prompt(1, 6), prompt(2, 4)
    commit_fresh(cache, a, seed=1)
    commit_fresh(cache, b, seed=2)
    pa = cache.pin(a)  # 6 of the 8 pages pins may hold
    with pytest.raises(CacheFullError, match="max_pinned_fraction"):
        cache.pin(b)  # 10 > 8
    assert cache.pins() == [pa]
    with pytest.raises(KeyError):
        cache.unpin(pa.pin_id + 1)
    cache.unpin(pa.pin_id)
    with pytest.raises(KeyError):
        cache.unpin(pa.pin_id)  # once only
    assert cache.tree.locked_device_pages == 0  # every lock the pins took is gone
    cache.check_integrity()
    assert cache.metrics.registry.get_sample_value("hicache_pinned_pages", {"tier": "l1"}) == 0
    cache.close()


def test_pins_of_a_tenant_stay_in_its_namespace() -> None:
    cache = HiCache(small_config(cache={"l2_tokens": 0, "eviction_policy": "lru"}))
    acme = cache.namespace("acme")
    system = prompt(1, 4)
    req = cache.match(system, acme)
    pages = cache.alloc(req, 4)
    cache.commit(req, system, pages)
    cache.release(req)
    with pytest.raises(ValueError):
        cache.pin(system)  # the default namespace has none of it
    pin = cache.pin(system, acme)
    assert pin.l1_pages == 4 and "acme" in pin.namespace
    assert cache.metrics.registry.get_sample_value("hicache_pinned_pages", {"tier": "l1"}) == 4
    cache.unpin(pin.pin_id)
    cache.close()


def _random_prompt(k: int) -> list[int]:
    """Prompts 0-5 are 2 pages; 6-11 continue 0-5 to 4 pages, so pins and commits split shared nodes."""
    return prompt(k % 6, 2 if k < 6 else 4)


_OP = st.tuples(st.sampled_from(["commit", "commit_pin", "pin", "unpin", "demote", "evict", "flood"]),
                st.integers(0, 11))


def _block(k: int, on_l2: bool, ops: list[tuple[str, int]], pressure: str) -> list[tuple[str, int]]:
    """Commit and pin prompt ``k`` (on L1, or ``on_l2``: demoted to L2 first), a few random ops, commit
    another prompt, evict or flood: most examples pin, then evict other pages while the pin is live."""
    pin = [("commit", k), ("demote", 0), ("pin", k)] if on_l2 else [("commit_pin", k)]
    return [*pin, *ops, ("commit", (k + 1) % 12), (pressure, 0)]


_OPS = st.lists(st.builds(_block, st.integers(0, 11), st.booleans(), st.lists(_OP, max_size=5),
                          st.sampled_from(["evict", "flood"])),
                min_size=1, max_size=6).map(lambda blocks: [op for block in blocks for op in block])


def _commit(cache: HiCache, toks: list[int], seed: int) -> bool:
    """Serve ``toks`` as an engine would (load the L2 run back, compute the rest); False when refused."""
    req = cache.match(toks, l3=False)
    try:
        load = cache.load_back(req)
        load.wait()
        new = cache.alloc(req, req.num_pages - len(load.device_indices))
        write_kv(cache, new, seed)
        cache.commit(req, toks, np.concatenate([load.device_indices, new]))
        return True
    except CacheFullError:
        return False  # everything pinned or locked: the request is refused, nothing breaks
    finally:
        cache.release(req)


def _evicted(cache: HiCache) -> float:
    get = cache.metrics.registry.get_sample_value
    return sum(get("hicache_evicted_tokens_total", {"tier": t}) or 0 for t in ("l1", "l2"))


@settings(max_examples=40, deadline=None)
@given(_OPS)
# certainly pins, then evicts (explicitly, then through allocation) with other pages evictable
@example([("commit_pin", 0), ("commit", 7), ("commit", 8), ("evict", 0), ("flood", 0), ("evict", 0)])
# a pin over a split node (2-page pin under a 4-page prompt), then pressure on both tiers
@example([("commit", 9), ("commit_pin", 3), ("flood", 0), ("flood", 0), ("evict", 0), ("unpin", 0),
          ("flood", 0), ("evict", 0)])
# a pin of a run on L2 only, then a pin of its prefix loaded back to L1, then pressure on both tiers
@example([("commit", 6), ("flood", 0), ("pin", 6), ("commit_pin", 0), ("flood", 0), ("flood", 0), ("evict", 0)])
def test_random_pins_hold_their_pages_and_the_pools_stay_consistent(ops: list[tuple[str, int]]) -> None:
    """Any interleaving: a live pin's L1 pages stay on L1 byte for byte and its L2 run on L1 or L2; the
    pools and tree stay consistent; once every pin is dropped, nothing is held any more."""
    cache = HiCache(small_config(cache={"write_policy": "write_through", "eviction_policy": "lru",
                                        "max_pinned_fraction": 1.0}))
    live: dict[int, tuple[list[int], int, int, list[list[torch.Tensor]]]] = {}
    seeds = iter(range(1, 10**6))
    pins = evicts_under_pins = 0
    try:
        for op, k in ops:
            toks = _random_prompt(k)
            if op == "commit":
                _commit(cache, toks, next(seeds))
            elif op in ("pin", "commit_pin"):
                if op == "commit_pin":
                    _commit(cache, toks, next(seeds))
                try:
                    p = cache.pin(toks)
                except (ValueError, CacheFullError):
                    event(f"{op}: refused")
                else:
                    req = cache.match(toks, l3=False)
                    assert req.l1_pages >= p.l1_pages and req.l1_pages + req.l2_pages >= p.l1_pages + p.l2_pages
                    kv = read_kv(cache, req.device_indices[: p.l1_pages])
                    cache.release(req)
                    live[p.pin_id] = (toks, p.l1_pages, p.l2_pages, kv)
                    pins += 1
                    if p.l2_pages:
                        event("a pin holds L2 pages")
            elif op == "unpin" and live:
                pid = sorted(live)[k % len(live)]
                cache.unpin(pid)
                del live[pid]
            elif op == "flood":  # 16 fresh pages through a 16-page L1 (and on to L2): eviction by alloc
                before = _evicted(cache)
                for _ in range(4):
                    s = next(seeds)
                    _commit(cache, prompt(100 + s, 4), s)
                evicts_under_pins += bool(live and _evicted(cache) > before)
            elif op in ("demote", "evict"):  # demote: every unheld L1 page to L2 (write_through backed them up)
                l1, l2 = cache.evict(l1_pages=16, l2_pages=32 if op == "evict" else 0)
                evicts_under_pins += bool(live and l1 + l2)
            cache.check_integrity()
            for toks, l1, l2, kv in live.values():
                req = cache.match(toks, l3=False)
                assert req.l1_pages >= l1 and req.l1_pages + req.l2_pages >= l1 + l2
                assert kv_equal(read_kv(cache, req.device_indices[:l1]), kv)
                cache.release(req)
        event(f"pins taken: {min(pins, 3)}{'+' if pins >= 3 else ''}")
        n = evicts_under_pins
        event(f"evictions freeing pages under a live pin: {min(n, 3)}{'+' if n >= 3 else ''}")
        for pid in list(live):
            cache.unpin(pid)
        cache.flush()  # backups in flight lock their nodes until they are folded in
        assert cache.pins() == [] and cache.tree.locked_device_pages == 0
        cache.clear()  # with no pin and no request left, every page can go
        assert cache.tree.all_device_pages().size == cache.tree.all_host_pages().size == 0
        cache.check_integrity()
    finally:
        cache.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_clear_drops_everything_but_pins_and_open_requests(policy: str) -> None:
    """clear() empties L1 and L2 except what a pin or an open request holds, without backing anything up."""
    cache = HiCache(small_config(cache={"write_policy": policy, "eviction_policy": "lru"}))
    kept, held = prompt(1, 3), prompt(2, 2)
    commit_fresh(cache, kept, seed=1)
    commit_fresh(cache, held, seed=2)
    flood(cache, 10, 3)
    cache.flush(5)
    if policy == "write_through":
        cache.evict(l1_pages=4)  # some pages only on L2, with L1 parents above some of them
    pin = cache.pin(kept)
    req = cache.match(held)
    backed = cache.metrics.registry.get_sample_value("hicache_backed_up_tokens_total", {"tier": "l2"}) or 0
    l1, l2 = cache.clear()
    assert l1 + l2 > 0
    assert cache.metrics.registry.get_sample_value("hicache_backed_up_tokens_total", {"tier": "l2"}) == backed
    for node in cache.tree.nodes():  # only what is held is left
        if node.parent is not None:
            assert node.lock_ref > 0 or node.host_pin > 0, node
    cache.release(req)
    again = cache.match(kept)
    assert again.l1_pages + again.l2_pages == 3
    cache.release(again)
    cache.unpin(pin.pin_id)
    cache.clear()
    assert cache.tree.all_device_pages().size == cache.tree.all_host_pages().size == 0
    cache.check_integrity()
    cache.close()
