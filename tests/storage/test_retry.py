"""Retry policy and circuit breaker: bounded tries, growing cooldowns, one probe, recovery."""

from __future__ import annotations

import pytest

from hicache.storage.retry import CircuitBreaker, RetryPolicy, call_with_retry


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_retry_gives_up_after_attempts_and_skips_permanent_errors() -> None:
    slept: list[float] = []
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] < 3:
            raise ConnectionError("reset")
        return "ok"

    pol = RetryPolicy(attempts=3, base_s=0.01, max_s=0.015, jitter=0.0)
    assert call_with_retry(flaky, pol, lambda e: isinstance(e, ConnectionError), sleep=slept.append) == "ok"
    assert slept == [0.01, 0.015]  # doubled, then capped

    calls["n"] = -10
    with pytest.raises(ConnectionError):
        call_with_retry(flaky, pol, lambda e: isinstance(e, ConnectionError), sleep=slept.append)

    def bug() -> None:
        raise ValueError("caller bug")

    slept.clear()
    with pytest.raises(ValueError):
        call_with_retry(bug, pol, lambda e: isinstance(e, ConnectionError), sleep=slept.append)
    assert slept == []  # not transient: no retry
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


def test_breaker_opens_probes_once_and_closes_on_success() -> None:
    clk = Clock()
    b = CircuitBreaker(base_s=1.0, max_s=4.0, clock=clk)
    assert b.allow()
    b.failure()
    assert b.is_open and not b.allow()
    clk.t = 1.0
    assert b.allow()  # the probe
    assert not b.allow()  # only one at a time
    b.failure()  # probe failed: cooldown doubles
    clk.t = 2.5
    assert not b.allow()
    clk.t = 3.0
    assert b.allow()
    b.failure()
    clk.t = 6.9
    assert not b.allow()
    clk.t = 7.0  # capped at 4 s
    assert b.allow()
    b.success()
    assert not b.is_open and b.allow() and b.allow()
    assert b.trips == 1


def test_straggler_failure_does_not_extend_an_open_breaker() -> None:
    clk = Clock()
    b = CircuitBreaker(base_s=1.0, max_s=8.0, clock=clk)
    b.failure()
    b.failure()  # an operation that started before the breaker opened
    clk.t = 1.0
    assert b.allow()
