"""Per-chunk timeline of staged loads (or backups) beside a GEMM: where the copy engine waits.

The staged path (``io_backend=staged``) moves each chunk twice: a DMA between pinned host memory and a
device staging slot, and a device-side scatter (loads) or gather (backups) between the slot and L1. Next
to a GEMM whose persistent kernels hold every SM, the scatters run only when a GEMM kernel ends; if the
DMA then runs out of free slots, the link idles. This benchmark records a CUDA event before and after
every DMA batch and every scatter/gather, and reports for a burst of transfers submitted during an
idle gap before the GEMMs start:

- the DMA's busy time (union of its intervals), its span and idle time, and its rate while busy;
- the idle gaps (count, longest);
- the same burst alone, for the DMA's rate without compute;
- when the GEMMs end and when everything has ended, against max(transfers alone, GEMMs alone): a
  compute stream held up behind transfer work (streams sharing one of the device's hardware queues, of
  which there are ``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default) shows there, and not in the GEMMs' own
  events, which start late with them;
- when the GEMMs started: they are queued by the same host thread right after the transfers, so a
  host held inside a submission call (the driver blocks a call when too much work is already queued)
  makes them start late. The longest host time of one call of each kind (DMA batch, kernel launch,
  event record, stream wait) is recorded, and printed when that happens;
- each figure for every engine variant of ``--variants`` (keyword options of the CUDA engine, e.g.
  ``stage_lanes=1``: the per-chunk copies on the single stage stream, the default baseline; ``default``:
  the engine's defaults), with the burst's rate as a ratio to the first variant's.

    python benchmarks/staged_timeline.py [--direction h2d] [--variants stage_lanes=1 default]
                                         [--json out/staged_timeline.json]

Needs a CUDA GPU and CuPy. The event hooks wrap the engine's DMA runner and kernel launcher; they add
two event records per chunk on the streams that do the work. Every event record and stream wait in the
process is timed on the host while a variant runs.
"""

from __future__ import annotations

import os

# as `hicache` itself does at start (before CUDA starts): hardware queues enough for the staged path's lanes,
# and command buffers that hold a burst of its copies without stalling the host
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_SCALE_LAUNCH_QUEUES", "4x")

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer_bandwidth import GB, HOST, Setup, ev, joined_loads, layout_for_piece, median, parse_variant

from hicache.transfer.cuda import CudaTransferEngine


