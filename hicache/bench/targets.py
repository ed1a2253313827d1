"""What a trace is replayed against.

A :class:`Target` serves one request the way a serving engine drives the cache -- match, prefetch the
L3 run, load back, allocate pages for the rest of the prompt and the output, commit, release -- and
says how many prompt tokens each tier hit and how many were not recomputed.

* :class:`InProcessTarget` -- a :class:`~hicache.cache.HiCache` in this process. For hit-rate purposes
  the KV layout may be tiny (one layer, one head, ``head_dim`` 1): copies are then negligible and the
  hit rate is the same as with the real layout, which only scales bytes.
* :class:`GrpcTarget` -- a node (or router) at ``grpc://host:port`` through :mod:`hicache.client`.

:func:`open_target` picks one from a string (``inproc`` or ``grpc://host:port``).
"""

from __future__ import annotations

import abc
import importlib
import time
from typing import Any, NamedTuple

import numpy as np

from hicache.bench.errors import BenchInputError
from hicache.bench.workloads import TraceRequest
from hicache.cache import CacheFullError, HiCache
from hicache.config import HiCacheConfig


class Outcome(NamedTuple):
    """What one request found, in tokens of its prompt (full pages only)."""

    l1: int  # hit on L1
    l2: int  # continuing on L2
    l3: int  # continuing on L3
    reused: int  # KV available on L1 for compute after load-back: tokens not recomputed
    committed: int  # tokens of prompt + output cached after the request
    seconds: float  # time spent in cache calls


class Target(abc.ABC):
    """Serves requests one at a time (not thread-safe)."""

    name: str = ""
    page_size: int = 0

    @abc.abstractmethod
    def serve(self, req: TraceRequest) -> Outcome: ...

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the cache / connection."""

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessTarget(Target):
    """A HiCache in this process, built from ``config`` (its storage URL opens L3)."""

    name = "inproc"

    def __init__(self, config: HiCacheConfig) -> None:
        self.cache = HiCache(config)
        self.page_size = self.cache.page_size
        self.commit_skipped = 0  # requests whose pages could not be cached (everything locked)

    def serve(self, req: TraceRequest) -> Outcome:
        c, ps = self.cache, self.page_size
        t0 = time.perf_counter()
        r = c.match(req.tokens)
        l1, l2, l3 = r.l1_pages, r.l2_pages, r.l3_pages
        committed = 0
        try:
            if l3:
                c.prefetch(r)
            try:
                c.load_back(r).wait()
            except CacheFullError:
                pass  # the L2 run does not fit on L1 now: those tokens are recomputed
            have = len(r.device_indices)
            seq = np.concatenate([req.tokens, req.output]) if len(req.output) else req.tokens
            need = len(seq) // ps - have
            room = c.device_pool.num_pages - c.tree.locked_device_pages
            n = max(0, min(need, room))  # a request longer than L1 caches what fits
            if n > 0:
                try:
                    pages = c.alloc(r, n)
                except CacheFullError:
                    self.commit_skipped += 1
                else:
                    c.commit(r, seq[: (have + n) * ps], np.concatenate([r.device_indices, pages]))
                    committed = (have + n) * ps
        finally:
            c.release(r)
        return Outcome(l1 * ps, l2 * ps, l3 * ps, have * ps, committed, time.perf_counter() - t0)

    def stats(self) -> dict[str, Any]:
        s = self.cache.stats()
        st = s.pop("storage", None)
        if st is not None:
            s["storage"] = {k: v for k, v in vars(st).items() if k != "extra"}
        s["commit_skipped"] = self.commit_skipped
        return s

    def close(self) -> None:
        self.cache.close()


class GrpcTarget(Target):
    """A node or router over gRPC. Needs :mod:`hicache.client` (``connect(url)`` returning a client with
    ``match(tokens)``, ``commit(handle, tokens)``, ``release(handle)`` and ``stats()``)."""

    name = "grpc"

    def __init__(self, url: str) -> None:
        try:
            mod = importlib.import_module("hicache.client")
        except ImportError as e:
            raise BenchInputError(f"--target {url}: the gRPC client (hicache.client) is not available ({e})") from None
        connect = getattr(mod, "connect", None)
        if connect is None:
            raise BenchInputError(f"--target {url}: hicache.client has no connect(url)")
        try:
            self.client = connect(url)
        except Exception as e:  # noqa: BLE001 - unreachable node, bad address: user input
            raise BenchInputError(f"--target {url}: cannot connect ({e})") from None
        self.page_size = int(getattr(self.client, "page_size", 0) or 0)
        self.url = url

    def serve(self, req: TraceRequest) -> Outcome:
        t0 = time.perf_counter()
        m = self.client.match(req.tokens)
        ps = self.page_size or int(getattr(m, "page_size", 1))
        l1, l2, l3 = (int(getattr(m, f, 0)) for f in ("l1_pages", "l2_pages", "l3_pages"))
        seq = np.concatenate([req.tokens, req.output]) if len(req.output) else req.tokens
        try:
            self.client.commit(m, seq)
        finally:
            self.client.release(m)
        hit = (l1 + l2 + l3) * ps
        return Outcome(l1 * ps, l2 * ps, l3 * ps, hit, len(seq) // ps * ps, time.perf_counter() - t0)

    def stats(self) -> dict[str, Any]:
        s = self.client.stats()
        return dict(s) if isinstance(s, dict) else {"stats": str(s)}

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()


def open_target(target: str, config: HiCacheConfig) -> Target:
    """``inproc`` (the default) or ``grpc://host:port``; :class:`BenchInputError` for anything else."""
    if target in ("", "inproc", "in-process"):
        return InProcessTarget(config)
    if target.startswith("grpc://"):
        return GrpcTarget(target)
    raise BenchInputError(f"--target: expected 'inproc' or grpc://host:port, got {target!r}")
