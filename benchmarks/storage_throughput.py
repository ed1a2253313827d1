"""L3 throughput: batch set / get in GB/s per backend, each next to a raw baseline of the same bytes.

Backends: Redis (one instance), Redis Cluster (3 masters) -- both started by this script on loopback
ports -- and the file store (a temporary directory, or ``--file-root``). Baselines, in the same run:

* Redis: a plain redis-py pipeline (``SET``/``GET`` of ``bytes`` values of the page size) on the same
  server(s) -- no framing, no checksums, no copy into host pages.
* File store: sequential ``open``/``write`` of one new file per page and ``open``/``readinto`` back,
  same bytes (no temporary name, no rename, no checksum).

Every backend operation goes through the real :class:`StorageBackend` API (frames, checksums,
verification on read, writing into :class:`HostPool` pages), and the bytes read back are compared with
the bytes written. Page sizes: 64 KiB, 1 MiB, 8 MiB (``--sizes``); ``--total-mib`` per size and op.

    python benchmarks/storage_throughput.py [--json out/storage_throughput.json] [--total-mib 128]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import torch
from redis.cluster import ClusterNode, RedisCluster

from hicache.layout import KVLayout
from hicache.pool import HostPool
from hicache.storage import StorageBackend, StorageContext, create_backend
from hicache.storage.frame import encode_header
from hicache.storage.redis_local import LocalRedis, LocalRedisCluster, redis_server_binary

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "8MiB": 8 << 20}


def layout_for(page_bytes: int) -> KVLayout:
    # one layer of K+V at page 16, 8 heads x 128, bf16 = 64 KiB
    layers = page_bytes // (64 << 10)
    if layers < 1 or layers * (64 << 10) != page_bytes:
        raise ValueError(f"page size must be a multiple of 64 KiB, got {page_bytes}")
    return KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)


def batches(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


class Case:
    """One side of a comparison: ``reset`` (untimed: remove what ``set_all`` stores), ``set_all``, ``get_all``."""

    def reset(self) -> None:
        raise NotImplementedError

    def set_all(self) -> None:
        raise NotImplementedError

    def get_all(self) -> None:
        raise NotImplementedError

    def before_get(self) -> None:
        """Untimed: clear what ``get_all`` fills."""

    def check_get(self) -> None:
        """Untimed: verify what ``get_all`` returned."""


class BackendCase(Case):
    """The real backend: framing, checksums, verification, pages written into host pool pages."""

    def __init__(self, backend: StorageBackend, src: HostPool, dst: HostPool, keys: list[bytes], batch: int) -> None:
        self.b, self.src, self.dst, self.keys, self.batch = backend, src, dst, keys, batch
        self.idx = list(range(len(keys)))

    def reset(self) -> None:
        self.b.delete(self.keys)

    def set_all(self) -> None:
        for lo, hi in batches(len(self.keys), self.batch):
            got = self.b.batch_set(self.keys[lo:hi], self.src, self.idx[lo:hi])
            assert got == hi - lo, f"batch_set stored {got}/{hi - lo}"

    def before_get(self) -> None:
        self.dst.buffer.zero_()

    def get_all(self) -> None:
        for lo, hi in batches(len(self.keys), self.batch):
            got = self.b.batch_get(self.keys[lo:hi], self.dst, self.idx[lo:hi])
            assert got == hi - lo, f"batch_get read {got}/{hi - lo}"

    def check_get(self) -> None:
        assert torch.equal(self.src.buffer.view(torch.uint8), self.dst.buffer.view(torch.uint8)), "bytes differ"


class RedisRawCase(Case):
    """Plain redis-py pipelines of the same bytes (values prebuilt as ``bytes``)."""

    def __init__(self, client: redis.Redis | RedisCluster, values: list[bytes], batch: int) -> None:
        self.c, self.values, self.batch = client, values, batch
        self.keys = [f"raw:{{{i}}}".encode() for i in range(len(values))]

    def reset(self) -> None:
        for lo, hi in batches(len(self.keys), 1000):
            p = self.c.pipeline(transaction=False)
            for k in self.keys[lo:hi]:
                p.delete(k)
            p.execute()

    def set_all(self) -> None:
        for lo, hi in batches(len(self.keys), self.batch):
            p = self.c.pipeline(transaction=False)
            for k, v in zip(self.keys[lo:hi], self.values[lo:hi], strict=True):
                p.set(k, v)
            p.execute()

    def get_all(self) -> None:
        n = len(self.values[0])
        for lo, hi in batches(len(self.keys), self.batch):
            p = self.c.pipeline(transaction=False)
            for k in self.keys[lo:hi]:
                p.get(k)
            assert all(v is not None and len(v) == n for v in p.execute())


class FileRawCase(Case):
    """Sequential ``open``/``write`` of one new file per page, ``open``/``readinto`` back."""

    def __init__(self, root: Path, src: HostPool, dst: HostPool, n: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.paths = [root / f"{i}.bin" for i in range(n)]
        self.src, self.dst = src, dst

    def reset(self) -> None:
        for p in self.paths:
            p.unlink(missing_ok=True)

    def set_all(self) -> None:
        for i, p in enumerate(self.paths):
            with open(p, "wb") as f:
                f.write(self.src.page_view(i))

    def get_all(self) -> None:
        for i, p in enumerate(self.paths):
            with open(p, "rb", buffering=0) as f:
                f.readinto(self.dst.page_view(i))

    def before_get(self) -> None:
        self.dst.buffer.zero_()

    def check_get(self) -> None:
        assert torch.equal(self.src.buffer.view(torch.uint8), self.dst.buffer.view(torch.uint8)), "bytes differ"


def measure(ours: Case, raw: Case, repeat: int) -> tuple[float, float, float, float]:
    """Best times (ours set, raw set, ours get, raw get); the two sides alternate within every repeat so
    both see the same machine conditions."""
    best = [float("inf")] * 4
    for _ in range(repeat):
        for i, case in enumerate((ours, raw)):
            case.reset()
            t = time.perf_counter()
            case.set_all()
            best[i] = min(best[i], time.perf_counter() - t)
        for i, case in enumerate((ours, raw)):
            case.before_get()
            t = time.perf_counter()
            case.get_all()
            best[2 + i] = min(best[2 + i], time.perf_counter() - t)
            case.check_get()
    ours.reset()
    raw.reset()
    return best[0], best[1], best[2], best[3]


def checksum_ceiling_gbps(nbytes: int = 64 << 20) -> float:
    """What one core checksums per second with the frame checksum (XXH3-128): the bound on framed I/O
    per hashing core, since every page is checksummed once on write and once on read."""
    buf = os.urandom(nbytes)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        encode_header(buf, b"n" * 32, b"k" * 32)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--json", default="out/storage_throughput.json", help="where to write the results")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"page sizes among {list(SIZES)}")
    ap.add_argument("--total-mib", type=int, default=128, help="bytes moved per size, op and backend")
    ap.add_argument("--batch", type=int, default=128, help="pages per batch_set / batch_get call")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement (best is kept)")
    ap.add_argument("--file-root", default="", help="directory for the file store (default: a temp dir)")
    ap.add_argument("--backends", default="redis,cluster,file")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            ap.error(f"--sizes: unknown size {s!r}; known: {list(SIZES)}")
    wanted = {b.strip() for b in args.backends.split(",") if b.strip()}
    if wanted & {"redis", "cluster"} and redis_server_binary() is None:
        print("redis-server not found: skipping Redis", file=sys.stderr)
        wanted -= {"redis", "cluster"}

    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    tmp = Path(args.file_root) if args.file_root else Path(tempfile.mkdtemp(prefix="hicache-bench-"))
    single = LocalRedis().start() if "redis" in wanted else None
    cluster = LocalRedisCluster(3).start() if "cluster" in wanted else None
    rows: list[dict[str, Any]] = []
    try:
        for sname in sizes:
            size = SIZES[sname]
            n = max(4, (args.total_mib << 20) // size)
            lay = layout_for(size)
            src = HostPool(lay, n)
            dst = HostPool(lay, n)
            g = torch.Generator().manual_seed(size)
            src.buffer.view(torch.uint8).copy_(
                torch.randint(0, 256, src.buffer.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
            ns = hashlib.sha256(f"bench-{size}".encode()).digest()
            ctx = StorageContext(ns, lay)
            keys = [hashlib.sha256(ns + i.to_bytes(8, "little")).digest() for i in range(n)]
            values = [src.page_bytes(i) for i in range(n)]
            targets: list[tuple[str, str]] = []
            if single is not None:
                targets.append(("redis", single.url))
            if cluster is not None:
                targets.append(("cluster", cluster.url))
            if "file" in wanted:
                targets.append(("file", f"file://{tmp / 'store'}"))
            for name, url in targets:
                backend = create_backend(url, ctx)
                client: redis.Redis | RedisCluster | None = None
                raw: Case
                if name == "redis" and single is not None:
                    client = redis.Redis(port=single.port)
                    raw = RedisRawCase(client, values, args.batch)
                elif name == "cluster" and cluster is not None:
                    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", x.port) for x in cluster.nodes])
                    raw = RedisRawCase(client, values, args.batch)
                else:
                    raw = FileRawCase(tmp / "raw", src, dst, n)
                try:
                    t_set, r_set, t_get, r_get = measure(BackendCase(backend, src, dst, keys, args.batch), raw,
                                                         args.repeat)
                    st = backend.stats()
                    assert st.errors == 0 and st.corrupt_pages == 0, st
                finally:
                    backend.close()
                    if client is not None:
                        client.close()
                gb = n * size / 1e9
                rows.append({
                    "backend": name, "page": sname, "page_bytes": size, "pages": n, "bytes": n * size,
                    "set_gbps": gb / t_set, "get_gbps": gb / t_get,
                    "raw_set_gbps": gb / r_set, "raw_get_gbps": gb / r_get,
                    "set_ratio": r_set / t_set, "get_ratio": r_get / t_get,
                })
                print_row(rows[-1], header=len(rows) == 1)
            src.release()
            dst.release()
    finally:
        if single is not None:
            single.stop()
        if cluster is not None:
            cluster.stop()
        if not args.file_root:
            shutil.rmtree(tmp, ignore_errors=True)

    ceiling = checksum_ceiling_gbps()
    print(f"frame checksum (XXH3-128) on one core: {ceiling:.2f} GB/s; cpus: {os.cpu_count()}; "
          f"load average at start: {load0}")
    scaling = cluster_scaling(rows)
    for s in scaling:
        print(f"cluster scaling over one instance, {s['page']}: set x{s['set']:.2f}  get x{s['get']:.2f}")
    out = {
        "benchmark": "storage_throughput",
        "conditions": {"cpus": os.cpu_count(), "load_average_at_start": load0,
                       "checksum_gbps_one_core": ceiling, "platform": platform.platform(),
                       "python": platform.python_version(),
                       "redis_py": redis.__version__, "total_mib": args.total_mib, "batch": args.batch,
                       "repeat": args.repeat, "loopback": True},
        "rows": rows,
        "cluster_scaling": scaling,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


def print_row(r: dict[str, Any], header: bool) -> None:
    if header:
        print(f"{'backend':8} {'page':>6} {'pages':>6} | {'set GB/s':>8} {'raw':>6} {'ratio':>6} | "
              f"{'get GB/s':>8} {'raw':>6} {'ratio':>6}")
    print(f"{r['backend']:8} {r['page']:>6} {r['pages']:>6} | {r['set_gbps']:8.2f} {r['raw_set_gbps']:6.2f} "
          f"{r['set_ratio']:6.0%} | {r['get_gbps']:8.2f} {r['raw_get_gbps']:6.2f} {r['get_ratio']:6.0%}", flush=True)


def cluster_scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["backend"], r["page"]): r for r in rows}
    out = []
    for (b, page), r in by.items():
        one = by.get(("redis", page))
        if b == "cluster" and one is not None:
            out.append({"page": page, "set": r["set_gbps"] / one["set_gbps"], "get": r["get_gbps"] / one["get_gbps"]})
    return out


if __name__ == "__main__":
    sys.exit(main())
