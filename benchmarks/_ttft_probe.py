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

The bound of an L2 hit is the prefix's bytes at link speed plus the suffix's compute over a cached prefix
(measured as an L1 hit of the same request shape); of an L3 hit, the prefix's bytes at the store's read
rate plus the same compute.
"""

from __future__ import annotations

import os
import statistics
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


def read_seconds(root: str, threads: int = 0, reps: int = 3) -> tuple[float, int, int]:
    """(median seconds, bytes, files) to read every ``*.page`` file under ``root`` into preallocated buffers
    with ``threads`` readers (0: the file store's default width)."""
    files = sorted(Path(root).rglob("*.page"))
    sizes = [f.stat().st_size for f in files]
    bufs = [bytearray(s) for s in sizes]
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
