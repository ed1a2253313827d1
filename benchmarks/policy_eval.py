"""Held-out evaluation of the eviction policies: every policy, LRU and the offline optimum on a family of
generated traces whose laws differ, plus the Mooncake trace, at L1 capacities of 5/10/30/50% of each
trace's working set; the default's margin over LRU per row and its worst margin over all rows.

Traces. One per kind of :data:`hicache.bench.traces.TRACE_KINDS` (multi-turn chat with short and with
long think times, agents appending tool outputs, RAG over skewed and over flat document popularity,
one-off prompts beside RAG, drifting popularity, a mix), its law -- session lengths, think times,
popularity skew, shared-prefix depth, one-off share -- drawn from ``--seed``; blocks of 16 tokens,
Mooncake-shaped (no outputs). The policy was designed on seeds 0 and 1; the default ``--seed`` 7 was
not looked at before this table. Plus ``data/mooncake/synthetic_trace.jsonl`` (512-token blocks).

Leave-one-out. ``hedge_lru`` has one fitted parameter, ``Z`` (the evidence it needs to leave LRU),
from ``Z_GRID``. For the row of trace T the default's figure is that of the ``Z`` chosen on every trace
but T: the largest mean margin over LRU among the values whose worst margin there is >= -0.3 points
(else the best worst margin). Nothing is tuned on the trace a row reports. The value chosen on all
traces is what ships (``HedgeLRU.Z``); the script says whether they agree.

``tail_lru`` and ``lru2`` left the package (behind LRU on some held-out trace, never a point ahead of
``hedge_lru``); they are defined here, as they shipped, so the table still shows what they teach.

Each cell replays the trace on an L1-only radix tree (:func:`hicache.bench.policy_table.tree_hit_rate`,
the in-process cache's hit rate, 3x faster); the optimum is Belady on the prefix tree. ``priority``
is left out: without priorities set it orders exactly as LRU.

    python benchmarks/policy_eval.py [--seed 7] [--requests 2000] [--jobs 2] [--out benchmarks/results/cpu/policy_eval]

A trace of your own: ``hicache bench --trace FILE --policy-table``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from hicache.bench.optimal import belady, infinite, page_trace
from hicache.bench.policy_table import BASELINES, EVAL_FRACTIONS, FLOOR_POINTS, tree_hit_rate
from hicache.bench.traces import GENERATED_BLOCK, MOONCAKE_BLOCK, TRACE_KINDS, generated_trace, load_trace
from hicache.bench.workloads import TraceRequest
from hicache.config import CacheConfig
from hicache.eviction import EvictionPolicy, HedgeLRU, policy_names, register_policy
from hicache.eviction.base import peak_pages, remember
from hicache.radix import RadixTree, TreeNode

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT / "data" / "mooncake" / "synthetic_trace.jsonl"
DEFAULT = CacheConfig.eviction_policy
Z_GRID = (1.5, 2.0, 3.0)
RETIRED = ("lru2", "tail_lru")  # removed from the package, compared here


def variant(z: float) -> str:
    return f"{DEFAULT}[z={z:g}]"


def compared() -> list[str]:
    """The policies of the table (the package's, the retired ones; not ``priority`` nor the default)."""
    register()
    return [p for p in policy_names() if p not in ("priority", DEFAULT) and "[" not in p]


# ------------------------------------------------------------ policies that left the package, as they shipped
ONE_OFF_SAMPLE = 16  # siblings looked at to judge whether a parent's children tend to be one-offs
ONE_OFF_SHARE = 0.5  # share of those that must be one-off leaves


def is_one_off_tail(node: TreeNode) -> bool:
    """A leaf not used since it was inserted, whose siblings (up to ``ONE_OFF_SAMPLE``) are mostly such leaves."""
    parent = node.parent
    if parent is None or node.children or node.hit_count > 1:
        return False
    sample = [x for x in itertools.islice(parent.children.values(), ONE_OFF_SAMPLE + 1) if x is not node]
    sample = sample[:ONE_OFF_SAMPLE]
    if len(sample) < 2:
        return False
    return sum(1 for x in sample if not x.children and x.hit_count <= 1) >= ONE_OFF_SHARE * len(sample)


def tail_lru(node: TreeNode) -> Any:
    """LRU, except that one-off tails go first (LRU among them)."""
    return (not is_one_off_tail(node), node.last_access)


class _Lru2Meta:
    __slots__ = ("last", "prev")

    def __init__(self, prev: int, last: int) -> None:
        self.prev, self.last = prev, last


class LRU2(EvictionPolicy):
    """LRU-K, K = 2: nodes with one known access first, the rest by their second most recent access; a
    ghost list of 2 x peak page keys remembers the last access of pages that left the tree."""

    GHOST_FACTOR = 2.0

    def bind(self, tree: RadixTree) -> None:
        self.tree = tree
        self.ghost: OrderedDict[bytes, int] = OrderedDict()
        self.peak = 1

    def key(self, node: TreeNode) -> Any:
        m = node.meta
        return (-1, node.last_access) if m is None else (m.prev, m.last)

    def on_match(self, node: TreeNode, now: int) -> None:
        m = node.meta
        if m is not None and now != m.last:
            m.prev, m.last = m.last, now

    def on_insert(self, node: TreeNode, now: int, created: bool) -> None:
        if created:
            prev = max([-1, *(t for t in (self.ghost.pop(pk, None) for pk in node.page_keys) if t is not None)])
            node.meta = _Lru2Meta(prev, now)
            self.peak = peak_pages(self.tree, self.peak)

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        m = lower.meta
        if m is not None:
            upper.meta = _Lru2Meta(m.prev, m.last)

    def on_remove(self, node: TreeNode) -> None:
        m = node.meta
        if m is not None:
            remember(self.ghost, node.page_keys, m.last, int(self.GHOST_FACTOR * self.peak))


def register() -> None:
    """Register the retired policies and ``hedge_lru`` at each Z of the grid, in this process only (not at
    import: a test loading this script must not change the package's list of policies)."""
    if "tail_lru" in policy_names():
        return
    register_policy("tail_lru")(tail_lru)
    register_policy("lru2")(LRU2)
    for z in Z_GRID:
        register_policy(variant(z))(type(f"HedgeLRU_z{z:g}", (HedgeLRU,), {"Z": z}))


def load(name: str, seed: int, requests: int, mooncake: str) -> tuple[list[TraceRequest], int]:
    if name == "mooncake":
        return load_trace(mooncake), MOONCAKE_BLOCK
    return generated_trace(name, seed, requests), GENERATED_BLOCK


def cell(job: tuple[str, int, int, str, float]) -> dict[str, Any]:
    """Every policy (and every Z variant) of the table on one trace at one capacity."""
    name, seed, requests, mooncake, f = job
    names = [*compared(), *map(variant, Z_GRID)]
    reqs, ps = load(name, seed, requests, mooncake)
    pt = page_trace(reqs, ps)
    cap = max(1, int(f * pt.num_pages))
    return {"trace": name, "fraction": f, "capacity_pages": cap,
            "rates": {p: tree_hit_rate(reqs, ps, cap, p) for p in names},
            "optimal": belady(pt, cap).hit_rate, "infinite": infinite(pt).hit_rate, "requests": len(reqs),
            "pages": pt.num_pages}


def margin(cell: dict[str, Any], policy: str) -> float:
    return 100.0 * (cell["rates"][policy] - cell["rates"]["lru"])


def fit_z(cells: Sequence[dict[str, Any]]) -> float:
    """The Z of the grid with the largest mean margin over LRU among those whose worst margin is within the
    floor on ``cells`` (else the one with the best worst margin); ties go to the larger Z (closer to LRU)."""
    def stats(z: float) -> tuple[float, float]:
        ms = [margin(c, variant(z)) for c in cells]
        return min(ms), sum(ms) / len(ms)

    ok = [z for z in Z_GRID if stats(z)[0] >= -FLOOR_POINTS - 1e-9]
    if ok:
        return max(ok, key=lambda z: (round(stats(z)[1], 6), z))
    return max(Z_GRID, key=lambda z: (stats(z)[0], z))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=7, help="seed of the generated traces' laws (default 7)")
    ap.add_argument("--requests", type=int, default=2000, help="requests per generated trace")
    ap.add_argument("--mooncake", default=str(MOONCAKE), help="Mooncake trace ('' to skip)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--out", default="out/policy_eval", help="writes OUT.txt and OUT.json")
    args = ap.parse_args()
    names = (["mooncake"] if args.mooncake and Path(args.mooncake).exists() else []) + list(TRACE_KINDS)
    t0 = time.perf_counter()
    register()
    jobs = [(n, args.seed, args.requests, args.mooncake, f) for n in names for f in EVAL_FRACTIONS]
    with ProcessPoolExecutor(max(1, args.jobs)) as ex:  # the Mooncake cells, the slowest, go first
        done = list(ex.map(cell, jobs))
    wall = time.perf_counter() - t0
    order = list(TRACE_KINDS) + (["mooncake"] if "mooncake" in names else [])
    cells = sorted(done, key=lambda c: (order.index(c["trace"]), c["fraction"]))

    chosen = {n: fit_z([c for c in cells if c["trace"] != n]) for n in order}
    for c in cells:  # the default's held-out figure
        c["z"] = chosen[c["trace"]]
        c["rates"][DEFAULT] = c["rates"][variant(c["z"])]
    z_all = fit_z(cells)

    lines = [f"held-out policy evaluation: L1 only, hit rate of prompt tokens (%); generated traces seed {args.seed}, "
             f"{args.requests} requests, {GENERATED_BLOCK}-token blocks; Mooncake 512-token blocks; "
             f"{platform.machine()}, {args.jobs} jobs, {wall:.0f} s",
             f"{DEFAULT}: Z chosen leave-one-out from {list(Z_GRID)} (column z); margin = {DEFAULT} - lru (points); "
             f"'ahead' = margin over the best of {'/'.join(BASELINES)}"]
    policies = compared()
    shown = ["lru", "lfu", "arc", *[p for p in policies if p not in BASELINES], DEFAULT]
    w = 10
    lines.append(f"{'trace':{w}s} {'cap':>4s} " + " ".join(f"{p:>9s}" for p in shown)
                 + f" {'optimum':>8s} {'z':>4s} {'margin':>7s} {'ahead':>6s}")
    for c in cells:
        r = c["rates"]
        best = max(r[p] for p in BASELINES)
        c["margin"] = margin(c, DEFAULT)
        c["ahead"] = 100.0 * (r[DEFAULT] - best)
        lines.append(f"{c['trace']:{w}s} {c['fraction']:4.0%} " + " ".join(f"{100 * r[p]:9.1f}" for p in shown)
                     + f" {100 * c['optimal']:8.1f} {c['z']:4g} {c['margin']:+7.2f} {c['ahead']:+6.2f}")
    worst = min(cells, key=lambda c: c["margin"])
    floor_ok = worst["margin"] >= -FLOOR_POINTS - 1e-9
    ahead = sum(c["ahead"] > 0.05 for c in cells)
    tied = sum(abs(c["ahead"]) <= 0.05 for c in cells)
    room = sum(100.0 * (c["optimal"] - max(c["rates"][p] for p in BASELINES)) <= FLOOR_POINTS for c in cells)
    lines += [
        f"worst margin of {DEFAULT} over lru: {worst['margin']:+.2f} points "
        f"({worst['trace']} {worst['fraction']:.0%}); "
        f"floor (>= -{FLOOR_POINTS} in every cell): {'met' if floor_ok else 'NOT met'}",
        f"mean margin over lru: {sum(c['margin'] for c in cells) / len(cells):+.2f} points; ahead of the best of "
        f"{'/'.join(BASELINES)} (> +0.05) in {ahead}/{len(cells)} cells, within 0.05 in {tied}, behind in "
        f"{len(cells) - ahead - tied}; in {room} cells that best is already within {FLOOR_POINTS} of the optimum",
        f"Z fit on all traces: {z_all:g} (shipped HedgeLRU.Z = {HedgeLRU.Z:g}: "
        f"{'the same' if z_all == HedgeLRU.Z else 'DIFFERENT'})",
        "per policy, cells vs lru (> +0.3 / within 0.3 / < -0.3), worst margin, cells where it beats both lru and "
        f"{DEFAULT} by > 0.3:",
    ]
    summary = {}
    for p in [*policies, DEFAULT]:
        ms = [margin(c, p) for c in cells]
        wins = sum(100.0 * (c["rates"][p] - max(c["rates"]["lru"], c["rates"][DEFAULT])) > FLOOR_POINTS for c in cells)
        summary[p] = {"above": sum(m > FLOOR_POINTS for m in ms), "within": sum(abs(m) <= FLOOR_POINTS for m in ms),
                      "below": sum(m < -FLOOR_POINTS for m in ms), "worst": min(ms), "mean": sum(ms) / len(ms),
                      "best_choice_cells": wins}
        s = summary[p]
        lines.append(f"  {p:10s} {s['above']:3d} / {s['within']:3d} / {s['below']:3d}   worst {s['worst']:+6.2f}   "
                     f"mean {s['mean']:+6.2f}   right choice in {wins} cells")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({
        "seed": args.seed, "requests": args.requests, "fractions": list(EVAL_FRACTIONS), "z_grid": list(Z_GRID),
        "z_all": z_all, "default": DEFAULT, "floor_points": FLOOR_POINTS, "floor_met": floor_ok,
        "worst_margin": worst["margin"], "cells": cells, "summary": summary, "wall_s": wall}, indent=1))
    print(f"wrote {out.with_suffix('.txt')} and {out.with_suffix('.json')}")
    return 0 if floor_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
