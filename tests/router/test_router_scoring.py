"""Routing policies and the router's load accounting: prefix vs load, hot spots, counters that move."""

from __future__ import annotations

import collections

import grpc
import pytest
from router_helpers import PS, Clock, event, node_config, router_config, run, tokens

from hicache.router import scoring
from hicache.router.core import Router
from hicache.router.scoring import (
    Candidate,
    Decision,
    RoutingPolicy,
    ScoringParams,
    create_policy,
    policy_names,
    register_policy,
)

NS = node_config().namespace()


def cand(node: str, l1: int = 0, l2: int = 0, in_flight: int = 0, queue: int = 0) -> Candidate:
    return Candidate(node, l1, l2, in_flight, queue)


def test_cache_aware_picks_the_node_with_the_longest_prefix() -> None:
    p = create_policy("cache_aware")
    d = p.choose([cand("a", 2), cand("b", 8), cand("c", 4, 4)], 10)
    assert (d.chosen, d.reason) == (1, "prefix")
    assert [round(s.prefix_score, 2) for s in d.scores] == [0.2, 0.8, 0.76]
    # an L2 prefix is worth a little less than the same length on L1, more than a shorter L1 one
    assert p.choose([cand("a", 0, 8), cand("b", 8)], 10).chosen == 1
    assert p.choose([cand("a", 0, 8), cand("b", 6)], 10).chosen == 0


def test_cache_aware_trades_prefix_for_load() -> None:
    p = create_policy("cache_aware", ScoringParams(load_weight=0.1, balance_abs_threshold=100))
    # half the request cached, 4 more in flight: 0.5 + 0.4 < 1.0 -> stay
    assert p.choose([cand("a", 5, in_flight=4), cand("b")], 10).chosen == 0
    # 6 more in flight: 0.5 + 0.6 > 1.0 -> the idle node
    assert p.choose([cand("a", 5, in_flight=6), cand("b")], 10).chosen == 1
    # the node's reported queue counts too (max of the two, not the sum)
    assert p.choose([cand("a", 5, in_flight=2, queue=6), cand("b")], 10).chosen == 1
    assert p.choose([cand("a", 5, in_flight=4, queue=4), cand("b")], 10).chosen == 0


def test_a_short_shared_prefix_does_not_pull_new_work() -> None:
    """A tenant's system prompt (10% of the request) alone: go by load, so new document sets spread."""
    p = create_policy("cache_aware", ScoringParams(min_prefix_score=0.2))
    d = p.choose([cand("a", 1, in_flight=1), cand("b")], 10)
    assert (d.chosen, d.reason) == (1, "balance")
    assert d.scores[0].prefix_score == 0.1  # still reported
    assert p.choose([cand("a", 2, in_flight=1), cand("b")], 10).chosen == 0  # 20% counts
    no_thr = create_policy("cache_aware", ScoringParams(min_prefix_score=0.0))
    assert no_thr.choose([cand("a", 1, in_flight=0), cand("b")], 10).chosen == 0


def test_hot_spot_spreads_a_popular_prefix() -> None:
    p = create_policy("cache_aware", ScoringParams(load_weight=0.01, balance_abs_threshold=4,
                                                   balance_rel_threshold=1.5))
    full = [cand("a", 10, in_flight=3), cand("b", 0, in_flight=0), cand("c", 2, in_flight=1)]
    assert p.choose(full, 10).chosen == 0  # 3 - 0 < 4: keep the prefix
    hot = [cand("a", 10, in_flight=4), cand("b", 0, in_flight=0), cand("c", 2, in_flight=1)]
    d = p.choose(hot, 10)
    assert d.reason == "hot_spot" and d.chosen == 2  # best cost among the nodes near the least loaded
    # relative threshold: 12 vs 9 is not a hot spot (12 <= 1.5 * 9) even though 12 - 9 >= 3
    p2 = create_policy("cache_aware", ScoringParams(load_weight=0.01, balance_abs_threshold=3))
    assert p2.choose([cand("a", 10, in_flight=12), cand("b", in_flight=9)], 10).chosen == 0


def test_ties_rotate_instead_of_always_taking_the_first_node() -> None:
    for name in policy_names():
        p = create_policy(name)
        picks = collections.Counter(p.choose([cand("a"), cand("b"), cand("c")], 4).chosen for _ in range(30))
        assert picks == {0: 10, 1: 10, 2: 10}, name


def test_least_load_and_round_robin() -> None:
    ll = create_policy("least_load")
    assert ll.choose([cand("a", 10, in_flight=3), cand("b", queue=2), cand("c", in_flight=5)], 10).chosen == 1
    rr = create_policy("round_robin")
    assert [rr.choose([cand("a", 10), cand("b")], 10).chosen for _ in range(4)] == [0, 1, 0, 1]


def test_policy_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    # a registry of its own: the policy registered below must not outlive this test (the Helm values
    # schema lists the registered policies)
    monkeypatch.setattr(scoring.POLICIES, "_entries", dict(scoring.POLICIES._entries))
    assert {"cache_aware", "round_robin", "least_load"} <= set(policy_names())
    with pytest.raises(ValueError, match="unknown 'nope'"):
        create_policy("nope")

    @register_policy("test_last_node")
    class LastNode(RoutingPolicy):
        def choose(self, candidates: list[Candidate], num_pages: int) -> Decision:  # type: ignore[override]
            return Decision(len(candidates) - 1, "last", [])

    assert create_policy("test_last_node").choose([cand("a"), cand("b")], 1).chosen == 1
    with pytest.raises(ValueError, match="twice"):
        register_policy("test_last_node")(LastNode)
    with pytest.raises(ValueError, match="l2_weight"):
        ScoringParams(l2_weight=2)


