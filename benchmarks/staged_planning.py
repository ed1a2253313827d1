"""Host cost of planning a staged transfer, and the copies each plan makes (CPU only).

A staged transfer's host submission is mostly planning (NumPy), one batched-memcpy entry per copy, and a
kernel launch, a batched-memcpy call and events per chunk, so fewer copies and fewer chunks mean less host
time. For each piece size, the host pages of a 256 MiB transfer of 32 layers come from the L2 allocator
after churn (``transfer_bandwidth.allocated_pages``: random or LRU frees), or are scattered at random
over the pool, and three plans are made of them, as the CUDA engine makes them:

* ``page_first``: :func:`~hicache.transfer.staged_plan.plan_group` on a page-first pool (layer-wise loads in
  groups of :func:`~hicache.transfer.staged_plan.group_layers` layers, backups of whole pages), the baseline;
* ``lc_major``: :func:`~hicache.transfer.staged_plan.plan_group_lc` on a block-first pool (loads one layer at
  a time, planned once and shifted; backups of whole pages);
* ``mirror``: :func:`~hicache.transfer.staged_plan_blocks.plan_group_blocks` on a block-first pool.

Each row prints the copies, the chunks and the planning time of a layer-wise load and of a backup, and
the ratios of copies and time to the page-first plan of the same pages.

    python benchmarks/staged_planning.py [--reps 20] [--json out/staged_planning.json]   (the default path)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hicache.transfer.staged_plan import StagedChunk, group_layers, plan_group, plan_group_lc, shift_layers
from hicache.transfer.staged_plan_blocks import plan_group_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer_bandwidth import allocated_pages

LOAD_SLOT = 16 << 20  # the engine's load and backup slot sizes (hicache.transfer.cuda_tuning)
BACKUP_SLOT = 8 << 20
MIN_RUN = 64 << 10  # ce_min_copy_bytes: page-first layer groups reach this run per page
Plan = Callable[[], list[StagedChunk]]


def _timed(fn: Plan, reps: int) -> tuple[float, int, int]:
    """Median seconds of ``fn`` over ``reps`` calls, the copies of its chunks, and the chunks."""
    times = []
    chunks: list[StagedChunk] = []
    for _ in range(reps):
        t = time.perf_counter()
        chunks = fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)), sum(c.plan.n_copies for c in chunks), len(chunks)


def plans(h: np.ndarray, piece: int, layers: int, block_pages: int) -> dict[str, dict[str, Plan]]:
    """The load and backup plans of each staging for host pages ``h`` (ascending)."""
    L, C, B = layers, 2, block_pages
    page = L * C * piece
    g = group_layers(L, C, piece, MIN_RUN, LOAD_SLOT)
    keys = (h // B) * (L * C * B) + h % B

    def page_first_load() -> list[StagedChunk]:
        return [ch for l0 in range(0, L, g)
                for ch in plan_group(0, page, piece, C, h, l0, min(g, L - l0), LOAD_SLOT, False)]

    def lc_load() -> list[StagedChunk]:
        base = plan_group_lc(0, piece, B * piece, piece, C, keys, 0, 1, LOAD_SLOT, False)
        return [ch for layer in range(L) for ch in shift_layers(base, layer, C, B * piece, False)]

    def mirror_load() -> list[StagedChunk]:
        base = plan_group_blocks(0, piece, C, L, B, h, 0, 1, LOAD_SLOT, False)
        assert base is not None
        return [ch for layer in range(L) for ch in shift_layers(base, layer, C, B * piece, False)]

    def mirror_backup() -> list[StagedChunk]:
        out = plan_group_blocks(0, piece, C, L, B, h, 0, L, BACKUP_SLOT, True)
        assert out is not None
        return out

    return {
        "page_first": {"load": page_first_load,
                       "backup": lambda: plan_group(0, page, piece, C, h, 0, L, BACKUP_SLOT, True)},
        "lc_major": {"load": lc_load,
                     "backup": lambda: plan_group_lc(0, piece, B * piece, piece, C, keys, 0, L, BACKUP_SLOT, True)},
        "mirror": {"load": mirror_load, "backup": mirror_backup},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pieces", type=int, nargs="+", default=[4, 16], help="piece sizes in KiB")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--total-mib", type=int, default=256, help="bytes per transfer")
    p.add_argument("--pool-pages", type=int, default=65536, help="L2 pages the allocator churns")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=Path("out/staged_planning.json"))
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for kib in args.pieces:
        piece = kib << 10
        B = max(1, min(64, (64 << 10) // piece))  # HostPool's default block for this piece size
        n = (args.total_mib << 20) // (args.layers * 2 * piece)
        for frees in ("random", "lru", "scattered"):
            rng = np.random.default_rng(args.seed)
            h = np.sort(rng.permutation(args.pool_pages)[:n] if frees == "scattered"
                        else allocated_pages(args.pool_pages, n, rng, 64, frees == "lru"))
            base: dict[str, tuple[float, int]] = {}
            for name, ops in plans(h, piece, args.layers, B).items():
                row: dict[str, Any] = {"piece_kib": kib, "frees": frees, "pages": n, "block_pages": B,
                                       "staging": name}
                line = f"{kib:>3} KiB {frees:>6} {name:>10}:"
                for op, fn in ops.items():
                    sec, copies, n_chunks = _timed(fn, args.reps)
                    base.setdefault(op, (sec, copies))
                    row |= {f"{op}_ms": sec * 1e3, f"{op}_copies": copies, f"{op}_chunks": n_chunks,
                            f"{op}_ms_ratio": sec / base[op][0], f"{op}_copies_ratio": copies / base[op][1]}
                    line += (f"  {op} {copies:6d} copies ({copies / base[op][1]:.2f}x) {n_chunks:4d} chunks "
                             f"{sec * 1e3:6.2f} ms ({sec / base[op][0]:.2f}x)")
                rows.append(row)
                print(line, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
