"""The deferred-submission queue (hicache.transfer.deferred): FIFO across transfers, partial advances,
failures kept with their own transfer. Pure Python: runs without a GPU."""

from __future__ import annotations

from collections.abc import Generator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.transfer.deferred import Pending, SubmitQueue


def _steps(name: str, n: int, log: list[tuple[str, int]], fail_at: int | None = None) -> Generator[None, None, None]:
    for i in range(n):
        if i == fail_at:
            raise RuntimeError(f"{name} step {i} failed")
        log.append((name, i))
        yield


def test_advance_runs_earlier_transfers_first_and_only_what_is_asked() -> None:
    log: list[tuple[str, int]] = []
    q = SubmitQueue()
    a, b = Pending(_steps("a", 3, log), 3), Pending(_steps("b", 4, log), 4)
    q.add(a)
    q.add(b)
    q.advance(b, 2)
    assert log == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert a.complete and not b.complete and b.ran == 2 and len(q) == 1
    q.advance(b, 1)  # already ran that many: nothing more
    assert b.ran == 2
    q.advance(b, 99)  # more than it has: all of it
    assert b.complete and len(q) == 0 and log[-1] == ("b", 3)


def test_run_all_and_completed_transfers_are_never_queued() -> None:
    log: list[tuple[str, int]] = []
    q = SubmitQueue()
    a = Pending(_steps("a", 2, log), 2)
    q.add(a)
    q.advance(a, 2)
    assert a.complete and len(q) == 0
    q.add(a)  # complete: not queued again
    assert len(q) == 0
    b, c = Pending(_steps("b", 2, log), 2), Pending(_steps("c", 1, log), 1)
    q.add(b)
    q.add(c)
    q.run_all()
    assert b.complete and c.complete and len(q) == 0
    assert log == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0)]


def test_a_failed_step_stays_with_its_transfer() -> None:
    log: list[tuple[str, int]] = []
    q = SubmitQueue()
    a = Pending(_steps("a", 3, log, fail_at=1), 3)
    b = Pending(_steps("b", 2, log), 2)
    q.add(a)
    q.add(b)
    q.advance(b, 2)  # runs a's steps on the way: a's failure is not b's
    assert b.complete and b.error is None
    assert a.complete and isinstance(a.error, RuntimeError)
    assert log == [("a", 0), ("b", 0), ("b", 1)]  # a's later steps were dropped
    for _ in range(2):  # raised by a's own advance, every time
        with pytest.raises(RuntimeError, match="a step 1 failed"):
            q.advance(a, 3)


def test_a_generator_shorter_than_announced_is_an_error() -> None:
    log: list[tuple[str, int]] = []
    q = SubmitQueue()
    a = Pending(_steps("a", 1, log), 2)
    q.add(a)
    with pytest.raises(RuntimeError, match="after 1 of 2 steps"):
        q.advance(a, 2)
    with pytest.raises(ValueError, match="total"):
        Pending(_steps("x", 0, log), 0)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5),
       calls=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), max_size=20))
def test_any_advances_keep_the_global_order(sizes: list[int], calls: list[tuple[int, int]]) -> None:
    """Whatever transfers are advanced, in whatever order and by how much, the steps that ran are a
    prefix of the submission order (every step of a transfer before any of a later one), and each
    transfer asked for ``k`` steps has run at least ``min(k, total)``."""
    log: list[tuple[str, int]] = []
    q = SubmitQueue()
    ps = []
    for i, n in enumerate(sizes):
        p = Pending(_steps(str(i), n, log), n)
        q.add(p)
        ps.append(p)
    order = [(str(i), j) for i, n in enumerate(sizes) for j in range(n)]
    for which, k in calls:
        p = ps[which % len(ps)]
        q.advance(p, k)
        assert p.ran >= min(k, p.total)
        assert log == order[:len(log)]
    q.run_all()
    assert log == order and all(p.complete for p in ps) and len(q) == 0
