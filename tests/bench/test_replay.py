"""The replay loop: per-tier accounting and following the trace's timestamps at a speed factor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

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
    # L1 holds 10 pages: the document's 8 stay there (hit from the second request on), but each request's
    # own suffix page is pushed out of L1 by later ones, so the second round finds it on L2 (32 pages)
    with InProcessTarget(replay_config(8, 80, 256, write_policy="write_through")) as t:
        res = replay([*reqs, *reqs], t)
    assert res.prompt.tolist() == [72] * 12
    assert res.l1[0] == 0 and res.l1[1] == 64  # the document's 8 pages, from the second request on
    assert (res.hit <= res.prompt).all() and (res.reused >= res.l1).all()
    assert res.l2.sum() > 0
    # the hit rate, recomputed independently from the per-request columns and the known prompt total
    hit_tokens = sum(int(a) + int(b) + int(c) for a, b, c in zip(res.l1, res.l2, res.l3, strict=True))
    assert res.total_tokens == 12 * 72
    assert res.hit_rate == pytest.approx(hit_tokens / (12 * 72))
    assert 0 < res.hit_rate <= (11 * 64 + 6 * 8) / (12 * 72)  # never more than the figures below

    # settled (backups finish before the next request), the figures follow from the trace by hand:
    # round 1: no hit, then the document on L1; round 2: document on L1 plus the request's suffix page on L2
    with InProcessTarget(replay_config(8, 80, 256, write_policy="write_through")) as t:
        exact = replay([*reqs, *reqs], t, settle=True)
    assert exact.settled
    assert exact.l1.tolist() == [0] + [64] * 11
    assert exact.l2.tolist() == [0] * 6 + [8] * 6
    assert exact.l3.tolist() == [0] * 12
    assert exact.reused.tolist() == [0] + [64] * 5 + [72] * 6
    assert exact.hit_rate == pytest.approx(752 / 864)  # (11 * 64 + 6 * 8) / (12 * 72) = 0.8704
    assert exact.rate(exact.l1) == pytest.approx(704 / 864) and exact.rate(exact.l2) == pytest.approx(48 / 864)


class _Counting(InProcessTarget):
    settled = 0

    def settle(self) -> None:
        self.settled += 1
        super().settle()


def test_settle_waits_after_every_request_only_when_asked() -> None:
    reqs = _reqs()
    with _Counting(replay_config(8, 256, 0)) as t:
        replay(reqs, t)
        assert t.settled == 0
        replay(reqs, t, settle=True)
        assert t.settled == len(reqs)


def test_settled_replay_depends_on_the_trace_alone(tmp_path: Path) -> None:
    """Backups to L2 and writes to L3 finish before the next request, so two replays of a trace that
    cycles through more than L1 holds find the same pages on each tier, request by request."""
    for n_docs, l2_tokens, tier in ((3, 320, "l2"), (6, 160, "l3")):  # the cycle fits L2; it does not
        docs = [np.arange(64, dtype=np.uint32) + 1000 * d for d in range(n_docs)]
        reqs = [TraceRequest(np.concatenate([docs[i % n_docs], np.array([5000 + i] * 8, np.uint32)]))
                for i in range(6 * n_docs)]
        runs = []
        for k in range(2):
            url = f"file://{tmp_path / f'{n_docs}-{k}'}"
            with InProcessTarget(replay_config(8, 80, l2_tokens, url, write_policy="write_through")) as t:
                runs.append(replay(reqs, t, settle=True))
        a, b = runs
        for col in ("l1", "l2", "l3", "reused"):
            assert getattr(a, col).tolist() == getattr(b, col).tolist(), col
        # every document after its first round comes back whole from that tier
        assert getattr(a, tier)[n_docs:].tolist() == [64] * (5 * n_docs), tier
