"""How much an L3 write burst slows the serving thread: foreground speed during writeback vs idle.

A serving node's Python thread launches the GPU work; if background L2 -> L3 writes take its CPU, every
forward pass waits on the host. This script writes ``--pages`` pages (8 MiB each by default: one page of
an 8B-shaped model at 64 tokens) to the file store from a background thread, as the writeback does,
while the main thread runs a Python loop that stands in for the serving thread. It reports, per write
configuration:

* foreground speed during the burst as a share of its idle speed (the in-run baseline), and its longest
  stall;
* the burst's write throughput (GB/s).

Configurations: ``as reads`` (writes on as many threads as reads, normal priority: how the file store
wrote before it had a write pool) and ``default`` (``write_threads`` / ``write_nice`` defaults).

    python benchmarks/writeback_interference.py [--pages 48] [--io-threads 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hicache.layout import KVLayout
from hicache.pool import HostPool
from hicache.storage import StorageContext
from hicache.storage.file_backend import FileBackend

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=64)


def spin(until: threading.Event | float) -> tuple[float, float]:
    """Python loop iterations per second and the longest gap between two of them (s), until ``until``
    (an event that gets set, or a duration)."""
    n, worst = 0, 0.0
    t0 = last = time.perf_counter()
    while True:
        now = time.perf_counter()
        worst = max(worst, now - last)
        last = now
        n += 1
        if isinstance(until, float) and now - t0 >= until:
            break
        if isinstance(until, threading.Event) and n % 256 == 0 and until.is_set():
            break
    return n / (time.perf_counter() - t0), worst


def burst(root: Path, pool: HostPool, io_threads: int, options: dict[str, int], tag: str) -> dict[str, Any]:
    ctx = StorageContext(hashlib.sha256(b"interference").digest(), LAYOUT)
    b = FileBackend(f"file://{root / tag}", ctx, io_threads=io_threads, **options)
    n = pool.num_pages
    keys = [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]
    done = threading.Event()
    took: list[float] = []

    def write() -> None:
        t = time.perf_counter()
        assert b.batch_set(keys, pool, list(range(n))) == n
        took.append(time.perf_counter() - t)
        done.set()

    idle_rate, idle_gap = spin(0.5)
    th = threading.Thread(target=write)
    th.start()
    rate, gap = spin(done)
    th.join()
    b.close()
    return {"config": tag, "options": options, "idle_rate": idle_rate, "busy_rate": rate,
            "foreground_share": rate / idle_rate, "idle_worst_gap_ms": 1e3 * idle_gap,
            "worst_gap_ms": 1e3 * gap, "write_gbps": n * LAYOUT.bytes_per_page / took[0] / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=48, help="pages per burst (8 MiB each)")
    ap.add_argument("--io-threads", type=int, default=0, help="read threads (0: the file store's default)")
    ap.add_argument("--root", default="", help="directory for the stores (default: a temporary one)")
    ap.add_argument("--json", default="out/writeback_interference.json")
    a = ap.parse_args(argv)
    io_threads = a.io_threads or min(16, max(4, os.cpu_count() or 4))
    pool = HostPool(LAYOUT, a.pages)
    pool.buffer.view(torch.uint8).copy_(torch.randint(0, 256, pool.buffer.view(torch.uint8).shape,
                                                      dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="hicache-interference-"))
    configs = [("as reads", {"write_threads": io_threads, "write_nice": 0}), ("default", {})]
    rows = []
    print(f"# {a.pages} pages of {LAYOUT.bytes_per_page >> 20} MiB, io_threads {io_threads}, "
          f"{os.cpu_count()} cpus")
    print(f"{'writes':10s} {'threads':>7s} {'nice':>4s} | {'foreground':>10s} {'worst stall':>11s} | "
          f"{'write GB/s':>10s}")
    try:
        for tag, opts in configs:
            r = burst(root, pool, io_threads, opts, tag.replace(" ", "-"))
            wt = opts.get("write_threads", max(2, io_threads // 4))
            print(f"{tag:10s} {wt:7d} {opts.get('write_nice', 10):4d} | {r['foreground_share']:9.0%} "
                  f"{r['worst_gap_ms']:9.1f} ms | {r['write_gbps']:10.2f}")
            rows.append(r)
    finally:
        if not a.root:
            shutil.rmtree(root, ignore_errors=True)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"pages": a.pages, "io_threads": io_threads, "cpus": os.cpu_count(),
                               "machine": platform.machine(), "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
