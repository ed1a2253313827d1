"""Handles of the CUDA transfer engine (:mod:`hicache.transfer.cuda`).

A :class:`CudaHandle` is one transfer's per-layer readiness: CUDA events, or per-layer flags in device
memory that a single-launch load publishes (:class:`LayerFlags`). A layer-wise staged load may leave
some of its steps for later (:class:`Deferral`, :mod:`hicache.transfer.deferred`); the handle submits
them as the caller asks for the layers that need them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hicache.transfer.base import TransferHandle
from hicache.transfer.cuda_driver import StreamWaiter
from hicache.transfer.deferred import Pending


@dataclass(frozen=True)
class LayerFlags:
    """Per-layer readiness published by a single-launch load: ``flags[layer] >= seq`` once it landed."""

    waiter: StreamWaiter
    flags_ptr: int  # device address of uint32 flags, one per layer
    seq: int
    context: int  # CUcontext to make current on threads that have none


class CudaHandle(TransferHandle):
    """Per-layer readiness of one transfer (CUDA events, or layer flags plus a completion event).

    Keeps the index tensors alive until it completes. A layer-wise staged load may have steps not yet
    submitted (``pending``, see :mod:`hicache.transfer.deferred`): ``wait_layer(i)`` first submits those
    up to layer ``i + ahead``, ``wait``, ``done`` and :meth:`submit` all of them.
    """

    def __init__(self, num_layers: int, num_pages: int, events: list[torch.cuda.Event],
                 backend: str, device: torch.device, keep: tuple[Any, ...] = (),
                 flags: LayerFlags | None = None, pending: Deferral | None = None) -> None:
        self.num_layers = num_layers
        self.device = device
        self.num_pages = num_pages
        self.events = events  # one per layer, or empty when nothing was copied
        self.backend = backend
        self.flags = flags
        self._keep: tuple[Any, ...] = keep
        self._pending = pending
        self.error: BaseException | None = None  # a deferred step that failed: the transfer is over

    def _submit_through(self, layer: int) -> None:
        """Submit the steps layer ``layer`` (and ``ahead`` more) needs; raise if one of them failed.

        A failed step ends the transfer (its later steps are dropped), but the steps submitted before it,
        and the failing step's own copies queued before it raised, may still be writing the destination
        pages. Before the error is raised the device is synchronised, so that once a caller sees the
        failure (here, or ``done()`` returning True) nothing of this transfer writes anywhere any more and
        its pages may go back to their pool."""
        if self.error is not None:
            raise self.error
        d = self._pending
        if d is None:
            return
        try:
            d.advance(layer)
        except Exception as e:
            self._pending = None
            self.error = e
            torch.cuda.synchronize(self.device)
            self._keep = ()
            raise
        if d.pending.complete:
            self._pending = None

    @property
    def unsubmitted_steps(self) -> int:
        """Steps of this transfer the host has not submitted yet (0 once all are queued on the device)."""
        d = self._pending
        return 0 if d is None else d.pending.total - d.pending.ran

    def submit(self) -> None:
        """Submit every step not yet submitted (never waits for the device). Afterwards the transfer is
        ordered on the engine's streams as if ``load`` had submitted it all: e.g. a device-wide
        synchronisation then covers it."""
        self._submit_through(self.num_layers - 1)

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"wait_layer: layer {layer} outside [0, {self.num_layers})")
        self._submit_through(layer)
        if not self.events or self.events[layer].query():
            return  # nothing copied, or already landed: no wait needed
        stream = torch.cuda.current_stream(self.device)
        f = self.flags
        if f is not None:
            f.waiter.wait_geq(stream.cuda_stream, f.flags_ptr + 4 * layer, f.seq, f.context)
        else:
            stream.wait_event(self.events[layer])

    def wait(self) -> None:
        self.submit()
        if self.events:
            self.events[-1].synchronize()
        self._keep = ()

    def done(self) -> bool:
        """True once every layer landed, or the transfer failed (``wait`` raises its error); never raises.
        Submits the steps not yet submitted."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self.submit()
        if self.error is not None:
            return True  # failed, and synchronised when it did: nothing more lands
        if not self.events or self.events[-1].query():
            self._keep = ()
            return True
        return False


@dataclass
class Deferral:
    """A layer-wise staged load's steps not yet submitted, and which of them each layer needs."""

    submit: Callable[[Pending, int], None]  # submits ``pending``'s steps until that many ran
    pending: Pending
    steps_for_layer: list[int]  # steps that must have run before layer i is ready (non-decreasing)
    ahead: int  # layers submitted beyond the one asked for

    def advance(self, layer: int) -> None:
        want = self.steps_for_layer[min(layer + self.ahead, len(self.steps_for_layer) - 1)]
        if self.pending.ran < want or self.pending.error is not None:
            self.submit(self.pending, want)
