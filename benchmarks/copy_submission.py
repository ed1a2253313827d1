"""What limits copy-engine transfers of small pieces: the host's cost of submitting each copy, or the
copy engine itself?

Host-to-device copies of one run size (4 to 64 KiB, ``--runs``) from random pages of a 2 GiB pinned
buffer into device memory, ``--total-mib`` per sample, issued with ``cudaMemcpyBatchAsync`` (batches of
at most ``copy_engine.MAX_BATCH`` copies, as the engine cuts them) on 1, 2 or 4 streams, from one thread
or one thread per stream. Each case reports:

* ``host_us_per_copy``: wall time of the submission calls per copy;
* ``gbps`` (and its ratio to one contiguous pinned copy measured in the same run, the baseline):
  with ``gated`` (default), the streams wait on an event behind a ~150 ms sleep kernel, so the copies
  are queued before the device starts and the time is the device's alone (unless the host had to wait
  for queue space, which shows as a host time above the gate); ungated, the copies run as they are
  submitted, as a transfer engine issuing them on demand would see them.

Also ``srcAccessOrder`` any (3) instead of stream (1), and no ``PREFER_OVERLAP_WITH_COMPUTE`` flag.

    python benchmarks/copy_submission.py [--json out/copy_submission.json] [--reps 3]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache.transfer.copy_engine import CudaRuntime, _MemcpyAttributes, batch_bounds

GATE_CYCLES = 300_000_000  # ~150 ms of torch.cuda._sleep: longer than any submission measured here
HOST_PAGE = 256 << 10  # host page stride: 32 layers x K, V x 4 KiB, as a page-first L2 pool
HOST_PAGES = 8192  # 2 GiB of pinned memory


class Bench:
    def __init__(self, total: int, reps: int) -> None:
        self.rt = CudaRuntime.get()
        if not self.rt.has_batch:
            raise SystemExit("copy_submission: needs cudaMemcpyBatchAsync (CUDA 12.8+)")
        self.batch = self.rt._lib.cudaMemcpyBatchAsync
        self.total, self.reps = total, reps
        self.host = torch.empty(HOST_PAGES * HOST_PAGE, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(total, dtype=torch.uint8, device="cuda")
        self.rng = np.random.default_rng(0)
        self.rows: list[dict[str, Any]] = []
        self.ceiling = 0.0

    def measure_ceiling(self) -> float:
        src = self.host[: self.total]
        times = []
        for _ in range(self.reps + 1):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.dev.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        self.ceiling = self.total / float(np.median(times[1:])) / 1e9
        return self.ceiling

    def plan(self, run: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``total / run`` copies of ``run`` bytes: random host pages, the k-th pass over them at the
        k-th run of each page; in host address order; into consecutive device runs."""
        n = self.total // run
        pages = self.rng.permutation(HOST_PAGES)
        k = np.arange(n)
        src = (self.host.data_ptr() + pages[k % HOST_PAGES] * HOST_PAGE
               + ((k // HOST_PAGES) % (HOST_PAGE // run)) * run).astype(np.uint64)
        src.sort()
        dst = (self.dev.data_ptr() + np.arange(n, dtype=np.uint64) * run).astype(np.uint64)
        return dst, src, np.full(n, run, dtype=np.uint64)

    def submit(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray, stream: int,
               attrs: _MemcpyAttributes) -> None:
        idx = (ctypes.c_size_t * 1)(0)
        bounds = batch_bounds(len(size))
        for lo, hi in itertools.pairwise(bounds):
            d, s, z = (np.ascontiguousarray(x[lo:hi]) for x in (dst, src, size))
            err = self.batch(d.ctypes.data, s.ctypes.data, z.ctypes.data, hi - lo, ctypes.addressof(attrs),
                             ctypes.addressof(idx), 1, stream)
            if err != 0:
                raise RuntimeError(f"cudaMemcpyBatchAsync failed: {err}")

    def case(self, run: int, n_streams: int, threads: int, order: int = 1, flags: int = 1,
             gated: bool = True) -> None:
        dst, src, size = self.plan(run)
        n = len(size)
        streams = [torch.cuda.Stream(priority=-1) for _ in range(n_streams)]
        attrs = []
        for _ in range(n_streams):
            a = _MemcpyAttributes()
            a.srcAccessOrder, a.flags = order, flags
            attrs.append(a)
        parts = [(n * i // n_streams, n * (i + 1) // n_streams) for i in range(n_streams)]

        def work(i: int) -> None:
            lo, hi = parts[i]
            self.submit(dst[lo:hi], src[lo:hi], size[lo:hi], streams[i].cuda_stream, attrs[i])

        dev_t, host_t = [], []
        for r in range(self.reps + 1):
            torch.cuda.synchronize()
            gate = torch.cuda.Stream()
            start = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(gate):
                if gated:
                    torch.cuda._sleep(GATE_CYCLES)
                start.record(gate)
            for s in streams:
                s.wait_event(start)
            t0 = time.perf_counter()
            if threads == 1:
                for i in range(n_streams):
                    work(i)
            else:
                ts = [threading.Thread(target=work, args=(i,)) for i in range(n_streams)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
            t1 = time.perf_counter()
            ends = []
            for s in streams:
                e = torch.cuda.Event(enable_timing=True)
                e.record(s)
                ends.append(e)
            torch.cuda.synchronize()
            if r:
                dev_t.append(max(start.elapsed_time(e) for e in ends) / 1e3)
                host_t.append(t1 - t0)
        d, h = float(np.median(dev_t)), float(np.median(host_t))
        gbps = self.total / d / 1e9
        row = {"run_bytes": run, "copies": n, "streams": n_streams, "threads": threads, "src_access_order": order,
               "flags": flags, "gated": gated, "device_ms": d * 1e3, "gbps": gbps, "ratio": gbps / self.ceiling,
               "host_ms": h * 1e3, "host_us_per_copy": h / n * 1e6}
        self.rows.append(row)
        print(f"{run >> 10:>3} KiB x {n:6d}  streams {n_streams} threads {threads} order {order} flags {flags} "
              f"{'gated  ' if gated else 'ungated'}: {gbps:5.1f} GB/s ({row['ratio']:.2f} of one copy)  "
              f"host {h * 1e3:7.2f} ms = {row['host_us_per_copy']:.2f} us/copy", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="out/copy_submission.json")
    p.add_argument("--total-mib", type=int, default=256, help="bytes per sample")
    p.add_argument("--runs", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="copy sizes in KiB")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_submission: needs a CUDA GPU", file=sys.stderr)
        return 2
    b = Bench(args.total_mib << 20, args.reps)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudart": b.rt.version,
            "python": platform.python_version()}
    print(json.dumps(info), flush=True)
    print(f"baseline: one contiguous pinned copy {b.measure_ceiling():.1f} GB/s", flush=True)
    for kib in args.runs:
        run = kib << 10
        for n_streams in (1, 2, 4):
            b.case(run, n_streams, 1)
        if kib <= 32:
            b.case(run, 2, 2)
            b.case(run, 4, 4)
            b.case(run, 1, 1, order=3)
            b.case(run, 1, 1, flags=0)
            b.case(run, 1, 1, gated=False)
            b.case(run, 4, 4, gated=False)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "args": vars(args), "baseline_gbps": b.ceiling, "rows": b.rows},
                              indent=1))
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
