"""The router's index: events in sequence, gaps -> resync, snapshots replace, keys verified."""

from __future__ import annotations

import numpy as np
from router_helpers import PS, CacheNode, event, node_config, run, tokens

from hicache.keys import page_keys
from hicache.router.index import Applied, KVIndex, PrefixMatch

NS = node_config().namespace()


def synced_index(*nodes: str) -> KVIndex:
    ix = KVIndex(PS)
    for n in nodes:
        assert ix.apply(n, event(0, "snapshot", [])) is Applied.APPLIED
    return ix


def test_stored_removed_and_tier_events_drive_the_prefix_per_node() -> None:
    ix = synced_index("a", "b")
    t = tokens(1, 6)
    keys = page_keys(NS, t)
    assert ix.apply("a", event(1, "stored", [run(NS, t, 0, 4)])) is Applied.APPLIED
    assert ix.apply("b", event(1, "stored", [run(NS, t, 0, 2)])) is Applied.APPLIED
    assert ix.match(keys) == {"a": PrefixMatch(4, 0), "b": PrefixMatch(2, 0)}
    # a's last two pages move to L2 only (L1 evicted after backup)
    ix.apply("a", event(2, "tier", [run(NS, t, 2, 4, ("l2",))]))
    assert ix.match(keys)["a"] == PrefixMatch(2, 2)
    assert ix.tier_pages("a") == (2, 2)
    # removal of b's run: b holds nothing of it any more
    ix.apply("b", event(2, "removed", [run(NS, t, 0, 2, ())]))
    assert ix.match(keys) == {"a": PrefixMatch(2, 2)}
    assert ix.holders(keys[0]) == {"a": 1}
    # a request that diverges after page 1 matches one page
    other = t.copy()
    other[PS + 1] += 1
    assert ix.match(page_keys(NS, other)) == {"a": PrefixMatch(1, 0)}


def test_l2_run_continues_l1_like_the_node_match() -> None:
    ix = synced_index("a")
    t = tokens(2, 6)
    ix.apply("a", event(1, "stored", [run(NS, t, 0, 2, ("l1",))]))
    ix.apply("a", event(2, "stored", [run(NS, t, 2, 4, ("l2",))]))
    ix.apply("a", event(3, "stored", [run(NS, t, 4, 6, ("l1",))]))  # L1 after the L2 run: not usable
    assert ix.match(page_keys(NS, t))["a"] == PrefixMatch(2, 2)


def test_tenants_are_separate_key_spaces() -> None:
    ix = synced_index("a")
    t = tokens(3, 4)
    acme = NS.with_tenant("acme")
    ix.apply("a", event(1, "stored", [run(acme, t, 0, 4)]))
    assert ix.match(page_keys(acme, t))["a"] == PrefixMatch(4, 0)
    assert ix.match(page_keys(NS, t)) == {}
    assert ix.match(page_keys(NS.with_tenant("other"), t)) == {}


def test_gap_drops_the_node_and_asks_for_resync_until_a_snapshot() -> None:
    ix = synced_index("a", "b")
    t = tokens(4, 3)
    keys = page_keys(NS, t)
    ix.apply("a", event(1, "stored", [run(NS, t, 0, 3)]))
    ix.apply("b", event(1, "stored", [run(NS, t, 0, 3)]))
    assert ix.apply("a", event(1, "stored", [run(NS, t, 0, 3)])) is Applied.IGNORED  # duplicate
    assert ix.apply("a", event(3, "removed", [run(NS, t, 0, 3, ())])) is Applied.RESYNC  # 2 is missing
    assert set(ix.match(keys)) == {"b"}  # a's state is unknown: never routed on
    assert not ix.feed("a").synced
    assert ix.apply("a", event(4, "stored", [run(NS, t, 0, 3)])) is Applied.RESYNC  # still no snapshot
    assert set(ix.match(keys)) == {"b"}
    assert ix.apply("a", event(7, "snapshot", [run(NS, t, 0, 2)], server="s1")) is Applied.APPLIED
    assert ix.match(keys)["a"] == PrefixMatch(2, 0)
    assert ix.apply("a", event(8, "stored", [run(NS, t, 2, 3)])) is Applied.APPLIED
    assert ix.match(keys)["a"] == PrefixMatch(3, 0)
    assert ix.feed("a").gaps == 2 and ix.feed("a").snapshots == 2


