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

With groups of ``g`` layers every layer of a group is ready at once, so compute running as fast as the
load waits up to ``g`` layers behind it. :func:`stagger_schedule` splits the pages into ``ways`` parts
whose group boundaries are offset from each other (part ``k`` starts with a group of ``k * g // ways``
layers) and interleaves their groups by last layer: a layer is ready once every part holds it, which
now happens about every ``g / ways`` layers instead of every ``g``, for about one more copy per page and
part. Fluid model, 32 layers, compute as fast as the load: groups of 8 finish at 1.25x the load time,
staggered 4 ways 1.16x; groups of 4, 1.125x and 1.08x. The start sets that bound: layer 0 is ready
only once every part's first group (``g``, then ``k * g // ways`` layers for part ``k``) has landed,
``g * (ways + 1) / (2 * ways)`` layers' worth of the load (5 of 32 for ``g = 8``, ``ways = 4``), and
compute never catches that up. Measured on an H200 (32 layers, 4 KiB pieces,
compute about as long as the load): 1.25x -> 1.15x of max(load, compute), for a load 12% slower (the
extra copies, and the short runs at each part's ends). Loads of a single group (whole pages) are not
staggered: their runs of consecutive host pages merge into single copies.

Host pools that are not page-first (layer-first, and block-first: layer-first within blocks of consecutive
pages) are staged *lc-major* instead (:func:`plan_group_lc`): a chunk's slot holds ``[layers x K/V][pages]
[piece]``, and each (layer, K/V) of a run of pages that are consecutive in host memory is one copy. Runs,
not layer groups, then make the copies large, so loads go one layer at a time, never staggered: layer
``i`` is ready once ``i + 1`` layers' worth of the load has landed.

Planning is pure NumPy (:func:`plan_group`, :func:`plan_group_lc`) and needs no GPU.
"""

from __future__ import annotations

import itertools
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
    # block-mirrored chunks (:func:`plan_group_blocks`): each page's key in the slot, which is a row of
    # block-shaped bins; None for the other planners, whose slot positions are ``i - i0``
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


def plan_group_blocks(host_base: int, piece_bytes: int, kv_count: int, num_layers: int, block_pages: int,
                      host_pages: np.ndarray, layer_begin: int, n_layers: int, slot_bytes: int, to_host: bool,
                      ramp_up: int = 0, ramp_down: int = 0) -> list[StagedChunk] | None:
    """Block-mirrored chunks of the layer group ``[layer_begin, layer_begin + n_layers)`` for the pages
    ``host_pages`` (ascending) of a block-first pool (``[P / B, L, C, B, piece]``, ``B = block_pages``,
    base ``host_base``); None when one block's ``n_layers`` do not fit ``slot_bytes``.

    A slot is a row of *bins*, each laid out like one host block of the group: ``[n_lc][B][piece]``
    (``n_lc = n_layers * kv_count``), bin ``b`` at slot offset ``b * n_lc * B * piece``; a chunk holds up
    to ``slot_bytes // (n_lc * B * piece)`` bins (fewer in the ramps of :func:`chunk_sizes`, which count
    bins here). A page sits at slot key ``b * n_lc * B + k`` (``slot_keys``; the kernel addresses the
    slot with page stride ``piece`` and (layer, K/V) stride ``B * piece``):

    * a block the transfer covers whole takes a bin of its own, ``k = h % B``: its ``n_lc`` rows are
      contiguous on both sides, so it is ONE copy (whole pages of consecutive such blocks merge into one),
      where :func:`plan_group_lc` makes ``n_lc`` of them;
    * the runs of consecutive pages of partly covered blocks are packed in order, next-fit, into the
      bins between two whole blocks (a run that does not fit the rest of a bin opens the next), so sparse
      pages fill slots instead of leaving a hole for every page a block lacks; each run is one copy per
      (layer, K/V).

    Pages keep their order: bins, and so chunks, cover consecutive positions of ``host_pages``.
    """
    h = np.asarray(host_pages, dtype=np.int64)
    B, C = block_pages, kv_count
    n_lc = n_layers * C
    block_bytes = n_lc * B * piece_bytes
    if n_lc <= 0 or block_bytes > slot_bytes:
        return None
    n = len(h)
    if n == 0:
        return []
    row = B * piece_bytes  # one (layer, K/V) of a block
    host_block = num_layers * C * row  # host bytes per block
    lc0 = layer_begin * C
    blk, off = h // B, h % B
    # blocks, and runs of consecutive pages within a block
    new_blk = np.ones(n, dtype=bool)
    np.not_equal(np.diff(blk), 0, out=new_blk[1:])
    blk_start = np.flatnonzero(new_blk)  # position of each block's first page
    page_blk = np.cumsum(new_blk) - 1  # block rank of each page
    brk = new_blk.copy()
    brk[1:] |= np.diff(h) != 1
    run_start = np.flatnonzero(brk)
    run_len = np.diff(np.append(run_start, n))
    whole = run_len[np.searchsorted(run_start, blk_start)] == B  # one run of B pages fills its block
    # items in page order: each whole block, and each segment of partial blocks between whole ones
    seg_head = ~whole & np.append(True, whole[:-1])  # a partial block after a whole one (or first)
    item_head = whole | seg_head
    item_of_blk = np.cumsum(item_head) - 1
    # the runs of partial blocks, packed next-fit into the bins of their segment: a run goes whole into
    # the current bin, or opens the next one (no run is split, so no copy is added)
    part_run = np.flatnonzero(~whole[page_blk[run_start]])
    rs, rl = run_start[part_run], run_len[part_run]
    run_item = item_of_blk[page_blk[rs]]
    cum = np.zeros(len(rs) + 1, dtype=np.int64)
    np.cumsum(rl, out=cum[1:])
    seg_end = np.searchsorted(run_item, run_item, side="right")  # first run of the next item
    # where a bin opened at run i ends: the most runs from i that fit B, never past the segment
    nxt = np.minimum(np.searchsorted(cum, cum[:-1] + B, side="right") - 1, seg_end).tolist()
    starts = []  # the run each bin opens with (next-fit is sequential: follow the chain)
    i = 0
    while i < len(nxt):
        starts.append(i)
        i = nxt[i]
    first_run = np.array(starts, dtype=np.int64)
    run_bin_g = np.repeat(np.arange(len(starts), dtype=np.int64), np.diff(np.append(first_run, len(rs))))
    run_k0 = cum[:-1] - cum[first_run[run_bin_g]]  # key of the run's first page in its bin
    seg_first = np.searchsorted(run_item, run_item)  # first run of the run's segment
    run_bin = run_bin_g - run_bin_g[seg_first]  # bin within its segment
    item_bins = np.ones(int(item_of_blk[-1]) + 1, dtype=np.int64)  # whole blocks: one bin
    if len(rs):
        np.maximum.at(item_bins, run_item, run_bin + 1)
    item_bin0 = np.zeros(len(item_bins), dtype=np.int64)
    np.cumsum(item_bins[:-1], out=item_bin0[1:])
    n_bins = int(item_bin0[-1] + item_bins[-1])
    page_item = item_of_blk[page_blk]
    page_bin = item_bin0[page_item].copy()
    page_key = off.copy()
    if len(rs):  # pages of partial runs: their run's bin and key, in order
        run_of_page = np.repeat(np.arange(len(rs)), rl)
        pp = np.flatnonzero(~whole[page_blk])
        page_bin[pp] += run_bin[run_of_page]
        page_key[pp] = run_k0[run_of_page] + (pp - rs[run_of_page])
    # chunks of bins, and each bin's rank in its chunk
    sizes = np.array(chunk_sizes(n_bins, slot_bytes // block_bytes, ramp_up, ramp_down), dtype=np.int64)
    first_bin = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=first_bin[1:])
    bin_chunk = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    bin_j = np.arange(n_bins, dtype=np.int64) - first_bin[bin_chunk]
    slot_keys = bin_j[page_bin] * (n_lc * B) + page_key
    # whole blocks: one copy each, merged with the next where both sides continue (whole pages only)
    wb = np.flatnonzero(whole)
    wbin = page_bin[blk_start[wb]]
    cont = np.zeros(len(wb), dtype=bool)
    if n_lc == num_layers * C and len(wb) > 1:
        cont[1:] = ((np.diff(wbin) == 1) & (np.diff(blk[blk_start[wb]]) == 1)
                    & (np.diff(bin_chunk[wbin]) == 0))
    ws = np.flatnonzero(~cont)
    wlen = np.diff(np.append(ws, len(wb)))
    wb, wbin = wb[ws], wbin[ws]
    w_host = host_base + blk[blk_start[wb]] * host_block + lc0 * row
    w_slot = bin_j[wbin] * block_bytes
    w_size = wlen * block_bytes
    w_chunk = bin_chunk[wbin]
    # partial blocks: one copy per (layer, K/V, run)
    lc = np.arange(n_lc, dtype=np.int64)[:, None] * row
    p_host = (host_base + blk[rs] * host_block + (lc0 * B + off[rs]) * piece_bytes)[None, :] + lc
    p_slot = ((bin_j[page_bin[rs]] * (n_lc * B) + page_key[rs]) * piece_bytes)[None, :] + lc
    p_size = np.broadcast_to(rl * piece_bytes, p_host.shape)
    p_chunk = np.broadcast_to(bin_chunk[page_bin[rs]], p_host.shape)
    host_u = np.concatenate([w_host, p_host.reshape(-1)]).astype(np.uint64)
    slot_u = np.concatenate([w_slot, p_slot.reshape(-1)]).astype(np.uint64)
    size_u = np.concatenate([w_size, p_size.reshape(-1)]).astype(np.uint64)
    owner = np.concatenate([w_chunk, p_chunk.reshape(-1)])
    order = np.lexsort((host_u, owner))  # chunk by chunk, in host order within each
    host_u, slot_u, size_u, owner = host_u[order], slot_u[order], size_u[order], owner[order]
    edges = np.searchsorted(owner, np.arange(len(sizes) + 1))
    page_edges = np.searchsorted(bin_chunk[page_bin], np.arange(len(sizes) + 1))
    chunks = []
    for c in range(len(sizes)):
        lo, hi = int(edges[c]), int(edges[c + 1])
        i0, i1 = int(page_edges[c]), int(page_edges[c + 1])
        plan = (CopyPlan(host_u[lo:hi], slot_u[lo:hi], size_u[lo:hi]) if to_host
                else CopyPlan(slot_u[lo:hi], host_u[lo:hi], size_u[lo:hi]))
        chunks.append(StagedChunk(i0, i1, plan, slot_keys[i0:i1]))
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


class StaggerUnit(NamedTuple):
    """Layers ``[layer_begin, layer_begin + n_layers)`` of the pages of part ``way``."""

    way: int
    layer_begin: int
    n_layers: int


class LoadSchedule(NamedTuple):
    """The order of a staggered load: ``units`` in submission order, and for each layer the index of
    the unit after which every part holds that layer (``ready[layer]``, non-decreasing)."""

    units: list[StaggerUnit]
    ready: list[int]


def way_bounds(n: int, ways: int) -> list[tuple[int, int]]:
    """Positions ``[lo, hi)`` of each part of ``n`` pages split into ``ways`` nearly equal runs."""
    if ways < 1:
        raise ValueError(f"ways: must be >= 1, got {ways}")
    edges = [(n * k) // ways for k in range(ways + 1)]
    return [(edges[k], edges[k + 1]) for k in range(ways)]


def stagger_schedule(num_layers: int, per_group: int, ways: int) -> LoadSchedule:
    """Groups of at most ``per_group`` layers for each of ``ways`` parts, part ``k``'s boundaries offset
    by ``k * per_group // ways`` layers, interleaved by last layer (then part).

    Every (part, layer) is in exactly one unit; units of one part go in layer order; ``ways == 1`` is
    the plain grouping ``[0, g), [g, 2g), ...``.
    """
    if num_layers < 1 or per_group < 1 or ways < 1:
        raise ValueError(f"stagger_schedule: need num_layers, per_group, ways >= 1, got "
                         f"{num_layers}, {per_group}, {ways}")
    per_way: list[list[StaggerUnit]] = []
    for k in range(ways):
        off = (k * per_group) // ways
        cuts = sorted({0, num_layers, *range(off if off else per_group, num_layers, per_group)})
        per_way.append([StaggerUnit(k, a, b - a) for a, b in itertools.pairwise(cuts)])
    units = sorted((u for us in per_way for u in us), key=lambda u: (u.layer_begin + u.n_layers, u.way))
    last = [[0] * num_layers for _ in range(ways)]
    for i, u in enumerate(units):
        for layer in range(u.layer_begin, u.layer_begin + u.n_layers):
            last[u.way][layer] = i
    ready = [max(last[k][layer] for k in range(ways)) for layer in range(num_layers)]
    return LoadSchedule(units, ready)


def load_schedule(num_layers: int, kv_count: int, piece_bytes: int, min_run_bytes: int, slot_bytes: int,
                  n_pages: int, stagger_ways: int, min_part_pages: int, head: int = 0,
                  layer_wise: bool = True, lc_major: bool = False) -> tuple[LoadSchedule, list[tuple[int, int]]]:
    """The schedule of a staged load of ``n_pages`` pages and each part's page range (:func:`way_bounds`).

    The layers from ``head`` on go by groups of :func:`group_layers` (runs of at least
    ``min_run_bytes``), staggered over up to ``stagger_ways`` parts of at least ``min_part_pages`` pages
    each; units and ``ready`` are numbered from layer ``head`` (the first ``head`` layers move another
    way), and ``layer_begin`` is absolute. One group (whole pages) is never staggered: every layer is
    ready at once anyway, and whole-page runs of consecutive host pages merge into single copies, which
    staggering would split. Not ``layer_wise`` (the caller waits for the whole load): groups as large as a
    slot allows, whole pages where one fits, not staggered.

    ``lc_major`` (:func:`plan_group_lc`: runs of pages, not layer groups, make the copies large): one
    layer per group when ``layer_wise``, else as many layers as let all ``n_pages`` share a slot (at
    least one); never staggered.
    """
    n_layers = num_layers - head
    per_layer = kv_count * piece_bytes
    if lc_major:
        per_group = 0 if per_layer > slot_bytes else (
            1 if layer_wise else max(1, min(n_layers, slot_bytes // (per_layer * max(n_pages, 1)))))
    else:
        min_run = min_run_bytes if layer_wise else n_layers * per_layer
        per_group = group_layers(n_layers, kv_count, piece_bytes, min_run, slot_bytes)
    if per_group < 1:
        raise ValueError(f"load_schedule: one layer ({per_layer} bytes) does not fit a slot of {slot_bytes} bytes")
    ways = 1
    if layer_wise and not lc_major and per_group < n_layers:
        ways = max(1, min(stagger_ways, per_group, n_pages // min_part_pages))
    sched = stagger_schedule(n_layers, per_group, ways)
    if head:
        sched = LoadSchedule([u._replace(layer_begin=u.layer_begin + head) for u in sched.units], sched.ready)
    return sched, way_bounds(n_pages, ways)
