"""Staged copy-engine path: small per-layer pieces moved as large DMA copies through a device staging buffer.

With a page-first host pool (``[P, L, C, S, H, D]``) the bytes of one page for a run of consecutive layers
are contiguous on the host, even when each (layer, K/V) piece is only a few KiB. The staged path copies
those contiguous runs with the copy engine (large copies run at the link ceiling and use no SMs) into a
device staging slot, and a short device-to-device gather/scatter kernel (the page-copy kernel of
``kernels/page_copy.cu``, pointed at the staging slot instead of host memory) moves them between the
slot and the layer-first L1 pool. Device memory runs at terabytes per second, so the kernel occupies a
few SMs for a small fraction of the transfer time.

Loads go by layer groups of ``g`` layers (``g`` the fewest layers whose run per page reaches the
copy-engine threshold), so compute can start on the first group while later ones are in flight; a
backup moves whole pages, in host address order. Each direction has a few staging slots used in turn:
the DMA into (or out of) one slot overlaps the kernel on another, and keeps going while a kernel waits
for SMs.

Within a transfer the first chunks of a backup and the last chunks of a load are smaller
(:func:`chunk_sizes`), so less of the gather before the first DMA, or of the scatter after the last
one, is left uncovered.

Every group costs one copy per page, whatever its size: smaller groups at the ends of a load (to start
compute sooner and finish it later less) were measured on an H100 to slow a 32-layer load of 4 KiB
pieces by 40% (groups 2, 4, 8, 8, 4, 4, 2 against 8, 8, 8, 8), more than they gained in overlap.

Loads of several groups are staggered (:mod:`hicache.transfer.stagger`).

Host pools that are not page-first (layer-first, and block-first: layer-first within blocks of consecutive
pages) are staged *lc-major* instead (:func:`plan_group_lc`): a chunk's slot holds ``[layers x K/V][pages]
[piece]``, and each (layer, K/V) of a run of pages that are consecutive in host memory is one copy. Runs,
not layer groups, then make the copies large, so loads go one layer at a time, never staggered: layer
``i`` is ready once ``i + 1`` layers' worth of the load has landed.

Block-first pools can instead stage slots that mirror their blocks (:mod:`hicache.transfer.staged_plan_blocks`).

Planning is pure NumPy (:func:`plan_group`, :func:`plan_group_lc`) and needs no GPU.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hicache.transfer.copy_engine import CopyPlan


class StagedChunk(NamedTuple):
    """Pages ``[i0, i1)`` of a transfer (positions in its page list) for one layer group.

    ``plan`` copies between host memory and the staging slot; staging addresses are offsets from the slot
    base (add the base before issuing). Where page ``i`` sits in the slot is the planner's: position
    ``i - i0`` (page-major and lc-major slots), or its slot key (``slot_keys``, block-mirrored slots).
    """

    i0: int
    i1: int
    plan: CopyPlan
    # block-mirrored chunks (hicache.transfer.staged_plan_blocks): each page's key in the slot, which is a
    # row of block-shaped bins; None for the other planners, whose slot positions are ``i - i0``
    slot_keys: np.ndarray | None = None


def group_layers(num_layers: int, kv_count: int, piece_bytes: int, min_run_bytes: int, slot_bytes: int) -> int:
    """Layers per group: the fewest whose per-page run (``g * kv_count * piece_bytes``) reaches
    ``min_run_bytes``, at most ``num_layers``, and small enough that one page's run fits a slot (0 when
    not even one layer does)."""
    per_layer = kv_count * piece_bytes
    if per_layer > slot_bytes:
        return 0
    g = min(num_layers, max(1, math.ceil(min_run_bytes / per_layer)))
    return min(g, slot_bytes // per_layer)


def chunk_sizes(n: int, per_chunk: int, ramp_up: int = 0, ramp_down: int = 0) -> list[int]:
    """Pages per chunk for ``n`` pages, at most ``per_chunk`` each, summing to ``n``.

    ``ramp_up`` chunks at the start grow geometrically to ``per_chunk`` (``per_chunk >> ramp_up``, ...,
    ``per_chunk >> 1``, at least one page each); ``ramp_down`` chunks at the end shrink the same way.
    The first chunk of a staged backup waits for a device-side gather before any DMA starts, and the last
    chunk of a load for a scatter after the last DMA: small chunks there leave less of either exposed.
    """
    if per_chunk < 1:
        raise ValueError(f"per_chunk: must be >= 1, got {per_chunk}")
    sizes: list[int] = []
    rem = n
    for shift in range(ramp_up, 0, -1):
        if rem <= 0:
            break
        t = min(max(1, per_chunk >> shift), rem)
        sizes.append(t)
        rem -= t
    tail = [max(1, per_chunk >> shift) for shift in range(1, ramp_down + 1)]
    tail_total = sum(tail)
    while rem > tail_total:
        t = min(per_chunk, rem - tail_total)
        sizes.append(t)
        rem -= t
    for t in tail:
        if rem <= 0:
            break
        t = min(t, rem)
        sizes.append(t)
        rem -= t
    return sizes


def plan_group(host_base: int, host_page_stride: int, piece_bytes: int, kv_count: int, host_idx: np.ndarray,
               layer_begin: int, n_layers: int, slot_bytes: int, to_host: bool, ramp_up: int = 0,
               ramp_down: int = 0) -> list[StagedChunk]:
    """Chunks of the layer group ``[layer_begin, layer_begin + n_layers)`` for host pages ``host_idx``.

    The run of page ``h`` is ``host_base + h * host_page_stride + layer_begin * kv_count * piece_bytes``,
    ``n_layers * kv_count * piece_bytes`` bytes. Each chunk holds as many pages as fit ``slot_bytes``
    (fewer in the ramps of :func:`chunk_sizes`). When a run is a whole host page, runs of consecutive
    host pages at consecutive positions merge into one copy. ``to_host`` makes the slot the source and
    the host the destination.
    """
    host_idx = np.asarray(host_idx, dtype=np.int64)
    run = n_layers * kv_count * piece_bytes
    if run <= 0 or run > slot_bytes:
        raise ValueError(f"a run of {run} bytes does not fit a staging slot of {slot_bytes} bytes")
    n = len(host_idx)
    sizes = chunk_sizes(n, slot_bytes // run, ramp_up, ramp_down)
    chunk_i0 = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=chunk_i0[1:])
    # One pass over the whole transfer (a submission plans thousands of pages): a copy starts at every
    # chunk start and, when runs are whole host pages, wherever the next page is not the next host page.
    brk = np.ones(n, dtype=bool)
    if run == host_page_stride and n > 1:
        np.not_equal(np.diff(host_idx), 1, out=brk[1:])
        brk[chunk_i0] = True
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n))
    owner = np.searchsorted(chunk_i0, starts, side="right") - 1  # chunk of each copy
    host_addr = (host_base + host_idx[starts] * host_page_stride + layer_begin * kv_count * piece_bytes
                 ).astype(np.uint64)
    slot_off = ((starts - chunk_i0[owner]) * run).astype(np.uint64)
    size = (lengths * run).astype(np.uint64)
    edges = np.searchsorted(starts, np.append(chunk_i0, n))
    chunks = []
    for k, i0 in enumerate(chunk_i0.tolist()):
        lo, hi = int(edges[k]), int(edges[k + 1])
        plan = (CopyPlan(host_addr[lo:hi], slot_off[lo:hi], size[lo:hi]) if to_host
                else CopyPlan(slot_off[lo:hi], host_addr[lo:hi], size[lo:hi]))
        chunks.append(StagedChunk(i0, i0 + sizes[k], plan))
    return chunks


def plan_group_lc(host_base: int, host_page_stride: int, host_lc_stride: int, piece_bytes: int, kv_count: int,
                  host_keys: np.ndarray, layer_begin: int, n_layers: int, slot_bytes: int, to_host: bool,
                  ramp_up: int = 0, ramp_down: int = 0) -> list[StagedChunk]:
    """Lc-major chunks of the layer group ``[layer_begin, layer_begin + n_layers)`` for host pages whose
    keys (``HostPool.host_keys``, ascending) are ``host_keys``.

    The piece of key ``k``, slot ``lc`` (``layer * kv_count + c``) is at ``host_base + k *
    host_page_stride + lc * host_lc_stride``; ``host_page_stride`` must be the piece size, so pages with
    consecutive keys are contiguous. A chunk of pages ``[i0, i1)`` (``m`` pages) lays the slot out as
    ``[n_lc][m][piece]``: position ``i``'s piece of slot ``lc`` sits at offset ``((lc - lc_begin) * m +
    i - i0) * piece``. Each (lc, run of consecutive keys within the chunk) is one copy; copies go chunk by
    chunk, lc by lc, run by run (ordering a backup's copies by host address instead, block by block,
    was measured no faster on an H200). Chunk sizes as :func:`chunk_sizes`, at most as many pages as fit
    ``slot_bytes``.
    """
    if host_page_stride != piece_bytes:
        raise ValueError(f"plan_group_lc: pages {host_page_stride} bytes apart are not piece-contiguous "
                         f"({piece_bytes}-byte pieces)")
    keys = np.asarray(host_keys, dtype=np.int64)
    n_lc = n_layers * kv_count
    per_page = n_lc * piece_bytes
    if n_lc <= 0 or per_page > slot_bytes:
        raise ValueError(f"{n_layers} layers of a page ({per_page} bytes) do not fit a staging slot of "
                         f"{slot_bytes} bytes")
    n = len(keys)
    sizes = chunk_sizes(n, slot_bytes // per_page, ramp_up, ramp_down)
    if n == 0:
        return []
    # runs of consecutive keys, cut at chunk starts
    first = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=first[1:])
    brk = np.ones(n, dtype=bool)
    np.not_equal(np.diff(keys), 1, out=brk[1:])
    brk[first] = True
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n))
    run_chunk = np.searchsorted(first, starts, side="right") - 1
    run_lo = np.searchsorted(run_chunk, np.arange(len(sizes) + 1))  # each chunk's first run
    n_runs = np.diff(run_lo)
    # copies chunk by chunk, lc by lc, run by run: copy p of chunk k is (lc p // R_k, run p % R_k)
    per_chunk = n_lc * n_runs
    copy_lo = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(per_chunk, out=copy_lo[1:])
    chunk = np.repeat(np.arange(len(sizes), dtype=np.int64), per_chunk)
    p = np.arange(int(copy_lo[-1]), dtype=np.int64) - copy_lo[chunk]
    lc, run = np.divmod(p, n_runs[chunk])
    run += run_lo[chunk]
    host = (host_base + keys[starts[run]] * host_page_stride
            + (layer_begin * kv_count + lc) * host_lc_stride).astype(np.uint64)
    slot = ((lc * np.asarray(sizes, dtype=np.int64)[chunk] + starts[run] - first[chunk]) * piece_bytes
            ).astype(np.uint64)
    size = (lengths[run] * piece_bytes).astype(np.uint64)
    chunks = []
    for k, m in enumerate(sizes):
        lo, hi = int(copy_lo[k]), int(copy_lo[k + 1])
        plan = (CopyPlan(host[lo:hi], slot[lo:hi], size[lo:hi]) if to_host
                else CopyPlan(slot[lo:hi], host[lo:hi], size[lo:hi]))
        i0 = int(first[k])
        chunks.append(StagedChunk(i0, i0 + m, plan))
    return chunks


def shift_layers(chunks: list[StagedChunk], layers: int, kv_count: int, host_lc_stride: int,
                 to_host: bool) -> list[StagedChunk]:
    """Lc-major or block-mirrored ``chunks`` of one layer group moved ``layers`` layers on: host addresses are linear in
    the layer, so the chunks of ``[b + layers, ...)`` are those of ``[b, ...)`` with every host address
    ``layers * kv_count * host_lc_stride`` bytes further (slot offsets unchanged). A layer-wise load
    plans its page runs once and shifts them for every layer."""
    delta = np.uint64(layers * kv_count * host_lc_stride)
    out = []
    for ch in chunks:
        p = ch.plan
        plan = CopyPlan(p.dst + delta, p.src, p.size) if to_host else CopyPlan(p.dst, p.src + delta, p.size)
        out.append(ch._replace(plan=plan))
    return out


def with_slot_base(plan: CopyPlan, slot_base: int, to_host: bool) -> CopyPlan:
    """``plan`` with its staging offsets turned into device addresses."""
    base = np.uint64(slot_base)
    if to_host:
        return CopyPlan(plan.dst, plan.src + base, plan.size)
    return CopyPlan(plan.dst + base, plan.src, plan.size)
