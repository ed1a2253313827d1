"""SGLang's HiCache storage tier through hicache: pages/s and GB/s of the engine adapter
(:class:`hicache.integrations.sglang.HiCacheStore`) next to two baselines measured in the same run.

Needs the released SGLang wheel (``bash scripts/engine_env.sh``; run with ``.venv-engines/bin/python``).
Pages live in SGLang's own CPU host pool (``MHATokenToKVPoolHost``, bf16) in each memory layout
(``--layouts``); the default page is one TP-4 shard of an 8B Llama-like model (32 layers x 2 KV heads x
128, 64 tokens per page = 2 MiB). Every path is driven as SGLang's cache controller drives it, one
``--batch`` of pages per call (the controller's ``STORAGE_BATCH_SIZE`` is 128):

* ``hicache v1``: the adapter built by SGLang's own ``StorageBackendFactory`` (``dynamic``,
  ``interface_v1: 1``), ``batch_set_v1`` / ``batch_get_v1`` against the host pool in place (what
  ``_page_set_zero_copy`` / ``_page_get_zero_copy`` call). The reader is a second backend on another pool
  of the same shape, as another process would be.
* ``raw backend`` (baseline 1): hicache's storage backend for the same URL called directly, the calls
  :class:`~hicache.integrations.store.EngineStore` makes (per io batch ``batch_exists`` then
  ``batch_set``; ``batch_get``) on the same pieces of the same pool, storage keys computed beforehand: no
  SGLang adapter, no key hashing, no pointer lookups. ``adapter/raw`` (target >= 0.90) is what the
  adapter costs.
* ``sglang file`` (baseline 2): SGLang's own ``file`` backend (``HiCacheFile``) through its generic path,
  the only one it implements for KV pages: ``get_data_page`` per page into ``batch_set``;
  ``get_dummy_flat_data_page`` per page, ``batch_get``, ``set_from_flat_data_page`` (the controller's
  ``_generic_page_set`` / ``_generic_page_get``).
* ``hicache flat``: the adapter with ``interface_v1: 0`` through that same generic path: the backend
  alone against ``HiCacheFile``, with SGLang's copies on both sides.

Stores: hicache's file store in a temporary directory (``--dir``; ``--url`` for another hicache store,
e.g. ``redis://127.0.0.1:6379/0``); ``HiCacheFile`` always in a directory beside it. Neither syncs to disk:
writes land in the page cache and reads are page-cache warm (this script cannot drop the OS cache).
Every round writes fresh keys (writes skip pages already stored) and deletes its pages afterwards
(untimed). Within a round the paths run in two pairs, the adapter beside its raw backend, then SGLang's
file backend beside the adapter's flat path; the two of a pair take turns batch by batch (which goes first
alternates), so both see the same machine conditions, and each path's time is the sum of its own calls.
Figures are medians over ``--rounds`` (after an untimed warm-up batch). ``adapter/raw`` is the median
over all batches of the ratio of the two calls made one after the other; the ratios to SGLang's file
backend are medians of the rounds' ratios. ``adapter CPU`` is the adapter's own work per batch, measured
apart without I/O (the pieces of the pages from the pool, the storage keys, the page-buffer check), and
its share of the raw backend's batch time: a cost that a noisy machine neither hides nor inflates.

After every round each path's destination pool is compared byte for byte with the source pool (whole
buffers); a difference, a short read or write, or an error or damaged page in a store's counters aborts
with exit status 1 (``--inject-fault`` flips one byte after the first round's reads, to show that check
fails). Without SGLang the script exits with status 2.

On a virtual machine whose memory is backed lazily by the host, touching fresh memory (the page cache of
new files, SGLang's per-page tensors) costs much more than on bare metal, and varies from round to round;
the side-by-side ratios vary less than the absolute figures.

    .venv-engines/bin/python benchmarks/engine_storage.py [--layouts page_first,layer_first,page_first_direct]
        [--layers 32] [--heads 2] [--head-dim 128] [--page-size 64] [--pages 128] [--batch 64]
        [--rounds 7] [--url URL] [--dir DIR] [--json out/engine_storage.json]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache.layout import KVLayout
from hicache.storage import StorageBackend, StorageContext, create_backend
from hicache.storage.base import safe_url
from hicache.storage.pageio import PageBuffers

LAYOUTS = ("page_first", "layer_first", "page_first_direct")
MODEL = "bench/llama-8b"
ADAPTER = {"backend_name": "hicache", "module_path": "hicache.integrations.sglang", "class_name": "HiCacheStore"}


class RoundTripError(RuntimeError):
    """A read returned other bytes than were written (or fewer pages)."""


# ---------------------------------------------------------------------- SGLang objects
# SGLang's classes as the engine tests build them (the torchvision / sgl_kernel import stubs, the pools)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
import sglang_kit  # noqa: E402

DEVICE = "cpu"  # where the "device" KV pool lives (--cuda: a CUDA pool, the host pool pinned)


def load_sglang() -> str | None:
    """Import SGLang's storage and host-pool modules; None, or why they cannot be imported."""
    if not sglang_kit.sglang_available():
        return "sglang is not installed"
    try:
        sglang_kit.load_sglang()
    except ImportError as e:
        return f"sglang does not import ({e})"
    return None


