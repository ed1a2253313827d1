"""The staged path of the CUDA transfer engine: page runs by DMA through a device staging slot, and a
device-side scatter (loads) or gather (backups) between the slot and L1.

Planning is in :mod:`hicache.transfer.staged_plan` (pure NumPy); the slots, lanes and DMA streams in
:mod:`hicache.transfer.cuda_streams`. This module submits: per chunk, the DMA on a copy stream and the
kernel on the slot's lane, ordered by events, with layer-wise loads staggered, optionally headed by the
gather kernel, and deferred unit by unit (:mod:`hicache.transfer.deferred`). A mixin of
:class:`~hicache.transfer.cuda.CudaTransferEngine`: it reads the engine's pools, options and streams.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache.pool import HostPool
from hicache.transfer.cuda_handle import Deferral, LayerFlags
from hicache.transfer.cuda_kernels import KernelCopier
from hicache.transfer.cuda_resident_path import ResidentPath
from hicache.transfer.cuda_streams import DmaStreams, Stager
from hicache.transfer.cuda_tuning import BACKUP_LANES, STAGE_RAMP, STAGGER_MIN_PAGES, staging_slots
from hicache.transfer.deferred import Pending, SubmitQueue
from hicache.transfer.staged_plan import (
    StagedChunk,
    group_layers,
    plan_group,
    plan_group_lc,
    shift_layers,
    with_slot_base,
)
from hicache.transfer.staged_plan_blocks import plan_group_blocks
from hicache.transfer.stagger import LoadSchedule, StaggerUnit, load_schedule


def _unit_ramps(sched: LoadSchedule) -> list[tuple[StaggerUnit, int]]:
    """A staged load's units in order, each with its chunks' ramp down (only the last unit's shrink)."""
    last = len(sched.units) - 1
    return [(u, STAGE_RAMP if ui == last else 0) for ui, u in enumerate(sched.units)]


@dataclass
class _StagePlans:
    """One staged transfer's host keys (host order) and the chunks planned for them, by group shape
    ``(layers, slot bytes, ramp up, ramp down)``: lc-major chunks planned on first use, block-mirrored
    ones before the index upload, with where their slot keys sit in the uploaded index array."""

    keys: np.ndarray
    memo: dict[tuple[int, int, int, int], list[StagedChunk]] = field(default_factory=dict)
    key_offset: dict[tuple[int, int, int, int], int] = field(default_factory=dict)


class StagedPath(ResidentPath):
    """Submission of staged transfers (a mixin of the engine; :meth:`_staged` is its entry point)."""

    # the engine's, set in its __init__
    host_pool: HostPool
    staging_bytes: int
    backup_slots: int
    stage_lanes: int
    load_lanes: int
    stagger_ways: int
    ce_min_copy_bytes: int
    load_head_layers: int
    head_blocks: int
    submit_ahead: int
    staged_kernel: str
    lc_major: bool
    block_mirror: bool
    kernel: KernelCopier
    device_index: int
    _stagers: dict[bool, Stager]
    _backup_lanes: list[torch.cuda.Stream]
    _load_lanes: list[torch.cuda.Stream]
    _head: tuple[torch.cuda.Stream, KernelCopier] | None
    _deferred: SubmitQueue
    _unjoined: torch.cuda.Event | None

    def _advance(self, pending: Pending, steps: int) -> None:
        raise NotImplementedError  # the engine's

    def _slots(self, to_host: bool) -> tuple[int, int]:
        page = self.layout.num_layers * self.layout.kv_count * self.layout.bytes_per_layer_piece
        return staging_slots(self.staging_bytes, page, to_host, self.backup_slots)

    def _stager(self, to_host: bool) -> Stager:
        st = self._stagers.get(to_host)
        if st is None:
            n_slots, slot = self._slots(to_host)
            max_pages = slot // (self.layout.kv_count * self.layout.bytes_per_layer_piece)
            lanes = min(self.stage_lanes, BACKUP_LANES) if to_host else self.stage_lanes
            st = self._stagers[to_host] = Stager(self.device, n_slots, slot, max_pages, self.layout.num_layers,
                                                  lanes)
        return st

    def _staged(self, dev_idx: np.ndarray, host_idx: np.ndarray, to_host: bool, stream: torch.cuda.Stream,
                deps: list[torch.cuda.Event],
                layer_wise: bool = True) -> tuple[list[torch.cuda.Event], tuple[Any, ...], LayerFlags | None,
                                                  Deferral | None]:
        """Submit a staged transfer (see :mod:`hicache.transfer.staged_plan`); returns per-layer events, the
        buffers to keep alive, the layer flags of a resident load (:meth:`_staged_resident`), and the
        steps of a layer-wise load not submitted yet (:meth:`_staged_load`).

        Load (:meth:`_staged_load`), per chunk: the load stream DMAs host runs into a slot, the slot's
        lane scatters it into L1. Backup, per chunk: the slot's lane gathers L1 into it, the backup stream
        DMAs it out. A slot is refilled only after the previous user of it finished
        (events ``free``). A backup's last event is recorded on ``stream``, so later work on that stream
        is ordered after it; a load's on the stage stream, which the next staged load's scatters follow,
        and any other transfer on ``stream`` waits for it (:meth:`_staged_load`).
        """
        assert self._rt is not None
        L, C = self.layout.num_layers, self.layout.kv_count
        g = self.geometry
        piece = g.piece_bytes
        st = self._stager(to_host)
        sst = st.stream
        for ev in deps:
            sst.wait_event(ev)
        head = 0
        if not to_host and layer_wise and self.staged_kernel != "resident":
            head = self._head_layers(len(dev_idx), st)
        keys = self.host_pool.host_keys(host_idx)  # ascending, as host_idx
        # device pages; after them the host keys, which only the head's gather kernel reads
        both = np.concatenate([dev_idx, keys]) if head else dev_idx
        plans = _StagePlans(keys)
        sched = (None if to_host or self.staged_kernel == "resident"
                 else self._load_schedule(len(dev_idx), st, head, layer_wise))
        groups = self._backup_shapes(st) if to_host else []
        if self.block_mirror:  # block-first, so never the resident kernel (page-first only)
            # block-mirrored chunks carry slot keys the kernels read: plan every group shape now, and
            # upload the keys with the indices
            n = len(dev_idx)
            shapes = groups if sched is None else [(u.n_layers, 0, ramp) for u, ramp in _unit_ramps(sched[0])]
            parts = [both]
            offset = len(both)
            for n_layers, ramp_up, ramp_down in dict.fromkeys(shapes):
                chunks = plan_group_blocks(g.host_base, piece, C, L, self.host_pool.block_pages, host_idx, 0,
                                           n_layers, st.slot_bytes, to_host, ramp_up, ramp_down)
                if chunks is None:
                    continue  # a block of these layers outgrows a slot: lc-major chunks (planned on use)
                shape = (n_layers, st.slot_bytes, ramp_up, ramp_down)
                plans.memo[shape] = chunks
                plans.key_offset[shape] = offset
                parts.append(np.concatenate([ch.slot_keys for ch in chunks if ch.slot_keys is not None]))
                offset += n
            both = np.concatenate(parts)
        idx_host = torch.from_numpy(np.ascontiguousarray(both, dtype=np.int64)).pin_memory()
        with torch.cuda.stream(sst):  # allocated on the stream that uses it
            idx = torch.empty(idx_host.shape, dtype=torch.int64, device=self.device)
        # by a kernel, not a memcpy, which would queue behind bulk DMA in flight (see fetch_indices)
        self.stage_kernel.fetch_indices(sst.cuda_stream, idx_host.data_ptr(), idx.data_ptr(), idx.numel())
        if self.staged_kernel == "resident":
            events, meta, flags = self._staged_resident(keys, to_host, stream, st, idx.data_ptr(), layer_wise)
            return events, (idx_host, idx, *meta), flags, None
        if sched is not None:
            lanes = self.load_lanes if layer_wise else self.stage_lanes
            events, deferral = self._staged_load(plans, sched, stream, st, idx.data_ptr(), head, lanes,
                                                 self.submit_ahead if layer_wise else L)
            return events, (idx_host, idx), None, deferral
        dma = self._dma_streams(stream)
        st.begin()
        k = 0
        l0 = 0
        for ng, ramp_up, _ in groups:
            for ch in self._plan_chunks(plans, l0, ng, st.slot_bytes, True, ramp_up, 0):
                s, base = st.take()
                plan = with_slot_base(ch.plan, base, True)
                lane = st.lane(s)
                prev = st.free[s]
                if prev is not None:
                    lane.wait_event(prev)
                self._launch_stage(lane, plans, idx.data_ptr(), ch, (ng, st.slot_bytes, ramp_up, 0), l0, ng, True,
                                   base, st)
                done = torch.cuda.Event()
                done.record(lane)
                out = dma.stream(k)
                k += 1
                out.wait_event(done)
                self._rt.run(plan, out.cuda_stream)
                freed = torch.cuda.Event()
                freed.record(out)
                st.free[s] = freed
            l0 += ng
        dma.join()
        final = torch.cuda.Event()
        final.record(stream)
        return [final] * L, (idx_host, idx), None, None

    def _dma_streams(self, stream: torch.cuda.Stream, to_host: bool = True) -> DmaStreams:
        """The streams a staged transfer's chunk DMAs go on in turn: ``stream`` and the backup lanes
        (backups) or the load lanes (loads)."""
        return DmaStreams(stream, self._backup_lanes if to_host else self._load_lanes)

    def _backup_shapes(self, st: Stager) -> list[tuple[int, int, int]]:
        """A staged backup's layer groups in order, as (layers, ramp up, ramp down): whole pages where
        one fits a slot (block-mirrored slots: where one bin of the group's layers, a block's worth of
        pages, fits), the first group's chunks ramped up."""
        L, C = self.layout.num_layers, self.layout.kv_count
        unit = self.geometry.piece_bytes
        per_group = 0
        if self.block_mirror:  # else a deep model's block outgrows a slot and mirroring is never used
            b = unit * self.host_pool.block_pages
            per_group = group_layers(L, C, b, L * C * b, st.slot_bytes)
        if per_group == 0:
            per_group = group_layers(L, C, unit, L * C * unit, st.slot_bytes)
        return [(min(per_group, L - l0), STAGE_RAMP if l0 == 0 else 0, 0) for l0 in range(0, L, per_group)]

    def _plan_chunks(self, plans: _StagePlans, layer_begin: int, n_layers: int, slot_bytes: int, to_host: bool,
                     ramp_up: int, ramp_down: int, lo: int = 0, hi: int | None = None) -> list[StagedChunk]:
        """The staged chunks of one layer group for the transfer's pages ``[lo, hi)``: page-major
        (:func:`~hicache.transfer.staged_plan.plan_group`) for a page-first pool, else block-mirrored where
        :meth:`_staged` planned them (:func:`~hicache.transfer.staged_plan_blocks.plan_group_blocks`), else lc-major
        (:func:`~hicache.transfer.staged_plan.plan_group_lc`). Lc-major and block-mirrored chunks (always of
        every page: such loads are never staggered) are planned once per group shape in ``plans`` and
        shifted to each layer group (:func:`~hicache.transfer.staged_plan.shift_layers`)."""
        g, C = self.geometry, self.layout.kv_count
        keys = plans.keys[lo:hi]
        if self.lc_major:
            assert len(keys) == len(plans.keys), "lc-major transfers are not split into parts"
            shape = (n_layers, slot_bytes, ramp_up, ramp_down)
            memo = plans.memo
            base = memo.get(shape)
            if base is None:
                base = memo[shape] = plan_group_lc(g.host_base, g.host_page_stride, g.host_lc_stride,
                                                   g.piece_bytes, C, keys, 0, n_layers, slot_bytes, to_host,
                                                   ramp_up, ramp_down)
            return shift_layers(base, layer_begin, C, g.host_lc_stride, to_host)
        return plan_group(g.host_base, g.host_page_stride, g.piece_bytes, C, keys, layer_begin, n_layers,
                          slot_bytes, to_host, ramp_up, ramp_down)

    def _launch_stage(self, lane: torch.cuda.Stream, plans: _StagePlans, idx_ptr: int, ch: StagedChunk,
                      shape: tuple[int, int, int, int], layer_begin: int, n_layers: int, to_host: bool, base: int,
                      st: Stager, lo: int = 0) -> None:
        """The device-side copy of one staged chunk on ``lane``: L1 pages at ``idx_ptr`` (positions from
        ``lo + ch.i0``), the slot at ``base`` addressed by position (page-first and lc-major slots) or by
        the chunk's slot keys, uploaded after the indices (block-mirrored)."""
        C = self.layout.kv_count
        dev_ptr = idx_ptr + 8 * (lo + ch.i0)
        if ch.slot_keys is not None:
            pos_ptr = idx_ptr + 8 * (plans.key_offset[shape] + ch.i0)
            strides = (self.geometry.piece_bytes, self.host_pool.block_pages * self.geometry.piece_bytes)
            self.stage_kernel.launch_staged(lane.cuda_stream, dev_ptr, pos_ptr, ch.i1 - ch.i0, layer_begin * C,
                                            n_layers * C, to_host, base, strides=strides)
        else:
            self.stage_kernel.launch_staged(lane.cuda_stream, dev_ptr, st.pos.data_ptr(), ch.i1 - ch.i0,
                                            layer_begin * C, n_layers * C, to_host, base, self.lc_major)

    def _staged_load(self, plans: _StagePlans, schedule: tuple[LoadSchedule, list[tuple[int, int]]],
                     stream: torch.cuda.Stream, st: Stager, idx_ptr: int, head: int = 0,
                     lanes: int | None = None, ahead: int = 0,
                     ) -> tuple[list[torch.cuda.Event], Deferral | None]:
        """The load half of :meth:`_staged`: groups of layers, staggered over parts of the page list
        (:func:`~hicache.transfer.stagger.stagger_schedule`), scattered on the stager's first ``lanes``
        lanes (default all). Returns the per-layer events and, when some units are left to submit, their
        deferral.

        ``plans`` holds the host pages and keys (``HostPool.host_keys``) in host order and ``idx_ptr`` the
        matching device pages on the GPU (then, when ``head`` > 0, the host keys; then the slot keys of
        block-mirrored chunks). Each unit of the
        schedule is one part's pages for one group of layers (an lc-major pool: one layer of every page),
        moved slot by slot, each slot scattered on its lane; the stage stream then waits for the unit's
        scatters and records an event, and layer ``i``'s event is that of the unit after which every part
        holds it. The first ``head`` layers are not staged: the gather kernel copies
        them from host memory, one launch and one event per layer, on the head stream, before the DMA of
        the others (:meth:`_head_layers`).

        Units are submitted here only up to those that layer ``ahead`` needs (all of them when ``ahead`` is
        the last layer or beyond); the others are submitted in order by the handle's later calls
        (:class:`Deferral`, :mod:`hicache.transfer.deferred`). Their events exist from the start and are
        recorded as their units are submitted.
        """
        assert self._rt is not None
        rt = self._rt
        L, C = self.layout.num_layers, self.layout.kv_count
        sst = st.stream
        head_events: list[torch.cuda.Event] = []
        if head:
            hs, kern = self._head_copier()
            fetched = torch.cuda.Event()
            fetched.record(sst)  # the transfer's dependencies and the index fetch
            hs.wait_event(fetched)
            n = len(plans.keys)
            for layer in range(head):
                kern.launch(hs.cuda_stream, idx_ptr, idx_ptr + 8 * n, n, layer * C, C, to_host=False)
                ev = torch.cuda.Event()
                ev.record(hs)
                head_events.append(ev)
            # the DMA of the other layers follows: beside it the kernel's reads get little of the link
            stream.wait_event(head_events[-1])
        sched, bounds = schedule
        dma = self._dma_streams(stream, to_host=False)
        st.begin()
        units = _unit_ramps(sched)
        last = len(units) - 1
        landed = [torch.cuda.Event() for _ in units]
        final = torch.cuda.Event()

        def steps() -> Generator[None, None, None]:
            k = 0
            for ui, (u, ramp_down) in enumerate(units):
                lo, hi = bounds[u.way]
                scattered: list[torch.cuda.Event] = []
                shape = (u.n_layers, st.slot_bytes, 0, ramp_down)
                for ch in self._plan_chunks(plans, u.layer_begin, u.n_layers, st.slot_bytes, False, 0, ramp_down,
                                            lo, hi):
                    s, base = st.take()
                    plan = with_slot_base(ch.plan, base, False)
                    out = dma.stream(k)
                    k += 1
                    prev = st.free[s]
                    if prev is not None:
                        out.wait_event(prev)
                    rt.run(plan, out.cuda_stream)
                    done = torch.cuda.Event()
                    done.record(out)
                    lane = st.lane(s, lanes)
                    lane.wait_event(done)
                    self._launch_stage(lane, plans, idx_ptr, ch, shape, u.layer_begin, u.n_layers, False, base, st,
                                       lo)
                    freed = torch.cuda.Event()
                    freed.record(lane)
                    st.free[s] = freed
                    scattered.append(freed)
                for freed in scattered:
                    sst.wait_event(freed)
                landed[ui].record(sst)  # this part's group is in L1
                if ui == last:
                    dma.join()
                    if head_events:
                        sst.wait_event(head_events[-1])
                    # The end of the load is on the stage stream, after every scatter (each follows its DMA)
                    # and the head. ``stream`` does not wait for it: the next staged load's DMAs only need
                    # free slots, and its scatters follow this load's on the stage stream. Waiting here left
                    # the link idle at the end of every load until its last scatter got SMs, up to a whole
                    # GEMM kernel beside compute. Any other transfer on ``stream`` waits for it first
                    # (``_unjoined``, in :meth:`_submit`).
                    final.record(sst)
                    self._unjoined = final
                yield

        events = head_events + [final if sched.ready[layer] == last else landed[sched.ready[layer]]
                                for layer in range(L - head)]
        # steps (units) each layer needs submitted: none for the head's, which are queued above
        need = [0] * head + [sched.ready[layer] + 1 for layer in range(L - head)]
        pending = Pending(steps(), len(units))
        self._deferred.add(pending)  # every earlier step ran (``_submit``): this runs only its own
        self._deferred.advance(pending, need[min(ahead, L - 1)])
        if pending.complete:
            return events, None
        return events, Deferral(self._advance, pending, need, ahead)

    def _head_copier(self) -> tuple[torch.cuda.Stream, KernelCopier]:
        """The stream and gather kernel (``head_blocks`` blocks) of staged loads' head layers, made on first
        use: an engine without a head creates no stream for it."""
        if self._head is None:
            self._head = (torch.cuda.Stream(self.device, priority=-1),
                          KernelCopier(self.geometry, self.device_index, self.head_blocks, self.kernel.threads))
        return self._head

    def _head_layers(self, n: int, st: Stager) -> int:
        """Leading layers of a staged load of ``n`` pages that the gather kernel copies instead
        (``load_head_layers``, at most all layers but one): only for loads of several layer groups,
        whose first layer would otherwise be ready only once the first groups have landed."""
        L, C = self.layout.num_layers, self.layout.kv_count
        per_group = group_layers(L, C, self.geometry.piece_bytes, self.ce_min_copy_bytes, st.slot_bytes)
        if per_group >= L or n == 0 or self.lc_major:  # lc-major loads go layer by layer already
            return 0
        return min(self.load_head_layers, L - 1)

    def _load_schedule(self, n: int, st: Stager, head: int = 0,
                       layer_wise: bool = True) -> tuple[LoadSchedule, list[tuple[int, int]]]:
        """The schedule of a staged load of ``n`` pages (:func:`~hicache.transfer.stagger.load_schedule`)."""
        return load_schedule(self.layout.num_layers, self.layout.kv_count, self.geometry.piece_bytes,
                             self.ce_min_copy_bytes, st.slot_bytes, n, self.stagger_ways, STAGGER_MIN_PAGES, head,
                             layer_wise, self.lc_major)
