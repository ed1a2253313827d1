"""Retries with exponential backoff, and a circuit breaker, for L3 stores.

* :class:`RetryPolicy` -- how often one operation is tried again on a *transient* error (connection
  refused or reset, timeout, a store still loading) and how long to back off in between (exponential,
  capped, with jitter so many clients do not retry in lock step).
* :class:`CircuitBreaker` -- once an operation has failed after its retries, the store is presumed down:
  for a cooldown (doubling from ``base_s`` up to ``max_s`` while failures continue) operations are refused
  at once instead of each one waiting for its own timeouts. After the cooldown one caller probes; its
  failure opens the breaker again, and any success (the probe's, or a late one of a call that started
  earlier) closes it (the store came back). This is what keeps a dead
  store from slowing every request down, and what brings L3 back by itself.

Both are thread-safe and take an injectable clock / sleep for tests.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3  # tries per operation, the first included (1 = never retry)
    base_s: float = 0.02  # backoff before the first retry
    max_s: float = 0.5  # cap on one backoff
    jitter: float = 0.5  # each backoff is scaled by a random factor in [1 - jitter, 1]

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"retry attempts: must be >= 1, got {self.attempts}")
        if self.base_s < 0 or self.max_s < 0:
            raise ValueError("retry backoff: base_s and max_s must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"retry jitter: must be in [0, 1], got {self.jitter}")

    def delays(self) -> Iterator[float]:
        """Backoff before each retry (``attempts - 1`` values)."""
        d = self.base_s
        for _ in range(self.attempts - 1):
            yield min(d, self.max_s) * (1.0 - self.jitter * random.random())
            d *= 2


def call_with_retry(fn: Callable[[], T], policy: RetryPolicy, is_transient: Callable[[BaseException], bool],
                    on_retry: Callable[[BaseException], None] | None = None,
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """Run ``fn``; on a transient error back off and try again, up to ``policy.attempts`` tries.

    The last error (or the first non-transient one) propagates.
    """
    delays = policy.delays()
    while True:
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise
            d = next(delays, None)
            if d is None:
                raise
            if on_retry is not None:
                on_retry(e)
            sleep(d)


class CircuitBreaker:
    """closed --failure--> open (cooldown) --cooldown over--> one probe --success--> closed."""

    def __init__(self, base_s: float = 0.25, max_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if base_s < 0 or max_s < base_s:
            raise ValueError("breaker: need 0 <= base_s <= max_s")
        self.base_s = base_s
        self.max_s = max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open_until = 0.0
        self._cooldown = 0.0  # 0 while closed
        self._probing = False
        self.trips = 0  # times it opened

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._cooldown > 0

    def allow(self) -> bool:
        """May an operation go to the store now? (While open: only one probe after the cooldown.)"""
        with self._lock:
            if self._cooldown == 0:
                return True
            if self._probing or self._clock() < self._open_until:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            self._cooldown = 0.0
            self._probing = False

    def failure(self) -> None:
        with self._lock:
            if self._cooldown == 0:
                self.trips += 1
            elif not self._probing:
                return  # a straggler that started before the breaker opened: keep the cooldown
            self._cooldown = self.base_s if self._cooldown == 0 else min(self._cooldown * 2, self.max_s)
            self._open_until = self._clock() + self._cooldown
            self._probing = False