def mha_pool(layout: str, layers: int, heads: int, dim: int, page: int, pages: int) -> Any:
    """SGLang's ``MHATokenToKVPoolHost`` (bf16) of ``pages`` pages plus its padding page 0."""
    return sglang_kit.mha_pool(layout, layers=layers, heads=heads, dim=dim, page=page, tokens=page,
                               device=DEVICE, pin=DEVICE == "cuda", host_tokens=(pages + 1) * page)


def storage_config(extra: dict[str, Any], page_first: bool) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=page_first,
                                model_name=MODEL, extra_config=extra)


def sglang_backend(name: str, extra: dict[str, Any], pool: Any) -> Any:
    """A storage backend as SGLang's controller builds it: the factory, then the host pool registered."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    b = StorageBackendFactory.create_backend(name, storage_config(extra, pool.layout != "layer_first"), pool)
    b.register_mem_pool_host(pool)
    return b


def fill_random(pool: Any, seed: int) -> None:
    """Random bytes in the whole pool, then page 0 (SGLang's padding page, never stored) zeroed."""
    flat = pool.kv_buffer.view(torch.uint8).reshape(-1).numpy()
    rng = np.random.default_rng(seed)
    step = 64 << 20
    for lo in range(0, len(flat), step):
        hi = min(lo + step, len(flat))
        flat[lo:hi] = np.frombuffer(rng.bytes(hi - lo), dtype=np.uint8)
    pool.get_data_page(0, flat=False).zero_()


def pieces(pool: Any, host_indices: torch.Tensor) -> list[list[memoryview]]:
    """Each page's pieces (``get_page_buffer_meta``) as writable byte views into the pool."""
    buf = pool.kv_buffer
    base, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
    mem = memoryview((ctypes.c_char * nbytes).from_address(base)).cast("B")
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    n = len(host_indices) // pool.page_size
    k = len(ptrs) // n
    return [[mem[p - base:p - base + s] for p, s in zip(ptrs[i * k:(i + 1) * k], sizes[i * k:(i + 1) * k],
                                                          strict=True)] for i in range(n)]


class Pieces(PageBuffers):
    """Pages of an SGLang pool as hicache page buffers: the pieces, looked up once, beforehand."""

    zero_copy = True

    def __init__(self, pages: list[list[memoryview]], page_bytes: int) -> None:
        self._pages, self.page_bytes = pages, page_bytes

    def source(self, page: int) -> list[memoryview]:
        return self._pages[page]

    def target(self, page: int) -> list[memoryview]:
        return self._pages[page]


# ---------------------------------------------------------------------- the paths
class Case:
    """One way of moving a run of pages: ``set_batch`` / ``get_batch`` of pages ``lo:hi`` (page counts
    returned), ``delete`` (untimed), ``check`` (untimed: the store's own counters), ``close``."""

    name = ""
    dst: Any  # the SGLang pool its reads land in

    def set_batch(self, keys: list[str], idx: torch.Tensor, lo: int, hi: int) -> int:
        raise NotImplementedError

    def get_batch(self, keys: list[str], idx: torch.Tensor, lo: int, hi: int) -> int:
        raise NotImplementedError

    def delete(self, keys: list[str]) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Untimed: the store's counters say no error, no damaged page and no skipped write."""

    def close(self) -> None:
        pass


def _extra_info() -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=None)


