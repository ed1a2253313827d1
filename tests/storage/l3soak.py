"""Shared-L3 soak kit: worker processes, each with its own cache over one L3 store, and what damages that store.

Worker side (:func:`worker_main`, the body of a spawned process; :class:`WorkerProc` is the parent's end of
its pipe): one :class:`hicache.cache.HiCache` on CPU with an L1 and an L2 of a few tens of pages and the
``write_through`` policy, so every computed page goes to L3 and pages keep leaving L1/L2 and coming back
from L3 -- often pages another process computed. Engine threads replay shared documents followed by shared
or private questions under two tenants, and check every page a hit hands them against the page model of
:mod:`soakkit` (the K/V of a page is a function of its tenant and its token prefix), bit for bit.

Fault side (:class:`FileFaults`, :class:`RedisFaults`, run by the test process): list the pages the store
holds and damage them -- flip a bit of the payload or of the header's key, truncate, replace the frame with
the frame of another page, of the same tokens under the other tenant, or with a valid frame of another
model's namespace, or (Redis) with a value of another type; delete a page, a page's directory, or everything.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import multiprocessing as mp
import os
import random
import shutil
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import redis
from redis.cluster import RedisCluster
from soakkit import Counters, PageModel

from hicache.cache import CacheFullError, HiCache
from hicache.config import config_from_dict
from hicache.storage.file_pages import PAGE_SUFFIX
from hicache.storage.frame import HEADER_BYTES, encode_frame, header_len

PS = 4  # tokens per page
LAYERS, HEADS, DIM = 2, 2, 4  # a page: [LAYERS, 2, PS, HEADS, DIM] float32 = 512 bytes
L1_PAGES, L2_PAGES = 24, 64
MODEL_NAME = "soak-model"
TENANTS = ("", "acme")
ENGINE_THREADS = 2
MODEL = PageModel((LAYERS, 2, PS, HEADS, DIM), np.float32)
LAYOUT = {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": DIM, "dtype": "float32", "page_size": PS}
KEY_FIELD = slice(4 + 2 + 2 + 32, 4 + 2 + 2 + 32 + 32)  # the page key inside a frame header
FOREIGN_MODEL = "another-model"  # frames of this namespace are foreign to every worker


# ---------------------------------------------------------------------------------------------- prompts
@dataclass
class Prompts:
    """Documents every worker reads (shared), a pool of shared questions; private questions are made up."""

    docs: list[list[int]]
    questions: list[list[int]]

    @classmethod
    def make(cls, seed: int = 7) -> Prompts:
        rng = random.Random(seed)
        docs = [[rng.randrange(1, 50_000) for _ in range(rng.choice([3, 4, 5]) * PS)] for _ in range(6)]
        questions = [[rng.randrange(1, 50_000) for _ in range(rng.choice([1, 2]) * PS)] for _ in range(4)]
        return cls(docs, questions)

    def draw(self, rng: random.Random) -> np.ndarray:
        toks = list(rng.choice(self.docs))
        r = rng.random()
        if r < 0.4:
            toks += rng.choice(self.questions)
        elif r < 0.8:
            toks += [rng.randrange(1, 50_000) for _ in range(rng.choice([1, 2]) * PS)]
        toks += [rng.randrange(1, 50_000) for _ in range(rng.randrange(PS))]  # partial page: never cached
        return np.asarray(toks, dtype=np.uint32)


PROMPTS = Prompts.make()


def foreign_namespace() -> bytes:
    """The namespace digest of another model with the same layout (its frames must never be served)."""
    cfg = config_from_dict({"layout": LAYOUT, "model": {"name": FOREIGN_MODEL}})
    return cfg.namespace().digest


# ---------------------------------------------------------------------------------------------- worker side
@dataclass
class Tally(Counters):
    requests: int = 0
    verified_l1: int = 0  # hit pages checked, by the tier match found them on
    verified_l2: int = 0
    verified_l3: int = 0  # pages prefetched from L3 and checked
    verified_foreign: int = 0  # of which this process never computed (another process wrote them)
    computed: int = 0
    full: int = 0  # requests given up on CacheFullError
    clears: int = 0


@dataclass
class Served:
    """One request's outcome (what :meth:`Worker.serve_docs` reports per document)."""

    tenant: str
    doc: int
    pages: int
    l1_match: int  # pages match found on L1
    l3_match: int  # pages match found on L3
    l3_loaded: int  # pages the prefetch brought (verified)
    foreign: int  # of l3_loaded: pages this process never computed
    computed: int
    keys: list[str]  # page keys, hex
    l3_exists_after: int = -1  # leading pages the store holds after the flush


