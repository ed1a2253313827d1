"""The replay loop: serve every request of a trace against a target, in order, optionally at the trace's
own pace (``speed`` x real time), and keep per-request tier accounting.

A request leaves work running in the background (its pages backed up to L2, written to L3). Replayed
back to back, thousands of requests a second, the next requests come before that work is done, so
they miss pages a serving engine -- whose requests are milliseconds to seconds apart -- would find, and
the hit rate depends on how fast this machine is. ``settle`` waits for that work after every request,
which makes a replay's result a function of the trace and the configuration alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.bench.targets import Target
from hicache.bench.workloads import TraceRequest


@dataclass
class ReplayResult:
    """Per-request token counts (numpy arrays, one entry per request) and totals."""

    prompt: np.ndarray  # prompt tokens
    l1: np.ndarray  # hit on L1
    l2: np.ndarray  # hit on L2 (continuing L1)
    l3: np.ndarray  # hit on L3 (continuing L2): served from it, not merely reported present at match
    reused: np.ndarray  # not recomputed (on L1 after load-back)
    wall_s: float
    cache_s: float  # time spent inside the cache calls
    stats: dict[str, Any] = field(default_factory=dict)
    settled: bool = False  # the target's background work was waited for after every request

    @property
    def requests(self) -> int:
        return len(self.prompt)

    @property
    def total_tokens(self) -> int:
        return int(self.prompt.sum())

    @property
    def hit(self) -> np.ndarray:
        return self.l1 + self.l2 + self.l3

    def rate(self, tokens: np.ndarray) -> float:
        total = self.total_tokens
        return float(tokens.sum()) / total if total else 0.0

    def request_rate(self, tokens: np.ndarray) -> float:
        """Share of requests with at least one hit page in ``tokens``."""
        return float((tokens > 0).mean()) if len(tokens) else 0.0

    @property
    def hit_rate(self) -> float:
        return self.rate(self.hit)


def replay(requests: Sequence[TraceRequest], target: Target, progress: Callable[[int], None] | None = None,
           follow_timestamps: bool = False, speed: float = 1.0, settle: bool = False) -> ReplayResult:
    """Serve ``requests`` in order. With ``follow_timestamps`` request i starts no earlier than
    ``timestamp_i / speed`` seconds after the replay starts; otherwise back to back. With ``settle`` the
    target's background work is waited for after each request (:meth:`Target.settle`; not counted in
    ``cache_s``); ``settled`` in the result says whether the target could."""
    if speed <= 0:
        raise ValueError(f"speed: must be > 0, got {speed}")
    n = len(requests)
    cols = np.zeros((5, n), dtype=np.int64)
    cache_s = 0.0
    settled = settle
    t0 = time.perf_counter()
    for i, req in enumerate(requests):
        if follow_timestamps:
            delay = req.timestamp / speed - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)
        o = target.serve(req)
        cols[:, i] = (len(req.tokens), o.l1, o.l2, o.l3, o.reused)
        cache_s += o.seconds
        if settle:
            settled = target.settle() and settled
        if progress is not None:
            progress(i + 1)
    wall = time.perf_counter() - t0
    return ReplayResult(cols[0], cols[1], cols[2], cols[3], cols[4], wall, cache_s, target.stats(), settled)