def _check_store(name: str, stats: dict[str, float]) -> None:
    bad = {k: stats.get(k, 0.0) for k in ("errors", "corrupt_pages", "skipped_writes") if stats.get(k, 0.0)}
    if bad:
        raise RoundTripError(f"{name}: the store counted {bad}")


class AdapterV1(Case):
    """The adapter's zero-copy path, as ``_page_set_zero_copy`` / ``_page_get_zero_copy`` call it."""

    name = "hicache v1"

    def __init__(self, store: dict[str, Any], src: Any, dst: Any) -> None:
        cfg = {**ADAPTER, "interface_v1": 1, **store}
        self.dst = dst
        self.writer = sglang_backend("dynamic", cfg, src)
        self.reader = sglang_backend("dynamic", cfg, dst)  # another process: its own backend and pool

    def set_batch(self, keys: list[str], idx: torch.Tensor, lo: int, hi: int) -> int:
        ps = self.writer.view.page_size
        ok = all(self.writer.batch_set_v1(keys[lo:hi], idx[lo * ps:hi * ps], _extra_info()))
        return hi - lo if ok else 0

    def get_batch(self, keys: list[str], idx: torch.Tensor, lo: int, hi: int) -> int:
        ps = self.reader.view.page_size
        res = self.reader.batch_get_v1(keys[lo:hi], idx[lo * ps:hi * ps], _extra_info())
        n = 0
        for r in res:
            if not r:
                break
            n += 1
        return n

    def delete(self, keys: list[str]) -> None:
        self.writer.store.delete([bytes.fromhex(k) for k in keys])

    def check(self) -> None:
        for b in (self.writer, self.reader):
            _check_store(self.name, b.store.stats())

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


class RawBackend(Case):
    """hicache's storage backend called directly with EngineStore's calls (exists + set per io batch,
    get), on the same pool pieces, storage keys computed beforehand."""

    name = "raw backend"

    def __init__(self, url: str, layout: KVLayout, src: Any, dst: Any, idx: torch.Tensor, io_batch: int) -> None:
        self.ns = hashlib.sha256(b"engine_storage raw baseline").digest()
        self.b: StorageBackend = create_backend(url, StorageContext(self.ns, layout, MODEL))
        self.dst = dst
        self._src = Pieces(pieces(src, idx), layout.bytes_per_page)
        self._dst = Pieces(pieces(dst, idx), layout.bytes_per_page)
        self.io_batch = io_batch
        self._sk: dict[str, bytes] = {}

    def prepare(self, keys: list[str]) -> None:
        """Untimed: the storage keys of ``keys`` (the adapter hashes them inside its calls)."""
        self._sk = {k: hashlib.sha256(self.ns + bytes.fromhex(k)).digest() for k in keys}
        self._keys = [self._sk[k] for k in keys]

    def set_batch(self, keys: list[str], idx: torch.Tensor, lo: int, hi: int) -> int:
        sk, done = self._keys, 0
        for a in range(lo, hi, self.io_batch):
            b = min(a + self.io_batch, hi)
            have = self.b.batch_exists(sk[a:b])
            got = have + (self.b.batch_set(sk[a + have:b], self._src, range(a + have, b)) if have < b - a else 0)
            done += got
            if got < b - a:
                break
        return done

    def get_batch(self, keys: list[str], idx: torch.Tensor, lo: int, hi: int) -> int:
        sk, done = self._keys, 0
        for a in range(lo, hi, self.io_batch):
            b = min(a + self.io_batch, hi)
            got = self.b.batch_get(sk[a:b], self._dst, range(a, b))
            done += got
            if got < b - a:
                break
        return done

    def delete(self, keys: list[str]) -> None:
        self.b.delete([self._sk[k] for k in keys])

    def check(self) -> None:
        st = self.b.stats()
        _check_store(self.name, {"errors": st.errors, "corrupt_pages": st.corrupt_pages})

    def close(self) -> None:
        self.b.close()


