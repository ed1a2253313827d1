"""Defaults of the CUDA transfer engine's staged path and DMA streams, each with what it was measured to do.

The figures in the comments come from an H200 on PCIe Gen5 (the benchmarks in ``benchmarks/`` and their
outputs in ``benchmarks/results/h200/``). :func:`staging_slots` turns the staging budget into slots;
:func:`default_stage_lanes` picks the lanes from the hardware queues the process has.
"""

from __future__ import annotations

import os

# A staged load's device-side scatter runs only when compute frees SMs, which a GEMM's persistent kernels
# hold until they end (about 1.4 ms for a bf16 8192^3 GEMM on an H200); meanwhile the DMA fills free
# slots. Slots covering ~5 ms of the link keep it busy (staged 4 KiB loads beside that GEMM, four runs
# each: 0.76-0.91 of a contiguous copy with 64 MiB, 0.79-0.99 with 256 MiB, later runs down to 0.76; alone,
# the same rate). staged_kernel="resident" waits for SMs once per transfer instead (0.87-0.92).
DEFAULT_STAGING_BYTES = 256 << 20
STAGE_SLOTS = 4  # fewest staging slots per direction: DMA keeps going while a slot waits for SMs to free it
# Streams ("lanes") for the per-chunk device-side copies of one direction; slot s uses lane s % lanes.
# On one stream each scatter is launched only once the previous one ended, and beside a GEMM whose
# kernels take every SM that is one scatter per GEMM kernel (~1.4 ms): the DMA then idled a third of the
# time waiting for slots (H200 per-chunk timeline, staged 4 KiB loads beside a bf16 8192^3 GEMM). With a
# lane per slot every landed slot's scatter is already queued when SMs free up. But streams share the
# device's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), and with too few, compute ended
# behind the transfers (H200, 32-layer overlap with 8 lanes: 1.5-2.0x of max(load, compute), against
# 1.06-1.17x on one; 24 GEMMs beside staged loads ended at 75 ms instead of 34; whether the device held
# the compute or the host was held in a submission call, those runs did not record). So by default
# (``stage_lanes=None``) the lanes are used only where CUDA_DEVICE_MAX_CONNECTIONS is at least
# WIDE_QUEUES (``hicache`` sets 32 at start, before CUDA starts), else one stream does all.
STAGE_LANES = 8
WIDE_QUEUES = 32
# Backups gather on at most this many of those lanes: more gathers at once load HBM while the DMA reads
# it (H200 per-chunk timeline, staged 4 KiB backups, 16 slots: alone 48.9 GB/s on 8 lanes, 49.5 on 4,
# 50.5 on 2; beside bf16 8192^3 GEMMs 46.8, 47.5 and 44.7).
BACKUP_LANES = 4
# Backups with lanes: slots to cover a GEMM kernel's length of DMA (~1.4 ms, ~75 MB), so the gathers of a
# few slots at once, when SMs free up, keep the link busy. Without lanes more slots gain nothing (H200,
# staged 4 KiB backups beside bf16 8192^3 GEMMs: 0.98-0.99x the rate of 4 slots with 8 or 16).
WIDE_BACKUP_SLOTS = 16