def test_snapshot_replaces_state_and_parts_apply_at_once() -> None:
    ix = synced_index("a")
    t1, t2, t3 = tokens(5, 3), tokens(6, 3), tokens(7, 3)
    ix.apply("a", event(1, "stored", [run(NS, t1, 0, 3)]))
    ix.apply("a", event(2, "stored", [run(NS, t2, 0, 3)]))
    # the node restarted (new server id): a split snapshot holding only t3
    assert ix.apply("a", event(5, "snapshot", [run(NS, t3, 0, 1)], server="s2", more=True)) is Applied.IGNORED
    assert ix.match(page_keys(NS, t3)) == {}  # half a snapshot is not visible
    assert ix.match(page_keys(NS, t1))["a"] == PrefixMatch(3, 0)  # the old state still is
    assert ix.apply("a", event(5, "snapshot", [run(NS, t3, 1, 3)], server="s2")) is Applied.APPLIED
    assert ix.match(page_keys(NS, t3))["a"] == PrefixMatch(3, 0)
    assert ix.match(page_keys(NS, t1)) == {} and ix.match(page_keys(NS, t2)) == {}  # missed removals gone
    assert len(ix) == 3
    # a delta of the old server run is refused
    assert ix.apply("a", event(6, "stored", [run(NS, t1, 0, 3)], server="s1")) is Applied.RESYNC


def test_a_snapshot_interrupted_by_another_resyncs() -> None:
    ix = synced_index("a")
    t = tokens(8, 2)
    ix.apply("a", event(3, "snapshot", [run(NS, t, 0, 1)], more=True))
    assert ix.apply("a", event(4, "snapshot", [run(NS, t, 0, 2)], more=True)) is Applied.RESYNC
    assert ix.apply("a", event(5, "stored", [run(NS, t, 0, 2)])) is Applied.RESYNC


def test_runs_whose_keys_do_not_follow_from_tokens_are_refused() -> None:
    ix = synced_index("a")
    t = tokens(9, 3)
    good = run(NS, t, 0, 3)
    forged = good._replace(tokens=good.tokens[::-1].copy())
    ix.apply("a", event(1, "stored", [forged]))
    assert ix.feed("a").bad_runs == 1 and len(ix) == 0
    wrong_ns = run(NS.with_tenant("x"), t, 0, 3)._replace(namespace_digest=NS.digest)
    ix.apply("a", event(2, "stored", [wrong_ns]))
    assert ix.feed("a").bad_runs == 2 and len(ix) == 0
    ix.apply("a", event(3, "stored", [good]))
    assert ix.match(page_keys(NS, t))["a"] == PrefixMatch(3, 0)


def test_index_fed_by_a_real_cache_agrees_with_its_match() -> None:
    """Commits, L1 -> L2 demotions and evictions of a real HiCache, replayed into the index: for every
    prompt the index's (L1, L2) prefix equals what the cache itself would match."""
    cfg = node_config(cache={"l1_tokens": 12 * PS, "l2_tokens": 24 * PS, "write_policy": "write_through"})
    node = CacheNode("a", cfg)
    ix = KVIndex(PS)
    ix.apply("a", node.snapshot())
    rng = np.random.default_rng(0)
    docs = [tokens(100 + i, 4) for i in range(6)]
    prompts = []
    for i in range(40):
        p = np.concatenate([docs[int(rng.integers(0, 6))], tokens(1000 + i, int(rng.integers(0, 3)))])
        prompts.append(p)
        node.serve(p)
        for ev in node.drain():
            assert ix.apply("a", ev) is Applied.APPLIED
        for q in prompts[-8:]:
            with node.cache._lock:
                m = node.cache.tree.match(NS.digest, q.astype("<u4").tobytes(), touch=False)
            want = PrefixMatch(len(m.device_indices), len(m.host_indices))
            assert ix.match(page_keys(NS, q)).get("a", PrefixMatch(0, 0)) == want, i
    # and a fresh snapshot rebuilds exactly the same index
    ix2 = KVIndex(PS)
    ix2.apply("a", node.snapshot())
    assert {k: ix.holders(k) for k in ix.feed("a").pages} == {k: ix2.holders(k) for k in ix2.feed("a").pages}
    node.cache.close()
