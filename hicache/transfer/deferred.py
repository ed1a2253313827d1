"""Deferred submission: the later steps of a layer-wise load, submitted by the caller's own waits.

Submitting a staged load of many small pieces costs the host milliseconds (one DMA descriptor per page and
layer group, a kernel launch and a few events per staging slot: about 9 ms for a 32-layer load of 600 MB
in 4 KiB pieces on an H200 host). Were all of it done inside ``load``, a serving loop that calls ``load``
and then queues layer 0's attention would queue it only after the whole submission. Instead ``load``
submits the steps that make the first layers ready and returns; each ``wait_layer(i)`` submits the steps
up to layer ``i + ahead`` before it makes the compute stream wait, so the host's submission runs while
the device already copies and computes. No thread is involved: the caller's own calls do the work, in the
order it asks for the layers (the way a per-layer retrieval generator is driven by the model's layer hook).

Contract (:class:`SubmitQueue`):

* Steps run in the order their transfers were submitted (FIFO across transfers): a step of a transfer
  never runs before every step of the transfers submitted before it. The engine runs every pending step
  (:meth:`SubmitQueue.run_all`) before it submits a new transfer, and in ``synchronize`` and ``close``,
  so what it knows of earlier transfers (their events, the slots they use) is complete when it plans.
* :meth:`SubmitQueue.advance` runs the pending steps of earlier transfers, then the transfer's own up to
  the number asked. It never blocks on the device (a submission call may block the host while a stream's
  queue on the device is full, as it would inside ``load``).
* A step that raises ends its transfer: its later steps are dropped and the error is kept on
  :class:`Pending`; :meth:`SubmitQueue.advance` of that transfer raises it, every time (the layers it
  never submitted have no event to wait on). A failure is never raised to another transfer whose advance
  happened to run the step.
* The queue does no locking: the engine calls it holding its own lock.

Pure Python, no GPU: :mod:`hicache.transfer.cuda` feeds it generators that each submit one unit of a load.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator


class Pending:
    """The steps of one transfer not yet run: ``steps`` yields once per step it has just submitted."""

    def __init__(self, steps: Generator[None, None, None], total: int) -> None:
        if total < 1:
            raise ValueError(f"Pending: total must be >= 1, got {total}")
        self._steps = steps
        self.total = total
        self.ran = 0  # steps run so far
        self.error: BaseException | None = None

    @property
    def complete(self) -> bool:
        """True once every step ran, or a step failed (the rest are dropped)."""
        return self.ran >= self.total

    def _step(self) -> None:
        try:
            next(self._steps)
        except StopIteration:
            self.error = RuntimeError(f"deferred transfer ended after {self.ran} of {self.total} steps")
            self.ran = self.total
            return
        except Exception as e:  # kept for the transfer's own waits
            self.error = e
            self.ran = self.total
            self._steps.close()
            return
        self.ran += 1
        if self.ran == self.total:
            self._steps.close()  # a generator past its last step: release what it holds


class SubmitQueue:
    """Pending transfers of one engine, oldest first (see the module docstring for the contract)."""

    def __init__(self) -> None:
        self._queue: deque[Pending] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, p: Pending) -> None:
        """Queue ``p`` after every transfer already pending (nothing runs now)."""
        if not p.complete:
            self._queue.append(p)

    def run_all(self) -> None:
        """Run every pending step of every transfer, oldest first. Failures stay with their transfers."""
        while self._queue:
            p = self._queue[0]
            while not p.complete:
                p._step()
            self._queue.popleft()

    def advance(self, p: Pending, steps: int) -> None:
        """Run the steps of transfers queued before ``p``, then ``p``'s until ``steps`` of it ran (or all);
        raise ``p``'s error if one of its steps failed, now or before."""
        target = min(steps, p.total)
        while p.ran < target and self._queue:
            head = self._queue[0]
            goal = target if head is p else head.total
            while head.ran < goal and not head.complete:
                head._step()
            if head.complete:
                self._queue.popleft()
            if head is p:
                break
        if p.error is not None:
            raise p.error
