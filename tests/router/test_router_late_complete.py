"""A completion that arrives after its route's TTL: the route no longer counts in flight, but the node's
breaker still hears how the call went (a slow call that failed), for up to another TTL."""

from __future__ import annotations

import grpc
from router_helpers import Clock, node_config, router_config, tokens

from hicache.router import Router

TTL = 10.0


def late_router(**kw: object) -> tuple[Router, Clock]:
    r = Router(node_config(), router_config(["a"], route_ttl_s=TTL, **kw))  # type: ignore[arg-type]
    clock = Clock()
    r.inflight._clock = clock
    return r, clock


def test_failures_reported_after_the_ttl_still_open_the_breaker() -> None:
    r, clock = late_router(breaker_failures=2)
    ids = [r.route(tokens(i, 2).astype("<u4").tobytes()).route_id for i in range(3)]
    assert r.inflight.count("a") == 3
    clock.t += TTL + 1  # every route is past its TTL: no longer load
    r.inflight.expire()
    assert r.inflight.count("a") == 0
    assert r.complete_route(ids[0], grpc.StatusCode.UNAVAILABLE) == ("a", True)  # late, still known
    assert r.complete_route(ids[1], grpc.StatusCode.DEADLINE_EXCEEDED) == ("a", True)
    assert r.nodes["a"].breaker.state == "open" and r.nodes["a"].breaker.trips == 1
    again = r.complete_call(ids[0], grpc.StatusCode.UNAVAILABLE)  # a retried Complete: told, nothing counted
    assert again == ("a", False, True) and r.nodes["a"].breaker.trips == 1
    assert r.inflight.count("a") == 0  # nothing counted back in flight


def test_a_completion_in_time_is_not_late() -> None:
    r, clock = late_router()
    rid = r.route(tokens(9, 2).astype("<u4").tobytes()).route_id
    clock.t += TTL - 1
    assert r.complete_route(rid) == ("a", False) and r.inflight.count("a") == 0


def test_a_completion_past_twice_the_ttl_is_unknown_and_changes_nothing() -> None:
    r, clock = late_router(breaker_failures=1)
    rid = r.route(tokens(1, 2).astype("<u4").tobytes()).route_id
    clock.t += 2 * TTL + 1
    assert r.complete(rid, grpc.StatusCode.UNAVAILABLE) is None
    assert r.nodes["a"].breaker.state == "closed" and r.nodes["a"].breaker.failures == 0


def test_routes_kept_for_late_completions_are_bounded() -> None:
    r, clock = late_router()
    r.inflight.LATE_CAP = 5
    ids = [r.route(tokens(i, 2).astype("<u4").tobytes()).route_id for i in range(8)]
    clock.t += TTL + 1
    r.inflight.expire()
    assert len(r.inflight._late) == 5
    assert r.complete(ids[0]) is None and r.complete(ids[-1]) == "a"  # the oldest went first
