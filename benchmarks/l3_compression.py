"""L3 page compression: stored-size ratio and write / read GB/s of each codec, per data source and store.

For each codec (``none``, ``zstd``, ``lz4``; ``--levels`` adds zstd levels), data source and store, pages
go through the real backend API (``create_backend(url, StorageContext(..., compression=...))``,
``batch_set`` / ``batch_get`` of :class:`HostPool` pages in batches of ``--batch``: frames, checksums,
compression, verification and decoding on read), and every page read back is compared with the page
written. Figures:

* ratio: page bytes / payload bytes as stored (``bytes_written / stored_bytes_written`` of the backend's
  stats; frame headers not counted). Incompressible pages are stored as they are (ratio 1.00).
* write / read GB/s of page bytes, best of ``--repeat`` runs after one untimed run, each next to the
  ``none`` codec measured in the same run, on the same data and store (codecs alternate within every
  repeat, so all see the same machine conditions): "x none" below 1 is what compression costs in
  throughput. Compression and decompression take CPU on the client (the backends' thread pools); on a
  machine of few cores that is the bound, so compare "x none" on a machine like the one that will serve.
  Absolute GB/s on a shared or virtual machine vary from run to run by tens of percent; the ratios,
  measured side by side, less.
* Redis only: the server's memory for the pages (``MEMORY USAGE`` summed over the keys) relative to
  ``none``; the JSON also has the ``used_memory`` growth of ``INFO memory``. It includes the allocator's
  rounding to its size classes (jemalloc's are 1/4 of a power of two apart: a frame just over 256 KiB takes
  320 KiB), so it can differ from 1 / ratio either way; the bytes per page are printed after the table.

Stores: the file store in a temporary directory (reads come from the page cache, just written) and one
``redis-server`` on a loopback port (skipped, with a note, when ``redis-server`` is not installed).

Data sources (``--data``):

* ``decoder``: the K/V the project's reference decoder (``hicache.engine``) computes for random tokens, in
  sequences of 1024, with a small Llama-style model (GQA, RoPE) whose weights are random by seed, run in
  bf16; the decoder writes K/V into an L1 pool, copied into host pages in page-first order
  ``[L, C, S, H, D]``. Random weights are not a trained model: their K/V are close to i.i.d. Gaussian,
  without the outlier channels and structure of a trained model's, so the ratio of a real model must be
  measured on its own pages. A node shows it: ``hicache_storage_written_bytes_total /
  hicache_storage_stored_written_bytes_total``.
* ``gaussian``: bf16 values N(0, 1) times a per-channel scale (one per layer, K/V, head and head_dim
  channel) drawn log-normal, so a few channels are outliers: the shape of real K caches.
* ``random``: uniform random bytes, incompressible: every codec stores the pages as they are, so its
  columns show what the trial compression costs.

Page: 4 layers x K/V x 16 tokens x 8 KV heads x 128 x bf16 = 256 KiB (``--layers``: 64 KiB per layer).

    python benchmarks/l3_compression.py [--json out/l3_compression.json] [--total-mib 64] [--levels 1,3,9]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow
import redis
import torch

from hicache.engine import ModelShape, make_batch
from hicache.engine.model import Decoder
from hicache.layout import KVLayout
from hicache.pool import DevicePool, HostPool, format_bytes
from hicache.storage import StorageBackend, StorageContext, create_backend
from hicache.storage.redis_backend import RedisBackend
from hicache.storage.redis_local import LocalRedis, redis_server_binary

DATA = ("decoder", "gaussian", "random")
STORES = ("file", "redis")
SEQ = 1024  # decoder tokens per sequence


def decoder_shape(layers: int) -> ModelShape:
    return ModelShape(vocab_size=8192, hidden=1024, num_layers=layers, num_q_heads=16, num_kv_heads=8,
                      head_dim=128, ffn=2048)


def fill(pool: HostPool, data: str, seed: int) -> None:
    """Write ``data`` into every page of ``pool`` (page-first)."""
    lay, n = pool.layout, pool.num_pages
    g = torch.Generator().manual_seed(seed)
    if data == "random":
        raw = pool.buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    elif data == "gaussian":
        L, C, (S, H, D) = lay.num_layers, lay.kv_count, lay.page_shape
        scale = torch.randn(L, C, 1, H, D, generator=g).exp_()  # log-normal, sigma 1: a few channels ~10x
        for p in range(n):
            pool.buffer[p].copy_(torch.randn(L, C, S, H, D, generator=g).mul_(scale))
    elif data == "decoder":
        model = Decoder.random(decoder_shape(lay.num_layers), seed=seed, dtype=torch.bfloat16)
        l1 = DevicePool(lay, n)
        per_seq = SEQ // lay.page_size
        for lo in range(0, n, per_seq):
            pages = torch.arange(lo, min(lo + per_seq, n))
            toks = torch.randint(0, model.shape.vocab_size, (len(pages) * lay.page_size,), generator=g).tolist()
            model.forward_paged(make_batch([toks], [0], [pages], lay.page_size, torch.device("cpu")), l1.kv)
        for layer in range(lay.num_layers):
            for c in range(lay.kv_count):
                pool.layer_view(layer, c).copy_(l1.kv[layer][c])
    else:
        raise ValueError(f"unknown data source {data!r}")


def batches(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def redis_memory(backend: StorageBackend, client: redis.Redis, keys: list[bytes]) -> int:
    """Bytes the server holds for ``keys`` (``MEMORY USAGE``, values and key overhead)."""
    assert isinstance(backend, RedisBackend)
    p = client.pipeline(transaction=False)
    for k in keys:
        p.execute_command("MEMORY", "USAGE", backend.redis_key(k), "SAMPLES", "0")
    return sum(int(x or 0) for x in p.execute())


class Case:
    """One codec on one store and data source: its backend, keys and best times."""

    def __init__(self, label: str, codec: str, level: int, url: str, lay: KVLayout, data: str, n: int) -> None:
        self.label, self.codec, self.level = label, codec, level
        ns = hashlib.sha256(f"l3c-{data}-{label}".encode()).digest()
        self.keys = [hashlib.sha256(ns + i.to_bytes(8, "little")).digest() for i in range(n)]
        self.backend = create_backend(url, StorageContext(ns, lay, compression=codec, compression_level=level))
        self.t_set = self.t_get = float("inf")
        self.mem = self.used_memory = 0


def run_case(c: Case, src: HostPool, dst: HostPool, batch: int, client: redis.Redis | None, where: str
             ) -> tuple[float, float]:
    """One run: write every page, read them back, compare with what was written; returns the seconds of
    the writes and of the reads."""
    idx = list(range(src.num_pages))

    def timed(op: Callable[[list[bytes], HostPool, list[int]], int], pool: HostPool, what: str) -> float:
        t = time.perf_counter()
        for lo, hi in batches(len(idx), batch):
            got = op(c.keys[lo:hi], pool, idx[lo:hi])
            if got != hi - lo:
                raise RuntimeError(f"{where}: {what} {got}/{hi - lo} pages")
        return time.perf_counter() - t

    c.backend.delete(c.keys)
    used0 = int(client.info("memory")["used_memory"]) if client is not None else 0
    t_set = timed(c.backend.batch_set, src, "batch_set stored")
    if client is not None:
        c.used_memory = int(client.info("memory")["used_memory"]) - used0
        c.mem = redis_memory(c.backend, client, c.keys)
    dst.buffer.view(torch.uint8).fill_(0xA5)
    t_get = timed(c.backend.batch_get, dst, "batch_get read")
    if not torch.equal(src.buffer.view(torch.uint8), dst.buffer.view(torch.uint8)):
        raise RuntimeError(f"{where}: the pages read back differ from the pages written")
    return t_set, t_get


def measure(cases: list[Case], src: HostPool, dst: HostPool, args: argparse.Namespace, store: str, data: str,
            client: redis.Redis | None) -> list[dict[str, Any]]:
    for rep in range(args.repeat + 1):  # the first run warms up (directories, connections, threads): untimed
        for c in cases:
            t_set, t_get = run_case(c, src, dst, args.batch, client, f"{store}/{data}/{c.label}")
            if rep:
                c.t_set, c.t_get = min(c.t_set, t_set), min(c.t_get, t_get)
    rows: list[dict[str, Any]] = []
    gb = src.nbytes / 1e9
    base = cases[0]  # none
    for c in cases:
        st = c.backend.stats()
        c.backend.delete(c.keys)
        c.backend.close()
        if st.errors or st.corrupt_pages or st.stored_bytes_read != st.stored_bytes_written:
            raise RuntimeError(f"{store}/{data}/{c.label}: unexpected stats {st}")
        rows.append({
            "store": store, "data": data, "codec": c.label, "compression": c.codec, "level": c.level,
            "pages": src.num_pages, "bytes": src.nbytes, "stored_bytes": st.stored_bytes_written // (args.repeat + 1),
            "ratio": st.bytes_written / st.stored_bytes_written,
            "write_gbps": gb / c.t_set, "write_x_none": base.t_set / c.t_set,
            "read_gbps": gb / c.t_get, "read_x_none": base.t_get / c.t_get,
            "redis_memory_bytes": c.mem if client else None,
            "redis_used_memory_growth": c.used_memory if client else None,
            "redis_memory_vs_none": c.mem / base.mem if client and base.mem else None,
        })
    return rows


def print_row(r: dict[str, Any] | None) -> None:
    if r is None:
        print(f"{'store':6} {'data':9} {'codec':8} | {'ratio':>6} | {'write GB/s':>10} {'x none':>7} | "
              f"{'read GB/s':>9} {'x none':>7} | {'redis mem vs none':>17}")
        return
    mem = f"{r['redis_memory_vs_none']:.3f}" if r["redis_memory_vs_none"] is not None else "-"
    print(f"{r['store']:6} {r['data']:9} {r['codec']:8} | {r['ratio']:6.3f} | {r['write_gbps']:10.3f} "
          f"{r['write_x_none']:7.2f} | {r['read_gbps']:9.3f} {r['read_x_none']:7.2f} | {mem:>17}", flush=True)


def split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--json", default="", help="write all rows and the settings to this path")
    ap.add_argument("--data", default=",".join(DATA), help=f"data sources among {list(DATA)}")
    ap.add_argument("--stores", default=",".join(STORES), help=f"stores among {list(STORES)}")
    ap.add_argument("--codecs", default="none,zstd,lz4", help="codecs (none is always measured: the baseline)")
    ap.add_argument("--levels", default="", help="zstd levels, e.g. 1,3,9 (default: the codec's default)")
    ap.add_argument("--total-mib", type=int, default=64, help="page bytes per case")
    ap.add_argument("--layers", type=int, default=4, help="layers per page (64 KiB each)")
    ap.add_argument("--batch", type=int, default=32, help="pages per batch_set / batch_get call")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is kept)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    datas, stores = split(args.data), split(args.stores)
    for v, known, flag in ((datas, DATA, "--data"), (stores, STORES, "--stores")):
        if not v or set(v) - set(known):
            ap.error(f"{flag}: choose among {list(known)}")
    levels = [int(x) for x in split(args.levels)] or [0]
    codecs: list[tuple[str, str, int]] = [("none", "none", 0)]
    for name in split(args.codecs):
        if name == "zstd":
            codecs += [("zstd" if lv == 0 else f"zstd:{lv}", "zstd", lv) for lv in levels]
        elif name != "none":
            codecs.append((name, name, 0))
    if "redis" in stores and redis_server_binary() is None:
        print("note: redis-server not found: skipping the Redis store", file=sys.stderr)
        stores.remove("redis")

    lay = KVLayout(num_layers=args.layers, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    n = max(args.batch, (args.total_mib << 20) // lay.bytes_per_page)
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"page {format_bytes(lay.bytes_per_page)} ({lay.num_layers} layers x K/V x {lay.page_size} tokens x "
          f"{lay.num_kv_heads} heads x {lay.head_dim} x bf16), {n} pages = {format_bytes(n * lay.bytes_per_page)} "
          f"per case, batch {args.batch}, best of {args.repeat}; machine {platform.machine()}, "
          f"{os.cpu_count()} cpus, load {load0}")
    tmp = Path(tempfile.mkdtemp(prefix="hicache-l3c-"))
    server = LocalRedis().start() if "redis" in stores else None
    client = server.client() if server is not None else None
    rows: list[dict[str, Any]] = []
    src, dst = HostPool(lay, n), HostPool(lay, n)
    try:
        print_row(None)
        for data in datas:
            t = time.perf_counter()
            fill(src, data, args.seed)
            if data == "decoder":
                print(f"  (decoder: {n * lay.page_size} random tokens through a random-weight model, "
                      f"{time.perf_counter() - t:.1f} s)", flush=True)
            for store in stores:
                url = server.url if store == "redis" and server is not None else f"file://{tmp / 'store'}"
                cases = [Case(label, codec, lv, url, lay, data, n) for label, codec, lv in codecs]
                for r in measure(cases, src, dst, args, store, data, client if store == "redis" else None):
                    rows.append(r)
                    print_row(r)
    finally:
        src.release()
        dst.release()
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    for data in datas:
        mem = [f"{r['codec']} {format_bytes(r['redis_memory_bytes'] / r['pages'])}" for r in rows
               if r["store"] == "redis" and r["data"] == data]
        if mem:
            print(f"redis server memory per {format_bytes(lay.bytes_per_page)} page, {data}: {', '.join(mem)}")
    if args.json:
        out = {
            "benchmark": "l3_compression",
            "settings": {"page_bytes": lay.bytes_per_page, "layout": lay.describe(), "pages": n,
                         "total_mib": args.total_mib, "batch": args.batch, "repeat": args.repeat,
                         "codecs": [c[0] for c in codecs], "data": datas, "stores": stores, "seed": args.seed,
                         "decoder_shape": str(decoder_shape(args.layers)), "decoder_seq": SEQ},
            "conditions": {"machine": platform.machine(), "cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "pyarrow": pyarrow.__version__, "redis_py": redis.__version__,
                           "load_average_at_start": load0},
            "rows": rows,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
