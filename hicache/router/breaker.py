"""Per-node circuit breaker that counts only transport failures.

A node is taken out of rotation when it cannot be reached, never because a client sent it a bad
request: only ``UNAVAILABLE`` and ``DEADLINE_EXCEEDED`` count as failures. ``OK`` is a success; every
other code (``INVALID_ARGUMENT``, ``NOT_FOUND``, ``FAILED_PRECONDITION``, ``RESOURCE_EXHAUSTED``, ...)
says the node answered and is ignored.

States: ``closed`` (routable) -> after ``failure_threshold`` consecutive failures -> ``open`` (not
routable) for ``cooldown_s`` -> ``half_open`` (routable again, on probation) -> the next success closes
it, the next failure reopens it with the cooldown doubled (up to ``max_cooldown_s``). Any success closes
it at once, even while open, and resets the cooldown: the node answered -- unless the call began before
the breaker opened (a client's late report of a request served just before the node went away says
nothing about the node now). Outcomes come from the router's
own calls to the node (event stream, Stats polls every ``stats_interval_s``) and from clients' Complete
reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

TRANSPORT_FAILURES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def status_from_number(n: int) -> grpc.StatusCode:
    """grpc.StatusCode of a status number (unknown numbers: UNKNOWN)."""
    return _BY_NUMBER.get(n, grpc.StatusCode.UNKNOWN)


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 5, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold: must be >= 1, got {failure_threshold}")
        if cooldown_s <= 0 or max_cooldown_s < cooldown_s:
            raise ValueError(f"cooldown_s: need 0 < cooldown_s <= max_cooldown_s, got {cooldown_s}, {max_cooldown_s}")
        self.failure_threshold = failure_threshold
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self.failures = 0  # consecutive transport failures
        self.cooldown_s = cooldown_s
        self.opened_at: float | None = None  # set while open or half-open
        self.trips = 0  # times it opened

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "open" if self._clock() - self.opened_at < self.cooldown_s else "half_open"

    def allow(self) -> bool:
        """May a request be routed to the node now?"""
        return self.state != "open"

    def record(self, code: grpc.StatusCode, started: float | None = None) -> None:
        """Outcome of one call on the node; ``started``: when the call began (this breaker's clock), if
        known. A success of a call that began before the breaker opened is ignored."""
        if code == grpc.StatusCode.OK:
            if started is not None and self.opened_at is not None and started < self.opened_at:
                return
            self.failures = 0
            self.opened_at = None
            self.cooldown_s = self.base_cooldown_s
            return
        if code not in TRANSPORT_FAILURES:
            return  # the node answered: a client error says nothing about its health
        self.failures += 1
        state = self.state
        if state == "half_open":
            self.cooldown_s = min(self.max_cooldown_s, self.cooldown_s * 2)
            self._open()
        elif state == "closed" and self.failures >= self.failure_threshold:
            self._open()

    def _open(self) -> None:
        self.opened_at = self._clock()
        self.trips += 1