class Worker:
    """The cache of one process and the commands the parent sends it."""

    def __init__(self, wid: int) -> None:
        self.wid = wid
        self.cache: HiCache | None = None
        self.computed: set[bytes] = set()
        self.computed_lock = threading.Lock()

    def ping(self) -> int:
        return os.getpid()

    def open(self, url: str, options: dict[str, Any], host_layout: str, compression: str = "none") -> None:
        cfg = config_from_dict({
            "model": {"name": MODEL_NAME},
            "layout": LAYOUT,
            "cache": {"l1_tokens": L1_PAGES * PS, "l2_tokens": L2_PAGES * PS, "write_policy": "write_through",
                      "host_layout": host_layout, "host_block_pages": 4},
            "storage": {"url": url, "options": options, "prefetch_threshold_tokens": 0,
                        "prefetch_policy": "wait_complete", "io_batch_pages": 4, "compression": compression},
        })
        self.cache = HiCache(cfg)
        self.ns = {t: self.cache.namespace(t or None) for t in TENANTS}
        self.computed = set()

    def _cache(self) -> HiCache:
        assert self.cache is not None, "open first"
        return self.cache

    def serve(self, tenant: str, tokens: np.ndarray, what: str) -> Served:
        """One request as an engine runs it; every page handed over is checked against the model."""
        cache = self._cache()
        kv = cache.device_pool.kv
        n = len(tokens) // PS
        req = cache.match(tokens, self.ns[tenant])
        try:
            cache.prefetch(req)
            load = cache.load_back(req)
            load.wait()
            dev = load.device_indices
            MODEL.check(kv, dev, tenant, tokens, f"worker {self.wid}: {what} (tenant {tenant!r}): hit of {len(dev)} "
                        f"pages (match: L1 {req.l1_pages}, L2 {req.l2_pages}, L3 {req.l3_pages}; "
                        f"prefetched {load.l3_pages})")
            start = req.l1_pages + req.l2_pages
            with self.computed_lock:
                foreign = sum(k not in self.computed for k in req.keys[start:start + load.l3_pages])
            new = cache.alloc(req, n - len(dev))
            MODEL.write(kv, new, tenant, tokens, len(dev))
            cache.commit(req, tokens, np.concatenate([dev, new]))
            MODEL.check(kv, req.device_indices, tenant, tokens, f"worker {self.wid}: {what}: after commit")
            with self.computed_lock:
                self.computed.update(req.keys[len(dev):n])
            return Served(tenant, -1, n, req.l1_pages, req.l3_pages, load.l3_pages, foreign, len(new),
                          [k.hex() for k in req.keys[:n]])
        finally:
            cache.release(req)

    def soak(self, seconds: float, seed: int) -> dict[str, Any]:
        """Engine threads and a maintenance thread (clears / evictions, so L3 is read) for ``seconds``."""
        cache = self._cache()
        tally = Tally()
        stop = threading.Event()
        errors: list[str] = []

        def engine(tid: int) -> None:
            rng = random.Random(seed * 1000 + self.wid * 10 + tid)
            try:
                while not stop.is_set():
                    tenant = rng.choice(TENANTS)
                    tokens = PROMPTS.draw(rng)
                    try:
                        s = self.serve(tenant, tokens, "soak request")
                    except CacheFullError:
                        tally.add(full=1)
                        continue
                    hit = s.pages - s.computed  # every hit page was checked
                    tally.add(requests=1, verified_l1=min(s.l1_match, hit), verified_l3=s.l3_loaded,
                              verified_l2=max(0, hit - s.l1_match - s.l3_loaded), verified_foreign=s.foreign,
                              computed=s.computed)
            except BaseException:
                errors.append(f"worker {self.wid} engine {tid}:\n{traceback.format_exc()}")
                stop.set()

        def maintenance() -> None:
            rng = random.Random(seed * 1000 + self.wid)
            try:
                while not stop.wait(rng.uniform(0.05, 0.2)):
                    if rng.random() < 0.6:
                        cache.clear()
                        tally.add(clears=1)
                    else:
                        cache.evict(l1_pages=rng.randrange(1, 12), l2_pages=rng.randrange(0, 16))
            except BaseException:
                errors.append(f"worker {self.wid} maintenance:\n{traceback.format_exc()}")
                stop.set()

        threads = [threading.Thread(target=engine, args=(i,)) for i in range(ENGINE_THREADS)]
        threads.append(threading.Thread(target=maintenance))
        for th in threads:
            th.start()
        stop.wait(seconds)
        stop.set()
        for th in threads:
            th.join(timeout=30)
        if any(th.is_alive() for th in threads):
            errors.append(f"worker {self.wid}: a thread did not stop within 30 s")
        cache.flush(timeout_s=10)
        cache.check_integrity()
        out: dict[str, Any] = {f.name: getattr(tally, f.name) for f in fields(tally) if f.name != "lock"}
        out["errors"] = errors
        out.update(self.stats())
        return out

    def serve_docs(self) -> list[dict[str, Any]]:
        """From an empty L1/L2: every document under every tenant, one after the other (L3 hits only),
        each flushed to L3 before the next (write_through skips the backup of a commit that finds L2 full
        of pages still pinned by their L3 writes: the L2 here is smaller than all documents together);
        then ask the store which of their pages it now holds."""
        cache = self._cache()
        cache.clear()
        out = []
        for d, doc in enumerate(PROMPTS.docs):
            for tenant in TENANTS:
                s = self.serve(tenant, np.asarray(doc, dtype=np.uint32), f"document {d}")
                s.doc = d
                out.append(s)
                cache.flush(timeout_s=10)
        assert cache.storage is not None
        for s in out:
            s.l3_exists_after = cache.storage.batch_exists([bytes.fromhex(k) for k in s.keys])
        return [asdict(s) for s in out]

    def stats(self) -> dict[str, Any]:
        """The store's counters and the cache's exported counters of damaged pages / misses."""
        cache = self._cache()
        assert cache.storage is not None
        st = cache.storage.stats()
        reg = cache.metrics.registry
        return {"corrupt_pages": st.corrupt_pages, "store_errors": st.errors, "gets": st.gets,
                "get_misses": st.get_misses, "sets": st.sets, "bytes_written": st.bytes_written,
                "stored_bytes_written": st.stored_bytes_written,
                "metric_corrupt": reg.get_sample_value("hicache_storage_corrupt_pages_total") or 0.0,
                "metric_misses": reg.get_sample_value("hicache_storage_page_misses_total") or 0.0}

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None