class GenericPath(Case):
    """A backend through SGLang's generic page path (``_generic_page_set`` / ``_generic_page_get``): flat
    page tensors copied out of the source pool, dummy pages read into and copied into the destination."""

    def __init__(self, name: str, backend: Any, src: Any, dst: Any, file_dir: Path | None = None) -> None:
        self.name, self.backend, self.src, self.dst, self.file_dir = name, backend, src, dst, file_dir

    def set_batch(self, keys: list[str], idx: torch.Tensor, lo: int, hi: int) -> int:
        ps, pool = self.src.page_size, self.src
        host_indices = idx[lo * ps:hi * ps]
        data = [pool.get_data_page(host_indices[i * ps]) for i in range(hi - lo)]
        return hi - lo if self.backend.batch_set(keys[lo:hi], data) else 0

    def get_batch(self, keys: list[str], idx: torch.Tensor, lo: int, hi: int) -> int:
        ps, pool = self.dst.page_size, self.dst
        host_indices = idx[lo * ps:hi * ps]
        hash_values = keys[lo:hi]
        dummy_page_dst = [pool.get_dummy_flat_data_page() for _ in hash_values]
        page_data = self.backend.batch_get(hash_values, dummy_page_dst)
        if page_data is None:
            return 0
        count = 0
        for i in range(len(hash_values)):
            if page_data[i] is None:
                break
            pool.set_from_flat_data_page(host_indices[i * ps], page_data[i])
            count += 1
        return count

    def delete(self, keys: list[str]) -> None:
        if self.file_dir is not None:  # HiCacheFile: the only files in its directory
            for e in os.scandir(self.file_dir):
                if e.name.endswith(".bin"):
                    os.unlink(e.path)
        else:
            self.backend.store.delete([bytes.fromhex(k) for k in keys])

    def check(self) -> None:
        if self.file_dir is None:
            _check_store(self.name, self.backend.store.stats())

    def close(self) -> None:
        if hasattr(self.backend, "close"):
            self.backend.close()


# ---------------------------------------------------------------------- measuring
def fresh_keys(tag: str, n: int) -> list[str]:
    """SGLang-style page keys (hex sha256), unique to ``tag``."""
    return [hashlib.sha256(f"{tag}:{i}".encode()).hexdigest() for i in range(n)]


