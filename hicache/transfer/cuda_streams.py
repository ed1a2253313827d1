"""The staged path's streams: a direction's staging slots with their lanes (:class:`Stager`), and the
streams one transfer's chunk DMAs alternate over (:class:`DmaStreams`).

Ordering is by CUDA events only; the host waits only when a :class:`Stager` is made (its buffers are
initialised on its stage stream, which is then drained), in :meth:`Stager.synchronize` and in
:meth:`Stager.restart_flags`.
"""

from __future__ import annotations

import torch


class Stager:
    """One direction's staging buffer: slots used in turn, a stage stream, a few lanes (streams) for the
    per-chunk device-side copies, and for each slot the event after which it may be refilled.

    The stage stream orders transfers: the caller makes it wait for a transfer's dependencies and fetch
    its indices, :meth:`begin` marks that point, and the lanes start that transfer's copies only after
    it. A load joins every chunk's lane back into the stage stream (its per-layer events are recorded
    there), so the next transfer's copies come after all of this one's. The resident kernel runs on the stage stream.
    """

    def __init__(self, device: torch.device, n_slots: int, slot_bytes: int, max_pages: int,
                 num_layers: int = 0, lanes: int = 1) -> None:
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.stream = torch.cuda.Stream(device, priority=-1)
        self.lanes = [torch.cuda.Stream(device, priority=-1) for _ in range(max(1, min(lanes, n_slots)))]
        self._lane_start: list[torch.cuda.Event | None] = [None] * len(self.lanes)
        self.free: list[torch.cuda.Event | None] = [None] * n_slots
        self._next = 0
        # Initialised on the stage stream, which is then drained: the caller's stream may be busy, and the
        # first transfer's kernels and DMA (which follow only its submission point there) must not read
        # these before they are filled.
        with torch.cuda.stream(self.stream):
            self.buf = torch.empty(n_slots * slot_bytes + 256, dtype=torch.uint8, device=device)
            self.pos = torch.arange(max(max_pages, 1), dtype=torch.int64, device=device)
            # resident kernel (staged_kernel="resident"): per-slot flags and counters, per-layer flags
            self.slot_ready = torch.zeros(n_slots, dtype=torch.int32, device=device)
            self.slot_done = torch.zeros(n_slots, dtype=torch.int32, device=device)
            self.counters = torch.zeros(n_slots, dtype=torch.int32, device=device)
            self.layer_flags = torch.zeros(max(num_layers, 1), dtype=torch.int32, device=device)
        self.stream.synchronize()
        self.base = (self.buf.data_ptr() + 255) // 256 * 256
        self.last = [0] * n_slots  # chunk number that last used each slot (0: never)
        self.chunk_seq = 0
        self.layer_seq = 0

    def restart_flags(self) -> None:
        """Zero the resident kernel's flags and numbering once all queued work is done (before the
        numbers would pass ``SEQ_LIMIT``)."""
        torch.cuda.synchronize(self.slot_ready.device)
        for t in (self.slot_ready, self.slot_done, self.layer_flags):
            t.zero_()
        torch.cuda.synchronize(self.slot_ready.device)
        self.last = [0] * self.n_slots
        self.chunk_seq = 0
        self.layer_seq = 0

    def take(self) -> tuple[int, int]:
        """The next slot to fill: (slot number, device address)."""
        s = self._next
        self._next = (s + 1) % self.n_slots
        return s, self.base + s * self.slot_bytes

    def begin(self) -> None:
        """Mark the start of a transfer's lane work: everything queued on the stage stream so far (its
        dependencies, its index fetch, an earlier load's joins) comes before the copies :meth:`lane`
        hands out next."""
        start = torch.cuda.Event()
        start.record(self.stream)
        self._lane_start = [start] * len(self.lanes)

    def lane(self, slot: int, lanes: int | None = None) -> torch.cuda.Stream:
        """The stream for slot ``slot``'s device-side copy, made to wait for the transfer's start on
        first use after :meth:`begin`; ``lanes`` (default all) limits the transfer to the first lanes.
        Any slot may go on any lane from one transfer to the next: slot reuse is ordered by the events in
        ``free``, not by the lane."""
        k = slot % (len(self.lanes) if lanes is None else max(1, min(lanes, len(self.lanes))))
        lane = self.lanes[k]
        start = self._lane_start[k]
        if start is not None:
            lane.wait_event(start)
            self._lane_start[k] = None
        return lane

    def synchronize(self) -> None:
        """Block until the stage stream and every lane are idle."""
        self.stream.synchronize()
        for lane in self.lanes:
            lane.synchronize()


class DmaStreams:
    """A staged transfer's chunk DMAs spread over ``main`` and ``lanes``: chunk ``k`` goes on stream
    ``k % (1 + len(lanes))``.

    Device-to-host copies of a few tens of KiB each wait longer to start while compute loads HBM; on
    parallel streams those waits overlap (the copy-engine path fans its backups out the same way, in
    ``CudaTransferEngine._run_fanned``). And each stream's queue on the device holds only so many
    copies before the host call adding one blocks until the device drains it; several streams queue
    more. Ordering: a lane first
    waits for everything queued on ``main`` before the transfer (its dependencies, and an earlier
    transfer's writes to the same pages), and :meth:`join` makes ``main`` wait for every lane used, so
    later work on ``main`` follows the whole transfer.
    """

    def __init__(self, main: torch.cuda.Stream, lanes: list[torch.cuda.Stream]) -> None:
        self.main = main
        self.all = [main, *lanes]
        self._start: torch.cuda.Event | None = None
        if lanes:  # recorded before the transfer's first DMA, which goes on main
            self._start = torch.cuda.Event()
            self._start.record(main)
        self._used: set[int] = set()

    def stream(self, k: int) -> torch.cuda.Stream:
        """The stream for the transfer's ``k``-th chunk (made to wait for the transfer's start on first use)."""
        i = k % len(self.all)
        if i and i not in self._used:
            assert self._start is not None
            self.all[i].wait_event(self._start)
            self._used.add(i)
        return self.all[i]

    def join(self) -> None:
        """Make ``main`` wait for every lane this transfer used."""
        for i in sorted(self._used):
            end = torch.cuda.Event()
            end.record(self.all[i])
            self.main.wait_event(end)
