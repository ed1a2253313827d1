"""Block-mirrored staging for block-first host pools (``cache.host_layout: block_first``,
``block_staging: mirror``): each slot is laid out like the pool's blocks, so a block the transfer covers
moves as one copy. Pure NumPy, no GPU; the other staged plans are in :mod:`hicache.transfer.staged_plan`.
"""

from __future__ import annotations

import numpy as np

from hicache.transfer.copy_engine import CopyPlan
from hicache.transfer.staged_plan import StagedChunk, chunk_sizes


def plan_group_blocks(host_base: int, piece_bytes: int, kv_count: int, num_layers: int, block_pages: int,
                      host_pages: np.ndarray, layer_begin: int, n_layers: int, slot_bytes: int, to_host: bool,
                      ramp_up: int = 0, ramp_down: int = 0) -> list[StagedChunk] | None:
    """Block-mirrored chunks of the layer group ``[layer_begin, layer_begin + n_layers)`` for the pages
    ``host_pages`` (ascending) of a block-first pool (``[P / B, L, C, B, piece]``, ``B = block_pages``,
    base ``host_base``); None when one block's ``n_layers`` do not fit ``slot_bytes``.

    A slot is a row of *bins*, each laid out like one host block of the group: ``[n_lc][B][piece]``
    (``n_lc = n_layers * kv_count``), bin ``b`` at slot offset ``b * n_lc * B * piece``; a chunk holds up
    to ``slot_bytes // (n_lc * B * piece)`` bins (fewer in the ramps of
    :func:`~hicache.transfer.staged_plan.chunk_sizes`, which count bins here). A page sits at slot key
    ``b * n_lc * B + k`` (``slot_keys``; the kernel addresses the slot with page stride ``piece`` and
    (layer, K/V) stride ``B * piece``):

    * a block the transfer covers whole takes a bin of its own, ``k = h % B``: its ``n_lc`` rows are
      contiguous on both sides, so it is ONE copy (whole pages of consecutive such blocks merge into one),
      where :func:`~hicache.transfer.staged_plan.plan_group_lc` makes ``n_lc`` of them;
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