# ---------------------------------------------------------------------- router-level load accounting


def router_with_prefix(clock: Clock, **kw: object) -> tuple[Router, bytes]:
    r = Router(node_config(), router_config(["a", "b", "c"], **kw))  # type: ignore[arg-type]
    r.inflight._clock = clock
    for st in r.nodes.values():
        st.breaker._clock = clock
        st.queue._clock = clock
    t = tokens(1, 8)
    for n in r.nodes:
        r.apply_event(n, event(0, "snapshot", []))
    r.apply_event("a", event(1, "stored", [run(NS, t, 0, 8)]))
    return r, t.astype("<u4").tobytes()


def test_routes_follow_the_prefix_and_completions_free_the_node() -> None:
    r, tb = router_with_prefix(Clock())
    d = r.route(tb)
    assert (d.node, d.l1_pages, d.num_pages, d.reason) == ("a", 8, 8, "prefix")
    assert r.inflight.count("a") == 1
    assert r.complete(d.route_id) == "a" and r.inflight.count("a") == 0
    assert r.complete_call(d.route_id) == ("a", False, True)  # twice: a repeat, nothing counted again
    assert r.inflight.count("a") == 0
    peek = r.route(tb, peek=True)
    assert peek.route_id == "" and r.inflight.count("a") == 0


def test_a_node_whose_reported_load_never_moves_cannot_take_every_request() -> None:
    """The node never reports a queue (stays 0) and nobody calls Complete: the router's own in-flight
    count still moves at every route, so the popular prefix spills over to the other nodes."""
    r, tb = router_with_prefix(Clock(), balance_abs_threshold=4.0)
    picks = collections.Counter(r.route(tb).node for _ in range(60))
    assert picks["a"] < 30 and picks["b"] > 10 and picks["c"] > 10, picks
    # the prefix is worth 1 / load_weight = 10 queued requests: a never runs further ahead than that
    assert max(r.inflight.count(n) for n in "abc") - min(r.inflight.count(n) for n in "abc") <= 10


def test_routes_never_completed_expire_so_load_cannot_stick() -> None:
    clock = Clock()
    r, tb = router_with_prefix(clock, route_ttl_s=30.0, balance_abs_threshold=4.0)
    for _ in range(12):
        r.route(tb)
    assert r.inflight.count("a") >= 4
    clock.t += 31
    d = r.route(tb)
    assert d.node == "a" and r.inflight.count("a") == 1 and r.inflight.expired == 12


def test_stale_queue_reports_stop_counting() -> None:
    clock = Clock()
    r, tb = router_with_prefix(clock, stats_interval_s=1.0, balance_abs_threshold=4.0)
    r.report_queue("a", 50)
    assert r.route(tb, peek=True).node != "a"
    clock.t += 10  # no report for 10 s (polls failing): the old depth is not trusted
    assert r.route(tb, peek=True).node == "a"


def test_client_errors_never_take_a_node_out_but_transport_failures_do() -> None:
    r, tb = router_with_prefix(Clock(), breaker_failures=3)
    for _ in range(20):
        d = r.route(tb)
        r.complete(d.route_id, grpc.StatusCode.INVALID_ARGUMENT)
    assert r.nodes["a"].breaker.state == "closed" and r.route(tb, peek=True).node == "a"
    for _ in range(3):
        d = r.route(tb, exclude=["b", "c"])
        r.complete(d.route_id, grpc.StatusCode.UNAVAILABLE)
    d = r.route(tb, peek=True)
    assert d.node != "a" and d.scores["a"].why_not == "breaker open"
    assert d.scores["a"].l1_pages == 8  # still reported, just not eligible
    with pytest.raises(Exception, match="no node can take"):
        r.route(tb, exclude=["b", "c"])
    with pytest.raises(ValueError, match="unknown node"):
        r.route(tb, exclude=["zz"])
    with pytest.raises(ValueError, match="policy"):
        r.route(tb, policy="zz")


def test_a_node_of_another_namespace_is_never_routed_to() -> None:
    r, tb = router_with_prefix(Clock())
    other = node_config(model={"name": "other-model"}).namespace()
    assert not r.set_namespace_digest("a", other.digest, "model=other-model")
    assert r.route(tb, peek=True).node != "a"
    assert "namespace mismatch" in r.views()[0].last_error
    assert r.set_namespace_digest("b", NS.digest)


def test_router_keys_match_the_nodes_for_every_tenant() -> None:
    r, _ = router_with_prefix(Clock())
    t = tokens(2, 3)
    acme = NS.with_tenant("acme")
    r.apply_event("b", event(1, "stored", [run(acme, t, 0, 3)]))
    tb = t.astype("<u4").tobytes()
    assert r.route(tb, tenant="acme", peek=True).node == "b"
    d = r.route(tb, tenant="globex", peek=True)
    assert d.l1_pages == 0 and d.reason == "balance"
    assert r.page_size == PS
