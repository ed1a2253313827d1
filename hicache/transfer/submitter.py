"""Submission of CUDA transfers on a thread of their own.

Queuing one staged transfer costs the host thousands of copy calls (4-10 ms for a 256 MiB load of 4 KiB
pieces, about the device's own time). Made on the caller's thread, that time is taken from the serving
loop: a layer-wise forward could queue its first layer's compute only once the whole load was queued.
:class:`Submitter` runs the submissions on one thread instead, in call order, and a
:class:`PendingHandle` makes each layer usable as soon as its part of the load is queued.

Contract:

* Jobs run one at a time, first in first out, on the submitter's thread; a job that raises fails its
  own handle (:meth:`PendingHandle.fail`) and the thread goes on with the next one.
* :meth:`PendingHandle.wait_layer` blocks the host only until the submission has published layer ``i``'s
  event (or finished), then makes the caller's current stream wait on that event, as a handle made
  inline does. ``wait`` and ``done`` act on the finished submission; a failure is re-raised by
  ``wait_layer`` and ``wait``, and makes ``done`` true.
* :meth:`Submitter.flush` returns once every job queued before it has run (its copies queued on the
  device, not finished).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from hicache.transfer.base import TransferHandle


class PendingHandle(TransferHandle):
    """A transfer whose submission may still be running on the submitter's thread."""

    def __init__(self, num_layers: int, num_pages: int, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.device = device
        self._cond = threading.Condition()
        self._events: list[torch.cuda.Event | None] = [None] * num_layers
        self._inner: TransferHandle | None = None
        self._error: BaseException | None = None

    # -- the submitter's side --
    def publish(self, layer: int, event: torch.cuda.Event) -> None:
        """Layer ``layer`` has landed once ``event`` has (recorded already)."""
        with self._cond:
            self._events[layer] = event
            self._cond.notify_all()

    def complete(self, inner: TransferHandle) -> None:
        """The submission finished: ``inner`` is the transfer's own handle."""
        with self._cond:
            self._inner = inner
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    # -- the caller's side --
    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"page transfer submission failed: {self._error}") from self._error

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"wait_layer: layer {layer} outside [0, {self.num_layers})")
        with self._cond:
            self._cond.wait_for(lambda: self._inner is not None or self._error is not None
                                or self._events[layer] is not None)
            inner, event = self._inner, self._events[layer]
        self._raise()
        if inner is not None:
            inner.wait_layer(layer)
        elif event is not None and not event.query():
            torch.cuda.current_stream(self.device).wait_event(event)

    def submitted(self, timeout: float | None = None) -> bool:
        """Block until the submission finished (or failed), at most ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._inner is not None or self._error is not None, timeout)

    def result(self) -> TransferHandle:
        """The transfer's own handle, once its submission finished (re-raises a failure)."""
        self.submitted()
        self._raise()
        assert self._inner is not None
        return self._inner

    def wait(self) -> None:
        self.result().wait()

    def done(self) -> bool:
        with self._cond:
            inner, error = self._inner, self._error
        return error is not None or (inner is not None and inner.done())


class Submitter:
    """One thread that runs submission jobs in the order they were put."""

    def __init__(self, name: str = "hicache-submit") -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                job()
            except BaseException:  # a job reports its own failure through its handle
                pass
            finally:
                self._queue.task_done()

    def put(self, job: Callable[[], None]) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("transfer submitter is closed")
        self._queue.put(job)

    def flush(self) -> None:
        """Until every job queued so far has run."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Run the queued jobs, then stop the thread. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