def worker_main(conn: Connection, wid: int) -> None:
    """A worker process: run ``(command, kwargs)`` messages on a :class:`Worker` and answer each with
    ``("ok", result)`` or ``("error", traceback)`` until ``exit``."""
    logging.getLogger("hicache").setLevel(logging.ERROR)  # damaged pages and a dead store are expected here
    w = Worker(wid)
    while True:
        try:
            cmd, kw = conn.recv()
        except EOFError:
            break
        if cmd == "exit":
            w.close()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(w, cmd)(**kw)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class WorkerProc:
    """The parent's end: a spawned process running :func:`worker_main`."""

    def __init__(self, wid: int) -> None:
        ctx = mp.get_context("spawn")
        self.wid = wid
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, wid), name=f"l3soak-worker-{wid}", daemon=True)
        self.proc.start()
        child.close()

    def send(self, cmd: str, **kw: Any) -> None:
        self.conn.send((cmd, kw))

    def result(self, timeout_s: float = 60.0) -> Any:
        if not self.conn.poll(timeout_s):
            raise AssertionError(f"worker {self.wid}: no answer within {timeout_s} s")
        try:
            status, val = self.conn.recv()
        except EOFError:
            raise AssertionError(f"worker {self.wid} died (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise AssertionError(f"worker {self.wid} failed:\n{val}")
        return val

    def call(self, cmd: str, timeout_s: float = 60.0, **kw: Any) -> Any:
        self.send(cmd, **kw)
        return self.result(timeout_s)

    def stop(self) -> None:
        with contextlib.suppress(AssertionError, OSError):
            self.call("exit", timeout_s=30)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=10)


