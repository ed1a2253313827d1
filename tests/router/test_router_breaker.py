"""The per-node circuit breaker counts transport failures only."""

from __future__ import annotations

import grpc
import pytest
from router_helpers import Clock

from hicache.router.breaker import CircuitBreaker, status_from_number

C = grpc.StatusCode
CLIENT_ERRORS = [C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.ALREADY_EXISTS, C.RESOURCE_EXHAUSTED,
                 C.UNAUTHENTICATED, C.PERMISSION_DENIED, C.CANCELLED, C.INTERNAL]


def test_client_errors_never_open_it() -> None:
    b = CircuitBreaker(failure_threshold=2, clock=Clock(0.0))
    for _ in range(50):
        for code in CLIENT_ERRORS:
            b.record(code)
    assert b.state == "closed" and b.allow() and b.trips == 0
    # and they do not reset a streak of transport failures either: they say nothing about reachability
    b.record(C.UNAVAILABLE)
    b.record(C.INVALID_ARGUMENT)
    b.record(C.DEADLINE_EXCEEDED)
    assert b.state == "open"


def test_consecutive_transport_failures_open_then_half_open_then_close() -> None:
    clock = Clock(0.0)
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5, max_cooldown_s=20, clock=clock)
    b.record(C.UNAVAILABLE)
    b.record(C.UNAVAILABLE)
    b.record(C.OK)  # a success resets the streak
    b.record(C.UNAVAILABLE)
    b.record(C.DEADLINE_EXCEEDED)
    assert b.state == "closed"
    b.record(C.UNAVAILABLE)
    assert b.state == "open" and not b.allow()
    clock.t += 5
    assert b.state == "half_open" and b.allow()
    b.record(C.UNAVAILABLE)  # the probe failed: open again, twice as long
    assert b.state == "open" and b.cooldown_s == 10
    clock.t += 9.9
    assert not b.allow()
    clock.t += 0.2
    assert b.allow()
    b.record(C.OK)
    assert b.state == "closed" and b.cooldown_s == 5 and b.trips == 2


def test_cooldown_is_capped_and_arguments_checked() -> None:
    clock = Clock(0.0)
    b = CircuitBreaker(failure_threshold=1, cooldown_s=4, max_cooldown_s=10, clock=clock)
    for _ in range(5):
        b.record(C.UNAVAILABLE)
        clock.t += b.cooldown_s
    assert b.cooldown_s == 10
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(cooldown_s=10, max_cooldown_s=5)


def test_status_numbers() -> None:
    assert status_from_number(14) is C.UNAVAILABLE and status_from_number(3) is C.INVALID_ARGUMENT
    assert status_from_number(0) is C.OK and status_from_number(999) is C.UNKNOWN


def test_a_late_success_of_a_call_begun_before_it_opened_leaves_it_open() -> None:
    clock = Clock(0.0)
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5, clock=clock)
    begun = clock.t  # a request routed here, served, its Complete still on the way
    clock.t += 1
    b.record(C.UNAVAILABLE)  # then the node goes away
    assert b.state == "open"
    clock.t += 0.5
    b.record(C.OK, started=begun)  # the late report says nothing about the node now
    assert b.state == "open" and not b.allow()
    b.record(C.OK, started=clock.t)  # a call begun after it opened did reach the node
    assert b.state == "closed"


def test_router_complete_ignores_a_late_success_once_the_node_is_out() -> None:
    from router_helpers import node_config, router_config, tokens

    from hicache.router.core import Router

    clock = Clock(0.0)
    r = Router(node_config(), router_config(["a"], breaker_failures=1))
    r.inflight._clock = clock
    r.nodes["a"].breaker._clock = clock
    tb = tokens(1, 2).astype("<u4").tobytes()
    early = r.route(tb)
    clock.t += 1
    r.record("a", C.UNAVAILABLE)  # the router's own call finds the node gone
    clock.t += 0.5
    assert r.complete(early.route_id, C.OK) == "a"  # served just before: counted, and the node stays out
    assert r.nodes["a"].breaker.state == "open"