def batches(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def verify(src: Any, dst: Any, what: str) -> int:
    """Both pools' whole buffers byte for byte (page 0 is zero in both); the bytes compared."""
    a, b = src.kv_buffer.view(torch.uint8), dst.kv_buffer.view(torch.uint8)
    if not torch.equal(a, b):
        raise RoundTripError(f"{what}: {int((a != b).sum())} byte(s) read back differ from what was written")
    return a.numel()


def flip_one_byte(pool: Any) -> None:
    """Damage the first byte of page 1 (for ``--inject-fault``)."""
    ptr = pool.get_page_buffer_meta(torch.arange(pool.page_size, 2 * pool.page_size))[0][0]
    b = ctypes.c_ubyte.from_address(ptr)
    b.value ^= 0xFF


class Layout:
    """The four paths on one memory layout: one source pool, two destination pools; the paths run in two
    pairs, each pair side by side: the adapter and its raw backend, then SGLang's file backend and the
    adapter's flat path."""

    def __init__(self, layout: str, args: argparse.Namespace, root: Path) -> None:
        from hicache.config import StorageConfig

        self.layout, self.batch, ps, n = layout, args.batch, args.page_size, args.pages
        shape = (args.layers, args.heads, args.head_dim, ps, n)
        self.src = mha_pool(layout, *shape)
        fill_random(self.src, 1)
        dst = [mha_pool(layout, *shape) for _ in range(2)]
        kvl = KVLayout(args.layers, args.heads, args.head_dim, "bfloat16", ps, "mha")
        self.page_bytes = kvl.bytes_per_page
        self.idx = torch.arange(ps, (n + 1) * ps, dtype=torch.int64)  # pages 1..n (0: SGLang's padding page)
        store = {"url": args.url or f"file://{root / 'hicache' / layout}"}
        sg_dir = root / "sglang" / layout
        self.cases: list[Case] = []
        try:
            self.cases.append(AdapterV1(store, self.src, dst[0]))
            self.cases.append(RawBackend(args.url or f"file://{root / 'raw' / layout}", kvl, self.src, dst[1],
                                         self.idx, StorageConfig().io_batch_pages))
            self.cases.append(GenericPath("sglang file", sglang_backend("file", {"file_storage_path": str(sg_dir)},
                                                                        self.src), self.src, dst[0], sg_dir))
            self.cases.append(GenericPath("hicache flat", sglang_backend(
                "dynamic", {**ADAPTER, "interface_v1": 0, **store}, self.src), self.src, dst[1]))
        except BaseException:
            self.close()
            raise
        self.pairs = (self.cases[:2], self.cases[2:])
        self.times: dict[str, dict[str, list[float]]] = {p.name: {"set": [], "get": []} for p in self.cases}
        self.batch_times: dict[str, dict[str, list[float]]] = {p.name: {"set": [], "get": []} for p in self.cases}

    def round(self, tag: str, pages: int, first: int, verified: dict[str, int] | None = None,
              fault: bool = False) -> None:
        """Each pair in turn: both paths write ``pages`` fresh pages, then read them back, batch by batch
        in turns (which goes first alternates with ``first`` and the batch), timed per path; then each
        destination pool is compared with the source (untimed) and the pages are deleted. Recorded and
        compared unless ``verified`` is None (a warm-up)."""
        idx = self.idx
        for cases in self.pairs:
            keys = {p.name: fresh_keys(f"{self.layout}:{p.name}:{tag}:{time.monotonic_ns()}", pages) for p in cases}
            for p in cases:
                if isinstance(p, RawBackend):
                    p.prepare(keys[p.name])
                p.dst.kv_buffer.zero_()
            for op in ("set", "get"):
                spent: dict[str, list[float]] = {name: [] for name in keys}
                for b, (lo, hi) in enumerate(batches(pages, self.batch)):
                    for p in cases if (first + b) % 2 == 0 else cases[::-1]:
                        fn = p.set_batch if op == "set" else p.get_batch
                        t = time.perf_counter()
                        got = fn(keys[p.name], idx, lo, hi)
                        spent[p.name].append(time.perf_counter() - t)
                        if got != hi - lo:
                            raise RoundTripError(f"{p.name} ({self.layout}, {tag}) {op}: pages {lo}:{hi}: {got} "
                                                 f"of {hi - lo} done")
                if verified is not None:
                    for name, sec in spent.items():
                        self.times[name][op].append(sum(sec))
                        self.batch_times[name][op].extend(sec)
            if fault:
                flip_one_byte(cases[0].dst)
                fault = False
            for p in cases:
                if verified is not None:  # (a warm-up reads part of the pool)
                    verified["bytes"] += verify(self.src, p.dst, f"{p.name} ({self.layout}, {tag})")
                    verified["pages"] += pages
                    verified["runs"] += 1
                p.check()
                p.delete(keys[p.name])

    def adapter_cpu(self, reps: int = 20) -> float:
        """Seconds of the adapter's own work per batch before any I/O: placing its pages' pieces in the
        pool (offsets, bounds; the byte views are made by the store's I/O threads, inside the timed
        batches), the storage keys, the page-buffer check."""
        from hicache.integrations.store import EngineBuffers

        w = self.cases[0].writer  # type: ignore[attr-defined]
        n = min(self.batch, len(self.idx) // self.src.page_size)
        hi = self.idx[:n * self.src.page_size]
        kb = [bytes.fromhex(k) for k in fresh_keys("cpu", n)]
        t = time.perf_counter()
        for _ in range(reps):
            EngineBuffers(w.view.pages(hi), w.store.page_bytes)
            w.store.storage_keys(kb)
        return (time.perf_counter() - t) / reps

    def rows(self) -> list[dict[str, Any]]:
        out = []
        n = len(self.idx) // self.src.page_size
        for name, t in self.times.items():
            t_set, t_get = statistics.median(t["set"]), statistics.median(t["get"])
            out.append({"layout": self.layout, "path": name, "pages": n, "page_bytes": self.page_bytes,
                        "set_s": t_set, "get_s": t_get, "set_pages_per_s": n / t_set, "get_pages_per_s": n / t_get,
                        "set_gbps": n * self.page_bytes / t_set / 1e9, "get_gbps": n * self.page_bytes / t_get / 1e9,
                        "set_s_rounds": t["set"], "get_s_rounds": t["get"],
                        "set_s_batches": self.batch_times[name]["set"], "get_s_batches": self.batch_times[name]["get"]})
        return out

    def ratios(self) -> dict[str, Any]:
        """Throughput ratios: adapter / raw (1.0 = the adapter costs nothing) the median over the batches
        of the two side by side, batch for batch; hicache over SGLang's file backend (x faster) the median
        over rounds of the round's ratio."""
        t, bt = self.times, self.batch_times

        def med(num: str, den: str, op: str, by: dict[str, dict[str, list[float]]] = t) -> float:
            return statistics.median(a / b for a, b in zip(by[num][op], by[den][op], strict=True))

        nb = len(batches(len(self.idx) // self.src.page_size, self.batch))
        cpu = self.adapter_cpu()
        return {"layout": self.layout,
                "adapter_cpu_ms_per_batch": cpu * 1e3,
                "adapter_cpu_share_set": cpu * nb / statistics.median(t["raw backend"]["set"]),
                "adapter_cpu_share_get": cpu * nb / statistics.median(t["raw backend"]["get"]),
                "adapter_over_raw_set": med("raw backend", "hicache v1", "set", bt),
                "adapter_over_raw_get": med("raw backend", "hicache v1", "get", bt),
                "v1_over_sglang_file_set": med("sglang file", "hicache v1", "set"),
                "v1_over_sglang_file_get": med("sglang file", "hicache v1", "get"),
                "flat_over_sglang_file_set": med("sglang file", "hicache flat", "set"),
                "flat_over_sglang_file_get": med("sglang file", "hicache flat", "get")}

    def close(self) -> None:
        for p in self.cases:
            p.close()


def run_layout(layout: str, args: argparse.Namespace, root: Path, verified: dict[str, int],
               fault: list[bool]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lay = Layout(layout, args, root)
    try:
        lay.round("warm-up", min(args.batch, args.pages), 0)  # untimed: thread pools, first files, code paths
        for r in range(args.rounds):
            lay.round(f"round {r + 1}", args.pages, r, verified, fault=fault[0])
            fault[0] = False
        return lay.rows(), lay.ratios()
    finally:
        lay.close()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"host pool memory layouts among {LAYOUTS}")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2, help="KV heads of this TP shard")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page")
    ap.add_argument("--pages", type=int, default=128, help="pages per run (each path, each round)")
    ap.add_argument("--batch", type=int, default=64, help="pages per backend call")
    ap.add_argument("--rounds", type=int, default=7, help="rounds (the median is reported)")
    ap.add_argument("--url", default="", help="hicache's store (default: a file store in --dir)")
    ap.add_argument("--dir", default="", help="directory for the file stores (default: a temporary one)")
    ap.add_argument("--json", default="out/engine_storage.json", help="where to write the results")
    ap.add_argument("--inject-fault", action="store_true", help="flip one byte after the first round's reads "
                    "(the round-trip check must then abort)")
    ap.add_argument("--cuda", action="store_true", help="SGLang's pools as on a GPU server: the device KV pool "
                    "in CUDA memory, the host pool pinned")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = "cuda" if args.cuda else "cpu"
    if args.cuda and not torch.cuda.is_available():
        ap.error("--cuda: no CUDA GPU here")
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    for s in layouts:
        if s not in LAYOUTS:
            ap.error(f"--layouts: unknown layout {s!r}; known: {list(LAYOUTS)}")
    for name in ("layers", "heads", "head_dim", "page_size", "pages", "batch", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1")
    why = load_sglang()
    if why is not None:
        print(f"engine_storage: {why}: run `bash scripts/engine_env.sh` and use .venv-engines/bin/python",
              file=sys.stderr)
        return 2
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # (it would override the directory)

    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hicache-engine-bench-"))
    page_bytes = KVLayout(args.layers, args.heads, args.head_dim, "bfloat16", args.page_size, "mha").bytes_per_page
    store_desc = safe_url(args.url) if args.url else f"file store in {root}"
    print(f"engine storage: MHA {args.layers} layers x {args.heads} KV heads x {args.head_dim} bf16, "
          f"{args.page_size} tokens/page = {page_bytes / (1 << 20):.2f} MiB/page; {args.pages} pages "
          f"({args.pages * page_bytes / (1 << 20):.0f} MiB) per run in batches of {args.batch}; median of "
          f"{args.rounds} rounds; {store_desc}; host pool {'pinned, device pool on CUDA' if args.cuda else 'on CPU'}; "
          f"file reads page-cache warm; {platform.machine()}, {os.cpu_count()} "
          f"cpus, load {load0}", flush=True)
    verified = {"pages": 0, "bytes": 0, "runs": 0}
    fault = [bool(args.inject_fault)]
    rows: list[dict[str, Any]] = []
    rat: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        for layout in layouts:
            lrows, q = run_layout(layout, args, root, verified, fault)
            rows.extend(lrows)
            rat.append(q)
            for r in lrows:
                print_row(r, header=r is rows[0])
    except RoundTripError as e:
        print(f"engine_storage: round trip failed: {e}", file=sys.stderr)
        return 1
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    target = 0.90
    print("ratios of throughput (adapter/raw: median of paired batches, target >= 0.90; to sglang file: median "
          "of rounds), adapter CPU per batch:")
    print(f"  {'layout':17} | adapter/raw set  get | v1/sglang-file set    get | flat/sglang-file set    get "
          f"| adapter CPU ms/batch  % set  % get")
    for q in rat:
        print(f"  {q['layout']:17} | {q['adapter_over_raw_set']:15.2f} {q['adapter_over_raw_get']:4.2f} | "
              f"{_x(q['v1_over_sglang_file_set']):>19} {_x(q['v1_over_sglang_file_get']):>6} | "
              f"{_x(q['flat_over_sglang_file_set']):>19} {_x(q['flat_over_sglang_file_get']):>6} | "
              f"{q['adapter_cpu_ms_per_batch']:20.2f} {q['adapter_cpu_share_set']:6.1%} "
              f"{q['adapter_cpu_share_get']:6.1%}")
    below = [f"{q['layout']} {op} {q[f'adapter_over_raw_{op}']:.2f}" for q in rat for op in ("set", "get")
             if q[f"adapter_over_raw_{op}"] < target]
    met = not below
    print(f"adapter/raw >= {target:.2f}: " + ("met everywhere" if met else "not met: " + ", ".join(below)))
    print(f"round trips verified byte-exact: {verified['runs']} runs, {verified['pages']} pages, "
          f"{verified['bytes'] / 1e9:.2f} GB compared; {elapsed:.0f} s")
    out = {
        "benchmark": "engine_storage",
        "conditions": {"device_pool": DEVICE, "host_pool_pinned": DEVICE == "cuda",
                       "machine": platform.machine(), "cpus": os.cpu_count(), "load_average_at_start": load0,
                       "platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__, "sglang": _version("sglang"), "hicache": _version("hicache"),
                       "pyarrow": _version("pyarrow"), "store": store_desc, "sglang_file_store": "file (temp dir)",
                       "page_cache": "warm (no fsync on write, no cache drop before read)",
                       "attention": "mha", "layers": args.layers, "kv_heads": args.heads,
                       "head_dim": args.head_dim, "dtype": "bfloat16", "page_size": args.page_size,
                       "page_bytes": page_bytes, "pages": args.pages, "batch": args.batch, "rounds": args.rounds,
                       "statistic": "median", "fresh_keys_per_run": True, "seconds": elapsed},
        "rows": rows,
        "ratios": rat,
        "adapter_over_raw_target": target,
        "adapter_over_raw_met": met,
        "verified": verified,
    }
    p = Path(args.json)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(out, indent=2))
    print(f"wrote {p}")
    return 0


def _x(v: float) -> str:
    return f"x{v:.2f}"


def print_row(r: dict[str, Any], header: bool) -> None:
    if header:
        print(f"{'layout':17} {'path':13} | {'set pages/s':>11} {'GB/s':>6} | {'get pages/s':>11} {'GB/s':>6}")
    print(f"{r['layout']:17} {r['path']:13} | {r['set_pages_per_s']:11,.0f} {r['set_gbps']:6.2f} | "
          f"{r['get_pages_per_s']:11,.0f} {r['get_gbps']:6.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
