"""The order of a staged layer-wise load: layer groups staggered over parts of the page list.

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

Pure Python, no GPU; :mod:`hicache.transfer.staged_plan` plans each unit's chunks.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from hicache.transfer.staged_plan import group_layers


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

    The layers from ``head`` on go by groups of :func:`~hicache.transfer.staged_plan.group_layers` (runs of at least
    ``min_run_bytes``), staggered over up to ``stagger_ways`` parts of at least ``min_part_pages`` pages
    each; units and ``ready`` are numbered from layer ``head`` (the first ``head`` layers move another
    way), and ``layer_begin`` is absolute. One group (whole pages) is never staggered: every layer is
    ready at once anyway, and whole-page runs of consecutive host pages merge into single copies, which
    staggering would split. Not ``layer_wise`` (the caller waits for the whole load): groups as large as a
    slot allows, whole pages where one fits, not staggered.

    ``lc_major`` (:func:`~hicache.transfer.staged_plan.plan_group_lc`: runs of pages, not layer groups, make
    the copies large): one layer per group when ``layer_wise``, else as many layers as let all
    ``n_pages`` share a slot (at least one); never staggered.
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