def hardware_queues() -> int:
    """The device's hardware work queues streams are spread over (``CUDA_DEVICE_MAX_CONNECTIONS``, read
    from the environment: it takes effect only if set before CUDA starts in this process)."""
    try:
        return max(1, int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")))
    except ValueError:
        return 8


def default_stage_lanes() -> int:
    """``STAGE_LANES`` where the hardware queues are at least ``WIDE_QUEUES``, else 1."""
    return STAGE_LANES if hardware_queues() >= WIDE_QUEUES else 1


# A load's slots are at most this large (or one whole page, if larger), so staging_bytes beyond
# STAGE_SLOTS of them buys more slots: a staggered load's chunks are often smaller than a slot, and each
# takes one.
LOAD_SLOT_BYTES = 16 << 20
# A backup's slots are at most this large: the slot a DMA reads
# was then written recently enough to still be in L2 (50 MB on an H200), and a device-to-host DMA reading
# HBM while gathers load it runs well below the link (4 KiB pieces, H200: 16 MiB slots 0.92 of the link,
# 8 MiB 0.95, 4 MiB 0.97 at twice the host submission time).
BACKUP_SLOT_BYTES = 8 << 20
# Copy-engine backups are split over this many streams: a device-to-host copy reads HBM, and next to
# compute that loads HBM each copy's start waits longer; parallel streams hide that (H200, 64 KiB pieces
# beside a bf16 GEMM, of a contiguous copy: 0.86-0.91 on one stream (mean 0.89 over five runs), 0.90-0.93
# on two, 0.91-0.97 on four (mean 0.95); loads, whose writes to HBM are posted, gain nothing).
DEFAULT_BACKUP_STREAMS = 4
# A staged load's chunk DMAs alternate over this many streams. More than one keeps the host from blocking
# in one case: 8 staggered loads of 16 KiB pieces (4,096 copies each) queued behind busy compute filled one
# stream's queue, and the host was held 358 ms in one cudaMemcpyBatchAsync call; over 2 or 4 streams it was
# not (H200). But a second stream made the first layer of a 32-layer load ready late: its DMAs started
# only once the first stream's were mostly done, and a load's layer needs both. Staged loads of 4 KiB
# pieces, compute about as long as the load (H200, per-layer bf16 4096^3 GEMMs on the default stream):
# layer 0 ready at 7.7 ms on 2 streams against 2.0 on one, everything done at 19.8 ms against 15.0
# (16 KiB pieces: 0.65 against 11.0 ms, 14.0 against 22.8 ms). The layer-wise overlap is what loads are
# for, so one stream is the default; a caller queueing many loads far ahead of the device can raise it.
DEFAULT_LOAD_STREAMS = 1
# Leading layers of a staged load (of several layer groups) that the gather kernel copies straight from
# host memory, one launch and one event per layer, before the DMA of the others starts: a staggered load's
# first layer is ready only once about 5 / 32 of a 32-layer load has landed. With 4 layers on 16 blocks,
# layer 0 was ready at 0.41-0.44 ms instead of 2.0, but the DMA then starts later and the head's launches
# wait for SMs behind compute (H200, 32-layer overlap of 4 KiB pieces, x max(load, compute) at compute/load
# about 0.45 / 0.9 / 1.8: 1.11-1.12 / 1.24 / 1.11-1.12 against 1.06 / 1.19 / 1.15 by default). It pays
# only where compute is well over the load, so it is off. Beside the DMA instead of before it, the
# kernel's reads got little of the link (2 blocks: layer 0 at 1.96 ms; 4 blocks: 1.07 ms).
DEFAULT_LOAD_HEAD_LAYERS = 0
DEFAULT_HEAD_BLOCKS = 16  # the head's kernel runs before the DMA, and mostly before compute starts
FAN_MIN_COPIES = 16  # fewest copies in one part of a fanned-out backup
STAGE_RAMP = 4  # smaller chunks at a backup's start and a load's end: 1/16, 1/8, 1/4, 1/2 of a slot
STAGGER_MIN_PAGES = 32  # pages per part, at least, before a staged load is staggered (stagger.stagger_schedule)
SEQ_LIMIT = 1 << 31  # flag values stay below this; counters restart from zeroed flags when they reach it


def staging_slots(staging_bytes: int, page_bytes: int, to_host: bool,
                  backup_slots: int = STAGE_SLOTS) -> tuple[int, int]:
    """(number, bytes) of one direction's staging slots.

    Loads: ``staging_bytes`` split into slots of at most ``LOAD_SLOT_BYTES``, or of one whole page where
    that is larger, and at least ``STAGE_SLOTS`` of them. Backups: ``backup_slots`` (at least
    ``STAGE_SLOTS``) slots of at most ``BACKUP_SLOT_BYTES`` (or a whole page), small enough to stay in
    L2. Never more than ``staging_bytes`` in all.
    """
    if to_host:
        n = max(STAGE_SLOTS, backup_slots)
        return n, min(staging_bytes // n, max(BACKUP_SLOT_BYTES, page_bytes))
    most = staging_bytes // STAGE_SLOTS
    slot = min(most, max(LOAD_SLOT_BYTES, page_bytes))
    return max(STAGE_SLOTS, staging_bytes // slot), slot


# A layer-wise staged load submits in ``load`` only the units its first layers need, up to layer
# DEFAULT_SUBMIT_AHEAD; each ``wait_layer(i)`` then submits those up to layer i + DEFAULT_SUBMIT_AHEAD
# (hicache.transfer.deferred). Submitting a 600 MB load of 4 KiB pieces takes the host about 9 ms, during
# which a loop that calls ``load`` and then computes could not queue layer 0 (H200, block-first L2,
# 32-layer overlap: 1.38 / 1.82 / 1.45x of max(load, compute) submitted whole). Deferred, the same loop,
# nothing holding the compute stream, ended at 1.25 / 1.38 / 1.21x (block-first 4 KiB), 1.24 / 1.71 /
# 1.30x and 1.08 / 1.13 / 1.17x (page-first 4 and 16 KiB), against 1.51 / 2.02 / 1.55, 1.40 / 1.80 / 1.57
# and 1.30 / 1.70 / 1.59x submitted whole in that run; 0 and 1 layers ahead measured alike within the
# noise (docs/transfers.md). A few layers ahead keep the DMA queued beyond the layer compute waits for
# where the caller's waits come late.
DEFAULT_SUBMIT_AHEAD = 4