class Hooks:
    """Events around every DMA batch and device-side staged copy of one engine."""

    def __init__(self, eng: CudaTransferEngine) -> None:
        assert eng._rt is not None
        self.dma: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.kern: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_ms: dict[str, float] = {}  # longest host time of one call, by kind
        rt, kern = eng._rt, eng.stage_kernel
        run, launch = rt.run, kern.launch_staged

        def timed(kind: str, fn: Any, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            dt = 1e3 * (time.perf_counter() - t0)
            self.host_ms[kind] = max(self.host_ms.get(kind, 0.0), dt)
            return out

        def wrap(fn: Any, into: list[tuple[torch.cuda.Event, torch.cuda.Event]], kind: str) -> Any:
            def call(stream_handle: int, *a: Any, **kw: Any) -> Any:
                s = torch.cuda.ExternalStream(stream_handle)
                e0, e1 = ev(), ev()
                record(e0, s)
                out = fn(stream_handle, *a, **kw)
                record(e1, s)
                into.append((e0, e1))
                return out

            def hooked(stream_handle: int, *a: Any, **kw: Any) -> Any:
                # timed with its two event records: a call blocked on a full queue may be either
                return timed(kind, call, stream_handle, *a, **kw)
            return hooked

        # the engine's own stream waits and event records, timed on the host
        record, wait = torch.cuda.Event.record, torch.cuda.Stream.wait_event
        torch.cuda.Event.record = lambda e, stream=None: timed("event record", record, e, stream)  # type: ignore[method-assign]
        torch.cuda.Stream.wait_event = lambda s, e: timed("stream wait", wait, s, e)  # type: ignore[method-assign]
        self._classes = [(torch.cuda.Event, "record", record), (torch.cuda.Stream, "wait_event", wait)]

        def run_hooked(plan: Any, stream_handle: int) -> Any:
            return wrap(lambda h, p: run(p, h), self.dma, "DMA batch")(stream_handle, plan)

        rt.run = run_hooked  # type: ignore[method-assign]
        kern.launch_staged = wrap(launch, self.kern, "kernel launch")  # type: ignore[method-assign]
        self._restore = [(rt, "run"), (kern, "launch_staged")]

    def restore(self) -> None:
        """Take the hooks off (the runtime is shared between engines)."""
        for obj, name in self._restore:
            if name in vars(obj):
                delattr(obj, name)
        for cls, name, fn in self._classes:
            setattr(cls, name, fn)

    def clear(self) -> None:
        self.dma.clear()
        self.kern.clear()
        self.host_ms = {}


EventPairs = list[tuple[torch.cuda.Event, torch.cuda.Event]]


def intervals(pairs: EventPairs, origin: torch.cuda.Event) -> list[tuple[float, float]]:
    """(start, end) in ms from ``origin``, merged where they overlap, in order."""
    iv = sorted((origin.elapsed_time(a), origin.elapsed_time(b)) for a, b in pairs)
    merged: list[list[float]] = []
    for a, b in iv:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


class Gemms:
    """bf16 8192^3 GEMMs on the current stream (about 1.4 ms each on an H200, every SM busy)."""

    def __init__(self) -> None:
        self.a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        self.b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def enqueue(self, k: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        x, y = ev(), ev()
        x.record()
        for _ in range(k):
            torch.mm(self.a, self.b)
        y.record()
        return x, y

    def time(self, k: int) -> float:
        x, y = self.enqueue(k)
        y.synchronize()
        return x.elapsed_time(y)


def summarize(hooks: Hooks, origin: torch.cuda.Event, nbytes: int,
              compute: tuple[torch.cuda.Event, torch.cuda.Event] | None) -> dict[str, Any]:
    """DMA busy/idle figures from ``origin``; with ``compute``, when the GEMMs ran (their end from
    ``origin`` shows a compute stream held up behind transfer work, which their own events cannot)."""
    dma = intervals(hooks.dma, origin)
    busy = sum(b - a for a, b in dma)
    span = dma[-1][1] - dma[0][0]
    gaps = [b0 - a1 for (_, a1), (b0, _) in itertools.pairwise(dma) if b0 - a1 > 0.05]
    kern = intervals(hooks.kern, origin)
    return {"dma_busy_ms": busy, "dma_span_ms": span, "dma_idle_ms": span - busy,
            "dma_busy_gbps": nbytes / (busy / 1e3) / GB, "rate_gbps": nbytes / (span / 1e3) / GB,
            "gaps": len(gaps), "longest_gap_ms": max(gaps, default=0.0),
            "kernel_busy_ms": sum(b - a for a, b in kern), "chunks": len(hooks.kern),
            "dma_end_ms": dma[-1][1],
            "compute_ms": compute[0].elapsed_time(compute[1]) if compute else 0.0,
            "compute_start_ms": origin.elapsed_time(compute[0]) if compute else 0.0,
            "compute_end_ms": origin.elapsed_time(compute[1]) if compute else 0.0,
            "longest_host_call_ms": dict(hooks.host_ms)}


def run_one(args: argparse.Namespace, s: Setup, variant: dict[str, int | str], gemm: Gemms, m: int) -> dict[str, Any]:
    opts = {"io_backend": "staged", "staging_bytes": args.staging_mib << 20, **variant}
    join = opts.pop("join_loads", 0)
    eng = s.engine(**opts)
    if join:  # staged loads as queued before December 2026 (see transfer_bandwidth.joined_loads)
        eng.load = joined_loads(eng, eng.load)  # type: ignore[method-assign]
    hooks = Hooks(eng)

    def burst(with_gemm: bool) -> dict[str, Any]:
        # The compute stream sleeps while the host submits; the transfers wait for it (the engine orders
        # them after work queued on the caller's stream), and the GEMMs follow the sleep at once.
        torch.cuda.synchronize()
        hooks.clear()
        origin = ev()
        t0 = time.perf_counter()
        torch.cuda._sleep(int(args.gap_ms * 1.9e6))
        origin.record()
        for _ in range(m):
            if args.direction == "h2d":
                eng.load(s.h, s.d)
            else:
                eng.backup(s.d, s.h)
        compute = gemm.enqueue(args.gemms) if with_gemm else None
        submitted_ms = 1e3 * (time.perf_counter() - t0)
        torch.cuda.synchronize()
        return {**summarize(hooks, origin, m * s.bytes, compute), "host_submit_ms": submitted_ms}

    burst(False)  # warm-up: stager, kernels
    alone = [burst(False) for _ in range(args.reps)]
    beside = [burst(True) for _ in range(args.reps)]
    eng.close()
    hooks.restore()
    pick = sorted(beside, key=lambda r: r["rate_gbps"])[len(beside) // 2]  # the median run, whole
    alone_span = median([r["dma_end_ms"] for r in alone])
    makespan = median([max(r["dma_end_ms"], r["compute_end_ms"]) for r in beside])
    return {"variant": variant, "alone_rate_gbps": median([r["rate_gbps"] for r in alone]),
            "beside_rate_gbps": median([r["rate_gbps"] for r in beside]), "median_run": pick,
            "alone_span_ms": alone_span, "compute_end_ms": median([r["compute_end_ms"] for r in beside]),
            "makespan_ms": makespan, "compute_start_ms": median([r["compute_start_ms"] for r in beside]),
            "host_submit_ms": median([r["host_submit_ms"] for r in beside]), "runs": beside}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--direction", choices=["h2d", "d2h"], default="h2d")
    p.add_argument("--variants", type=parse_variant, nargs="+",
                   default=[{"stage_lanes": 1}, {}],
                   help="engine options per variant, key=value[,key=value...] or 'default'; the first is the baseline")
    p.add_argument("--piece-kib", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--total-mib", type=int, default=256, help="bytes per transfer")
    p.add_argument("--staging-mib", type=int, default=256)
    p.add_argument("--transfers", type=int, default=0, help="transfers per burst (0: enough for the GEMMs)")
    p.add_argument("--gemms", type=int, default=24)
    p.add_argument("--gap-ms", type=float, default=400.0,
                   help="the compute stream sleeps about this long while the host submits the burst (the JSON "
                        "has the host's submission time and when the GEMMs started)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--host-layout", default="page_first", choices=["page_first", "layer_first", "block_first"],
                   help="layout of the L2 pool")
    p.add_argument("--host-pages", default="random", choices=["random", "allocated"],
                   help="host pages: a random permutation, or as the allocator hands them out (transfer_bandwidth)")
    p.add_argument("--json", default="out/staged_timeline.json")
    args = p.parse_args(argv)
    HOST.update(layout=args.host_layout, pages=args.host_pages)
    if not torch.cuda.is_available():
        print("staged_timeline: needs a CUDA GPU", file=sys.stderr)
        return 2
    s = Setup(layout_for_piece(args.piece_kib << 10, args.layers), args.total_mib << 20, seed=11)
    gemm = Gemms()
    for _ in range(3):
        gemm.time(args.gemms)
    t_gemm = median([gemm.time(args.gemms) for _ in range(3)])  # ms
    m = args.transfers or max(2, math.ceil(t_gemm / 1e3 / (s.bytes / 50e9)))
    print(f"{args.direction} staged, {args.piece_kib} KiB pieces, {m} x {s.bytes >> 20} MiB per burst, "
          f"{args.gemms} GEMMs ({t_gemm:.1f} ms alone)", flush=True)
    rows = []
    for variant in args.variants:
        r = run_one(args, s, variant, gemm, m)
        rows.append(r)
        mr = r["median_run"]
        base = rows[0]["beside_rate_gbps"]
        name = ",".join(f"{k}={v}" for k, v in variant.items()) or "default"
        print(f"{name}: alone {r['alone_rate_gbps']:5.1f} GB/s; beside the GEMMs "
              f"{r['beside_rate_gbps']:5.1f} GB/s ({r['beside_rate_gbps'] / base:.2f}x the first); "
              f"median run: DMA busy {mr['dma_busy_ms']:.1f} of {mr['dma_span_ms']:.1f} ms "
              f"({mr['dma_busy_gbps']:.1f} GB/s while busy), idle {mr['dma_idle_ms']:.1f} ms in {mr['gaps']} gaps "
              f"(longest {mr['longest_gap_ms']:.2f} ms), {mr['chunks']} chunks; GEMMs end at "
              f"{r['compute_end_ms']:.1f} ms, everything at {r['makespan_ms']:.1f} = "
              f"{r['makespan_ms'] / max(r['alone_span_ms'], t_gemm):.2f}x max(transfers alone "
              f"{r['alone_span_ms']:.1f}, GEMMs alone {t_gemm:.1f})", flush=True)
        if r["compute_start_ms"] > 0.5:
            calls = mr["longest_host_call_ms"]
            worst = max(calls, key=calls.get) if calls else "?"
            print(f"  the GEMMs started {r['compute_start_ms']:.1f} ms late: the host was held "
                  f"{r['host_submit_ms']:.0f} ms submitting (gap {args.gap_ms:.0f} ms), longest single call "
                  f"{calls.get(worst, 0.0):.1f} ms ({worst})", flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "gemm_ms": t_gemm, "transfers": m, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
