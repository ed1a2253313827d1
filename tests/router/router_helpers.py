"""Builders for router tests: real key chains, events as a node would send them, small caches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.cache import HiCache
from hicache.client.types import Event, PageRun
from hicache.config import HiCacheConfig, config_from_dict
from hicache.keys import Namespace, page_keys
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.radix_types import TreeEvent
from hicache.router.config import NodeSpec, RouterConfig
from hicache.service.events import page_run

PS = 4
LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": PS}


def node_config(**sections: dict[str, Any]) -> HiCacheConfig:
    base: dict[str, dict[str, Any]] = {"layout": dict(LAYOUT), "cache": {"l1_tokens": 64 * PS, "l2_tokens": 64 * PS}}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return config_from_dict(base)


def router_config(nodes: Sequence[str], **kw: Any) -> RouterConfig:
    return RouterConfig(nodes=[NodeSpec(n, f"127.0.0.1:{50000 + i}") for i, n in enumerate(nodes)], **kw)


def tokens(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, pages * PS).astype(np.uint32)


def run(ns: Namespace, toks: np.ndarray, start: int, stop: int, tiers: tuple[str, ...] = ("l1",)) -> PageRun:
    """The run of pages [start, stop) of ``toks`` as a node's event carries it."""
    keys = page_keys(ns, toks)
    return PageRun(ns.digest, keys[start - 1] if start else b"", keys[start:stop],
                   np.asarray(toks[start * PS:stop * PS], dtype=np.uint32), tiers)


def event(seq: int, kind: str, runs: Sequence[PageRun], server: str = "s1", more: bool = False) -> Event:
    return Event(seq, kind, list(runs), server, more)


class CacheNode:
    """An in-process HiCache whose tree events reach the router exactly as WatchEvents would carry them."""

    def __init__(self, name: str, config: HiCacheConfig, server_id: str = "srv") -> None:
        self.name = name
        self.cache = HiCache(config)
        self.server_id = server_id
        self.seq = 0
        self.pending: list[Event] = []
        self.cache.add_listener(self._on_event)

    def _on_event(self, ev: TreeEvent) -> None:
        self.seq += 1
        kinds = {"stored": pb.Event.STORED, "removed": pb.Event.REMOVED, "tier": pb.Event.TIER_CHANGED}
        self.pending.append(Event.from_pb(pb.Event(sequence=self.seq, kind=kinds[ev.kind], runs=[page_run(ev)],
                                                   server_id=self.server_id)))

    def snapshot(self) -> Event:
        box = [0]

        def at() -> None:
            box[0] = self.seq

        runs = self.cache.snapshot(at)
        self.pending.clear()
        return Event.from_pb(pb.Event(sequence=box[0], kind=pb.Event.SNAPSHOT, runs=[page_run(r) for r in runs],
                                      server_id=self.server_id))

    def drain(self) -> list[Event]:
        out, self.pending = self.pending, []
        return out

    def serve(self, toks: np.ndarray, ns: Namespace | None = None) -> tuple[int, int]:
        """One request as an engine runs it; returns the (L1, L2) pages it hit."""
        c = self.cache
        req = c.match(toks, ns)
        hit = (req.l1_pages, req.l2_pages)
        load = c.load_back(req)
        load.wait()
        n = len(toks) // c.page_size
        new = c.alloc(req, n - len(load.device_indices))
        c.commit(req, toks, np.concatenate([load.device_indices, new]))
        c.release(req)
        return hit


class Clock:
    """A clock the test moves by hand (``clock.t += s``)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
