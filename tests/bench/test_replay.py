"""The replay loop: per-tier accounting and following the trace's timestamps at a speed factor."""

from __future__ import annotations

import numpy as np

from hicache.bench.replay import replay
from hicache.bench.run import replay_config
from hicache.bench.targets import InProcessTarget
from hicache.bench.workloads import TraceRequest


def _reqs() -> list[TraceRequest]:
    doc = np.arange(64, dtype=np.uint32)
    return [TraceRequest(np.concatenate([doc, np.array([100 + i] * 8, np.uint32)]), timestamp=0.1 * i)
            for i in range(6)]


def test_follows_timestamps_at_speed() -> None:
    with InProcessTarget(replay_config(8, 256, 0)) as t:
        res = replay(_reqs(), t, follow_timestamps=True, speed=2.0)  # last request at 0.5 s -> 0.25 s
    assert 0.25 <= res.wall_s < 2.0
    with InProcessTarget(replay_config(8, 256, 0)) as t:
        fast = replay(_reqs(), t)
    assert fast.wall_s < 0.25


def test_tier_accounting_l1_then_l2() -> None:
    reqs = _reqs()
    with InProcessTarget(replay_config(8, 80, 256, write_policy="write_through")) as t:
        res = replay([*reqs, *reqs], t)  # L1 holds 10 pages: the second round finds the document on L2
    assert res.prompt.tolist() == [72] * 12
    assert res.l1[0] == 0 and res.l1[1] == 64  # the document's 8 pages, from the second request on
    assert (res.hit <= res.prompt).all() and (res.reused >= res.l1).all()
    assert res.l2.sum() > 0
    assert res.hit_rate == res.rate(res.l1 + res.l2 + res.l3)
