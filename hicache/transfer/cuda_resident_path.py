"""The resident staged kernel of the CUDA transfer engine (``staged_kernel: resident``).

One launch per staged transfer stays on ``resident_blocks`` SMs and follows the DMA through 32-bit flags
in device memory, instead of one launch per staging slot (:mod:`hicache.transfer.resident_protocol` numbers the
chunks and states the protocol). A mixin of :class:`~hicache.transfer.cuda.CudaTransferEngine`: it
reads the engine's pools, geometry, kernels and stagers.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from hicache.layout import KVLayout
from hicache.transfer.copy_engine import CopyPlan, CudaRuntime
from hicache.transfer.cuda_driver import StreamWaiter
from hicache.transfer.cuda_handle import LayerFlags
from hicache.transfer.cuda_kernels import STAGED_DESC_WORDS, CopyGeometry, KernelCopier
from hicache.transfer.cuda_streams import Stager
from hicache.transfer.cuda_tuning import SEQ_LIMIT, STAGE_RAMP
from hicache.transfer.resident_protocol import ResidentChunk, number_chunks
from hicache.transfer.staged_plan import group_layers, plan_group, with_slot_base
from hicache.transfer.stagger import LoadSchedule


class ResidentPath:
    """Staged transfers whose device-side copies run as one resident kernel (a mixin of the engine)."""

    # the engine's, set in its __init__
    layout: KVLayout
    device: torch.device
    geometry: CopyGeometry
    stage_kernel: KernelCopier
    resident_blocks: int
    _rt: CudaRuntime | None
    _mem_ops: StreamWaiter
    _mem_context: int

    def _load_schedule(self, n: int, st: Stager, head: int = 0,
                       layer_wise: bool = True) -> tuple[LoadSchedule, list[tuple[int, int]]]:
        raise NotImplementedError  # the staged path's (StagedPath)

    def _setup_mem_ops(self) -> None:
        """Stream memory writes and waits, which the resident staged kernel needs: checked once here."""
        probe_buf = torch.zeros(1, dtype=torch.int32, device=self.device)
        try:
            waiter = StreamWaiter.get()
            torch.cuda.synchronize(self.device)
            probe = torch.cuda.Stream(self.device)
            waiter.write(probe.cuda_stream, probe_buf.data_ptr(), 3, 0)
            waiter.wait_geq(probe.cuda_stream, probe_buf.data_ptr(), 3, 0)
            probe.synchronize()
            context = waiter.current_context()
        except (OSError, RuntimeError) as e:
            raise ValueError(f"staged_kernel='resident': stream memory operations unavailable: {e}") from e
        if int(probe_buf.item()) != 3:
            raise ValueError("staged_kernel='resident': a stream memory write did not land")
        self._mem_ops = waiter
        self._mem_context = context

    def _staged_resident(self, host_idx: np.ndarray, to_host: bool, stream: torch.cuda.Stream, st: Stager,
                         idx_ptr: int,
                         layer_wise: bool = True) -> tuple[list[torch.cuda.Event], tuple[Any, ...], LayerFlags | None]:
        """A staged transfer whose device-side copies run as one resident kernel (``staged_resident``).

        The chunks are planned as by :meth:`_staged_load` (loads: staggered layer groups, or whole pages
        when not ``layer_wise``) or the per-chunk
        backup (whole pages). Chunk ``k`` of the stager's life gets number ``k + 1``. The copy-engine
        stream, per chunk: waits until the slot may be written (a load: the kernel finished the slot's
        previous chunk; a backup: the kernel gathered this chunk), runs the DMA, then writes the chunk's
        number to ``slot_ready``. The kernel waits for ``slot_ready`` (a load: this chunk landed; a backup:
        the slot's previous chunk drained) and publishes ``slot_done`` and the per-layer flags. Neither
        side waits for anything the other has not already been given, so the two never deadlock; the
        kernel needs SMs once per transfer, not once per chunk. The numbering and waits come from
        :func:`hicache.transfer.resident_protocol.number_chunks`, whose protocol
        :func:`~hicache.transfer.resident_protocol.check_protocol` plays out in the tests.
        """
        assert self._rt is not None
        L, C = self.layout.num_layers, self.layout.kv_count
        g = self.geometry
        piece = g.piece_bytes
        n = len(host_idx)
        # (plan, first page position, pages, first slot lc, lcs) per chunk, in order
        chunks: list[tuple[CopyPlan, int, int, int, int]] = []
        layer_chunk = np.zeros(L + (L & 1), dtype=np.int32)  # even length: packs into int64 words
        if to_host:
            per_group = group_layers(L, C, piece, L * C * piece, st.slot_bytes)  # whole pages
            for l0 in range(0, L, per_group):
                ng = min(per_group, L - l0)
                for ch in plan_group(g.host_base, g.host_page_stride, piece, C, host_idx, l0, ng, st.slot_bytes,
                                     True, STAGE_RAMP if l0 == 0 else 0, 0):
                    chunks.append((ch.plan, ch.i0, ch.i1 - ch.i0, l0 * C, ng * C))
        else:
            sched, bounds = self._load_schedule(n, st, 0, layer_wise)
            unit_end = []
            for ui, u in enumerate(sched.units):
                lo, hi = bounds[u.way]
                ramp_down = STAGE_RAMP if ui == len(sched.units) - 1 else 0
                for ch in plan_group(g.host_base, g.host_page_stride, piece, C, host_idx[lo:hi], u.layer_begin,
                                     u.n_layers, st.slot_bytes, False, 0, ramp_down):
                    chunks.append((ch.plan, lo + ch.i0, ch.i1 - ch.i0, u.layer_begin * C, u.n_layers * C))
                unit_end.append(len(chunks) - 1)
            layer_chunk[:L] = [unit_end[sched.ready[layer]] for layer in range(L)]
        if st.chunk_seq + len(chunks) >= SEQ_LIMIT or st.layer_seq + 1 >= SEQ_LIMIT:
            st.restart_flags()
        desc = np.empty((len(chunks), STAGED_DESC_WORDS), dtype=np.int64)
        taken = [st.take() for _ in chunks]
        numbered = number_chunks([s for s, _ in taken], st.last, st.chunk_seq + 1, to_host)
        st.chunk_seq += len(chunks)
        issue: list[tuple[CopyPlan, ResidentChunk]] = []  # (plan into/out of the slot, numbering)
        for k, ((plan, i0, npg, lc0, nlc), (s, base), rc) in enumerate(zip(chunks, taken, numbered, strict=True)):
            desc[k] = (s, rc.kernel_wait, rc.number, base, i0, npg, lc0, nlc)
            issue.append((with_slot_base(plan, base, to_host), rc))
        layer_seq = 0
        if not to_host:
            st.layer_seq += 1
            layer_seq = st.layer_seq
        meta_host = torch.from_numpy(np.concatenate([desc.ravel(), layer_chunk.view(np.int64)])).pin_memory()
        sst = st.stream
        ssh, sh = sst.cuda_stream, stream.cuda_stream
        with torch.cuda.stream(sst):  # allocated on the stream that uses it
            meta = torch.empty(meta_host.shape, dtype=torch.int64, device=self.device)
        self.stage_kernel.fetch_indices(ssh, meta_host.data_ptr(), meta.data_ptr(), meta.numel())
        self.stage_kernel.launch_resident(
            ssh, self.resident_blocks, meta.data_ptr(), len(chunks), idx_ptr, st.pos.data_ptr(),
            st.slot_ready.data_ptr(), st.slot_done.data_ptr(), st.counters.data_ptr(),
            meta.data_ptr() + 8 * desc.size, 0 if to_host else L, st.layer_flags.data_ptr(), layer_seq, to_host)
        kernel_done = torch.cuda.Event()
        kernel_done.record(sst)
        mo, ctx = self._mem_ops, self._mem_context
        ready_ptr, done_ptr = st.slot_ready.data_ptr(), st.slot_done.data_ptr()
        issued = 0
        try:
            for plan, rc in issue:
                if rc.dma_wait:  # a backup: gathered into the slot; a load: the slot's previous chunk scattered
                    mo.wait_geq(sh, done_ptr + 4 * rc.slot, rc.dma_wait, ctx)
                self._rt.run(plan, sh)
                mo.write(sh, ready_ptr + 4 * rc.slot, rc.number, ctx)
                issued += 1
        except BaseException:
            # The kernel is queued and would wait forever for flags this loop never wrote: release it
            # (a failed load's pages then hold stale slot bytes; the caller gets the error, not a handle).
            for _, rc in issue[issued:]:
                with contextlib.suppress(Exception):
                    mo.write(sh, ready_ptr + 4 * rc.slot, rc.number, ctx)
            raise
        stream.wait_event(kernel_done)
        final = torch.cuda.Event()
        final.record(stream)
        flags = None if to_host else LayerFlags(mo, st.layer_flags.data_ptr(), layer_seq, ctx)
        return [final] * L, (meta_host, meta), flags
