"""What one long-prefix request's first token waits on, and the physical bound it is held to.

Used by ``e2e_rag.py``'s ``ttft16k`` workload:

* :class:`TracedPort` wraps a cache port and stamps each step of one request on the host clock (match,
  prefetch, load submit, allocation, commit) and, per layer, the host time spent in ``wait_layer`` and the
  GPU time the compute stream stalled there (CUDA events recorded before and after each wait, on the
  stream the model runs on). Nothing is synchronised that the node does not synchronise itself.
* :func:`link_seconds`: the time of one pinned host -> device copy of ``nbytes`` (median of a few), the
  link's speed in the same run.
* :func:`read_seconds`: the time to read every page file of a file store into memory with a thread pool
  of the store's width, its read rate in the same run (no checksum, no placement: the raw loop).
* :func:`store_read_compare` (also ``python benchmarks/_ttft_probe.py``): the file store's verified
  ``batch_get`` of llama-8b-sized pages (8 MiB) into a host pool (pinned where CUDA is) against that raw loop
  over the same files, interleaved in one run: what the L3 hit's read costs beyond the store's raw rate.

The bound of an L2 hit is the prefix's bytes at link speed plus the suffix's compute over a cached prefix
(measured as an L1 hit of the same request shape); of an L3 hit, the prefix's bytes at the store's read
rate plus the same compute.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Timeline:
    """Host times (seconds, from the request's ``match`` call) of one request's steps, and per layer the
    host seconds inside ``wait_layer`` and the compute stream's stall there (GPU seconds)."""

    t0: float = 0.0
    steps: list[tuple[str, float, float]] = field(default_factory=list)  # (step, start, end)
    layer_wait_host: list[float] = field(default_factory=list)
    layer_at: list[float] = field(default_factory=list)  # host time each layer's wait returned
    _events: list[tuple[Any, Any]] = field(default_factory=list)
    _ref: Any = None

    def stamp(self, name: str, start: float, end: float) -> None:
        if not self.steps:
            self.t0 = start
        self.steps.append((name, start - self.t0, end - self.t0))

    def summary(self, t_first: float) -> dict[str, Any]:
        gpu_stall = []
        gpu_at = []
        if self._events and self._ref is not None:
            self._events[-1][1].synchronize()
            gpu_stall = [a.elapsed_time(b) / 1e3 for a, b in self._events]
            gpu_at = [self._ref.elapsed_time(b) / 1e3 for _, b in self._events]
        steps = [{"step": n, "start_ms": 1e3 * a, "ms": 1e3 * (b - a)} for n, a, b in self.steps]
        return {
            "steps": steps,
            "first_token_ms": 1e3 * (t_first - self.t0),
            "layers": len(self.layer_wait_host),
            "layer_wait_host_ms_total": 1e3 * sum(self.layer_wait_host),
            "layer_wait_host_ms": [round(1e3 * w, 3) for w in self.layer_wait_host],
            "gpu_stall_ms_total": 1e3 * sum(gpu_stall),
            "gpu_stall_ms": [round(1e3 * s, 3) for s in gpu_stall],
            "gpu_layer_ready_ms": [round(1e3 * s, 3) for s in gpu_at],  # from the load's submit, GPU clock
            "host_last_layer_ready_ms": 1e3 * (self.layer_at[-1] - self.t0) if self.layer_at else 0.0,
        }


class _TracedLoad:
    def __init__(self, inner: Any, tl: Timeline) -> None:
        self._inner = inner
        self._tl = tl

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def wait_layer(self, layer: int) -> None:
        cuda = torch.cuda.is_available()
        before = after = None
        if cuda:
            before = torch.cuda.Event(enable_timing=True)
            before.record()
        t = time.perf_counter()
        self._inner.wait_layer(layer)
        t1 = time.perf_counter()
        if cuda:
            after = torch.cuda.Event(enable_timing=True)
            after.record()
            self._tl._events.append((before, after))
        self._tl.layer_wait_host.append(t1 - t)
        self._tl.layer_at.append(t1)


class TracedPort:
    """A cache port whose calls are stamped into :attr:`timeline` (reset by :meth:`reset`)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.timeline = Timeline()

    def reset(self) -> None:
        self.timeline = Timeline()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _timed(self, name: str, fn: Any, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        r = fn(*args, **kw)
        self.timeline.stamp(name, t, time.perf_counter())
        return r

    def match(self, *a: Any, **k: Any) -> Any:
        return self._timed("match", self._inner.match, *a, **k)

    def prefetch(self, *a: Any, **k: Any) -> Any:
        return self._timed("prefetch", self._inner.prefetch, *a, **k)

    def load_back(self, *a: Any, **k: Any) -> Any:
        if torch.cuda.is_available():
            self.timeline._ref = torch.cuda.Event(enable_timing=True)
            self.timeline._ref.record()
        return _TracedLoad(self._timed("load_submit", self._inner.load_back, *a, **k), self.timeline)

    def alloc(self, *a: Any, **k: Any) -> Any:
        return self._timed("alloc", self._inner.alloc, *a, **k)

    def commit(self, *a: Any, **k: Any) -> Any:
        return self._timed("commit", self._inner.commit, *a, **k)

    def release(self, *a: Any, **k: Any) -> Any:
        return self._inner.release(*a, **k)


def link_seconds(nbytes: int, device: str, reps: int = 3) -> float:
    """Median seconds of one pinned host -> ``device`` copy of ``nbytes`` (0 on CPU: there is no link)."""
    if not device.startswith("cuda"):
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del src, dst
    return statistics.median(times[1:])


def aligned_buffer(n: int) -> Any:
    """``n`` bytes, 64-byte aligned as the host pool's pages are: the kernel copies a file out of the page
    cache at a third less CPU when source and destination agree mod 64 (a ``bytearray`` starts 16 bytes
    off), so the raw loop reads the file's offset 0 at the rate a page aligned in its file is read."""
    return torch.empty(n, dtype=torch.uint8).numpy()


def read_seconds(root: str, threads: int = 0, reps: int = 3) -> tuple[float, int, int]:
    """(median seconds, bytes, files) to read every ``*.page`` file under ``root`` into preallocated buffers
    (64-byte aligned) with ``threads`` readers (0: the file store's default width)."""
    files = sorted(Path(root).rglob("*.page"))
    sizes = [f.stat().st_size for f in files]
    bufs = [aligned_buffer(s) for s in sizes]
    threads = threads or min(16, max(4, os.cpu_count() or 4))

    def one(i: int) -> int:
        with open(files[i], "rb", buffering=0) as fh:
            return fh.readinto(bufs[i]) or 0

    times = []
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(reps):
            t = time.perf_counter()
            got = sum(ex.map(one, range(len(files))))
            times.append(time.perf_counter() - t)
            assert got == sum(sizes), (got, sum(sizes))
    return statistics.median(times), sum(sizes), len(files)


def store_read_compare(pages: int = 64, rounds: int = 11, batch: int = 128, threads: int = 0,
                       root: str | None = None) -> dict[str, Any]:
    """Median and best wall seconds, and median process CPU seconds, of reading ``pages`` llama-8b pages
    (32 layers x K/V x 64 tokens x 8 heads x 128 dims, bfloat16: 8 MiB) from a local file store: its
    ``batch_get`` in ``batch``-page calls (verified, into a host pool) and the raw loop of
    :func:`read_seconds` over the same files, ``rounds`` times interleaved."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from hicache.layout import KVLayout
    from hicache.pool import HostPool
    from hicache.storage import StorageContext
    from hicache.storage.file_backend import FileBackend

    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=64)
    src, dst = HostPool(layout, pages), HostPool(layout, pages)
    u8 = src.buffer.view(torch.uint8)
    u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8))
    with tempfile.TemporaryDirectory(prefix="hicache-read-", dir=root) as d:
        be = FileBackend(d, StorageContext(hashlib.sha256(b"probe").digest(), layout), io_threads=threads)
        keys = [hashlib.sha256(b"%d" % i).digest() for i in range(pages)]
        assert be.batch_set(keys, src, list(range(pages))) == pages
        files = sorted(Path(d).rglob("*.page"))
        bufs = [aligned_buffer(f.stat().st_size) for f in files]

        def raw() -> None:
            def one(i: int) -> int:
                with open(files[i], "rb", buffering=0) as fh:
                    return fh.readinto(bufs[i]) or 0
            assert sum(ex.map(one, range(len(files)))) == sum(map(len, bufs))

        def get() -> None:
            n = sum(be.batch_get(keys[lo:lo + batch], dst, list(range(lo, min(pages, lo + batch))))
                    for lo in range(0, pages, batch))
            assert n == pages, n

        wall: dict[str, list[float]] = {"raw": [], "batch_get": []}
        cpu: dict[str, list[float]] = {"raw": [], "batch_get": []}
        with ThreadPoolExecutor(be._threads) as ex:
            for _ in range(rounds):
                for name, fn in (("raw", raw), ("batch_get", get)):
                    c, t = time.process_time(), time.perf_counter()
                    fn()
                    wall[name].append(time.perf_counter() - t)
                    cpu[name].append(time.process_time() - c)
        assert torch.equal(dst.buffer.view(torch.uint8), u8)
        threads = be._threads
        be.close()
    out: dict[str, Any] = {"pages": pages, "page_bytes": layout.bytes_per_page, "io_threads": threads,
                           "batch": batch, "rounds": rounds, "pinned": dst.pinned}
    for name in wall:
        out[name] = {"median_s": statistics.median(wall[name]), "min_s": min(wall[name]),
                     "cpu_median_s": statistics.median(cpu[name])}
    out["ratio_median"] = out["batch_get"]["median_s"] / out["raw"]["median_s"]
    out["ratio_min"] = out["batch_get"]["min_s"] / out["raw"]["min_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="file store: verified batch_get vs the raw read of the same files")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--batch", type=int, default=128, help="pages per batch_get (storage.io_batch_pages)")
    ap.add_argument("--threads", type=int, default=0, help="io_threads (0: the store's default)")
    ap.add_argument("--root", default=None, help="directory for the store (default: the system's temp dir)")
    a = ap.parse_args()
    r = store_read_compare(a.pages, a.rounds, a.batch, a.threads, a.root)
    nb = r["pages"] * r["page_bytes"]
    print(f"{r['pages']} pages of {r['page_bytes'] / 2**20:.0f} MiB ({nb / 1e9:.2f} GB), {r['io_threads']} io threads, "
          f"batch {r['batch']}, pool pinned: {r['pinned']}, {r['rounds']} interleaved rounds, {os.cpu_count()} cpus")
    for name in ("raw", "batch_get"):
        m = r[name]
        print(f"  {name:9s} median {1e3 * m['median_s']:7.1f} ms ({nb / m['median_s'] / 1e9:6.2f} GB/s)  "
              f"best {1e3 * m['min_s']:7.1f} ms  cpu {1e3 * m['cpu_median_s']:7.1f} ms")
    print(f"  batch_get / raw: {r['ratio_median']:.2f}x (median), {r['ratio_min']:.2f}x (best)")


if __name__ == "__main__":
    main()