# ---------------------------------------------------------------------------------------------- fault side
CORRUPTING = ("flip_payload", "flip_key", "truncate", "other_page", "other_tenant", "other_namespace", "wrong_type")
KINDS = ("flip_payload", "flip_key", "truncate", "other_page", "other_namespace", "delete")  # any store


@dataclass
class FaultLog:
    counts: dict[str, int] = field(default_factory=dict)

    def note(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    @property
    def corrupting(self) -> int:
        return sum(self.counts.get(k, 0) for k in CORRUPTING)


class Faults(abc.ABC):
    """Damage to the pages of a store, by page key. Operations on a page that went away meanwhile do nothing."""

    kinds: tuple[str, ...] = KINDS  # what :func:`inject` picks from

    def __init__(self) -> None:
        self.log = FaultLog()
        self.foreign_ns = foreign_namespace()

    @abc.abstractmethod
    def keys(self) -> list[bytes]: ...

    @abc.abstractmethod
    def read(self, key: bytes) -> bytes | None: ...

    @abc.abstractmethod
    def replace(self, key: bytes, blob: bytes) -> None:
        """Make ``blob`` the stored value of ``key`` (the way a torn or foreign write would)."""

    @abc.abstractmethod
    def flip(self, key: bytes, pos: int, blob: bytes) -> None:
        """Flip one bit of byte ``pos`` of the stored value, in place."""

    @abc.abstractmethod
    def remove(self, key: bytes) -> None: ...

    def retype(self, key: bytes) -> None:
        """Put a value of another type (not a string) at the page's key, where the store has types."""
        raise NotImplementedError(f"{type(self).__name__}: values have no type")

    @abc.abstractmethod
    def wipe(self) -> None:
        """Everything the workers stored goes."""

    def damage(self, key: bytes, kind: str, rng: random.Random, other: bytes | None = None) -> bool:
        """Apply ``kind`` to ``key``'s page (``other``: the page whose frame ``other_page`` / ``other_tenant``
        copies). False when there was nothing to damage."""
        blob = self.read(key)
        if blob is None or len(blob) <= HEADER_BYTES:
            return False
        if kind == "flip_payload":
            self.flip(key, rng.randrange(HEADER_BYTES, len(blob)), blob)
        elif kind == "flip_key":
            self.flip(key, rng.randrange(KEY_FIELD.start, KEY_FIELD.stop), blob)
        elif kind == "truncate":
            self.replace(key, blob[: rng.randrange(0, len(blob))])
        elif kind in ("other_page", "other_tenant"):
            if other is None:
                cands = [k for k in self.keys() if k != key]
                if not cands:
                    return False
                other = rng.choice(cands)
            theirs = self.read(other)
            if theirs is None:
                return False
            self.replace(key, theirs)
        elif kind == "other_namespace":  # a valid frame of this very key and payload, but another model's
            self.replace(key, encode_frame(blob[header_len(blob):], self.foreign_ns, key))
        elif kind == "delete":
            self.remove(key)
        elif kind == "wrong_type":
            self.retype(key)
        else:
            raise ValueError(kind)
        self.log.note(kind)
        return True


class FileFaults(Faults):
    """Damage to a file store: files edited, truncated and overwritten in place, deleted, directories removed."""

    def __init__(self, root: Path, shard_levels: int = 2) -> None:
        super().__init__()
        self.root = root
        self.shard_levels = shard_levels

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root.joinpath(*[h[2 * i: 2 * i + 2] for i in range(self.shard_levels)], h + PAGE_SUFFIX)

    def _walk(self) -> Iterator[Path]:
        for d, _, files in os.walk(self.root):
            for f in files:
                if f.endswith(PAGE_SUFFIX) and not f.startswith("."):
                    yield Path(d, f)

    def keys(self) -> list[bytes]:
        return [bytes.fromhex(p.name[: -len(PAGE_SUFFIX)]) for p in self._walk()]

    def read(self, key: bytes) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except OSError:
            return None

    def replace(self, key: bytes, blob: bytes) -> None:
        try:
            with open(self.path(key), "r+b") as f:  # in place: a reader may see it half written
                f.truncate(0)
                f.write(blob)
        except OSError:
            pass

    def flip(self, key: bytes, pos: int, blob: bytes) -> None:
        try:
            with open(self.path(key), "r+b") as f:
                f.seek(pos)
                f.write(bytes([blob[pos] ^ 0x10]))
        except OSError:
            pass

    def remove(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)

    def remove_dir(self, key: bytes) -> None:
        """The page's directory goes, with whatever else is in it."""
        shutil.rmtree(self.path(key).parent, ignore_errors=True)
        self.log.note("remove_dir")

    def wipe(self) -> None:
        for child in self.root.iterdir() if self.root.exists() else []:
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        self.log.note("wipe")


class RedisFaults(Faults):
    """Damage to a Redis (or Redis Cluster) store through a client of its own; a store that is down is
    left alone. Besides damaged strings, a page's key may get a value of another type (a list)."""

    kinds = (*KINDS, "wrong_type")

    def __init__(self, client: redis.Redis | RedisCluster, prefix: str) -> None:
        super().__init__()
        self.client = client
        self.prefix = prefix.encode()

    def rkey(self, key: bytes) -> bytes:
        return b"%s{%s}" % (self.prefix, key.hex().encode())

    def keys(self) -> list[bytes]:
        try:
            return [bytes.fromhex(k[len(self.prefix) + 1: -1].decode())
                    for k in self.client.scan_iter(match=self.prefix + b"{*}", count=1000)]
        except redis.RedisError:
            return []

    def read(self, key: bytes) -> bytes | None:
        try:
            v = self.client.get(self.rkey(key))
        except redis.RedisError:
            return None
        return v if isinstance(v, bytes) else None

    def replace(self, key: bytes, blob: bytes) -> None:
        with contextlib.suppress(redis.RedisError):
            self.client.set(self.rkey(key), blob)

    def flip(self, key: bytes, pos: int, blob: bytes) -> None:
        with contextlib.suppress(redis.RedisError):
            self.client.setrange(self.rkey(key), pos, bytes([blob[pos] ^ 0x10]))

    def remove(self, key: bytes) -> None:
        with contextlib.suppress(redis.RedisError):
            self.client.delete(self.rkey(key))

    def retype(self, key: bytes) -> None:
        with contextlib.suppress(redis.RedisError):
            self.client.delete(self.rkey(key))
            self.client.rpush(self.rkey(key), b"not a page")

    def wipe(self) -> None:
        """Every page under the prefix goes."""
        for k in self.keys():
            self.remove(k)
        self.log.note("wipe")


def inject(faults: Faults, seconds: float, rng: random.Random, once: dict[float, Any]) -> None:
    """Damage random pages of the store for ``seconds`` (a fault every few tens of ms); ``once`` maps a
    fraction of ``seconds`` to a callable run once then (a wipe, a restart)."""
    t0 = time.monotonic()
    pending = sorted(once.items())
    keys: list[bytes] = []
    listed = 0.0
    while (now := time.monotonic() - t0) < seconds:
        if pending and now >= pending[0][0] * seconds:
            pending.pop(0)[1]()
        if not keys or now - listed > 0.3:
            keys, listed = faults.keys(), now
        if keys:
            key = rng.choice(keys)
            if isinstance(faults, FileFaults) and rng.random() < 0.03:
                faults.remove_dir(key)
            else:
                faults.damage(key, rng.choice(faults.kinds), rng)
        time.sleep(rng.uniform(0.005, 0.03))
    for _, fn in pending:
        fn()
