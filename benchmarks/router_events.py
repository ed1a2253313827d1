"""How fast the router takes in a cache's events: a vLLM / SGLang engine's ZeroMQ KV events
(``router.kv_events``: msgpack decoding, page keys recomputed from parent key and tokens) against a hicache
node's WatchEvents (the in-run baseline: the same pages as stored runs with their keys, which the router
verifies by recomputing them, ``verify_keys``). Both feed the same index; the figures are pages indexed
per second on one core of the router's event loop, and their ratio.

Each request of a generated workload stores the pages its prompt adds to the cache, as one event: the
engine's BlockStored with its own block hashes and the parent block's hash, or the node's STORED run.

    python benchmarks/router_events.py [--workload rag] [--requests 2000] [--page-size 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from hicache.bench.workloads import WorkloadSpec, generate
from hicache.client.types import Event, PageRun
from hicache.config import config_from_dict
from hicache.keys import page_keys
from hicache.router import Router
from hicache.router.config import NodeSpec, RouterConfig
from hicache.router.kv_events import decode_batch


def new_router(page_size: int) -> Router:
    cfg = config_from_dict({"layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32",
                                       "page_size": page_size}})
    rc = RouterConfig(nodes=[NodeSpec("n0", "127.0.0.1:50051"), NodeSpec("e0", "127.0.0.1:8000")],
                      kv_events={"e0": "tcp://127.0.0.1:5557"})
    return Router(cfg, rc)


def streams(prompts: Sequence[np.ndarray], r: Router) -> tuple[list[Event], list[bytes], int]:
    """The same new pages, request by request, as node events and as engine payloads; and the page count."""
    ps = r.page_size
    seen: set[bytes] = set()
    node: list[Event] = [Event(0, "snapshot", [], "srv", False)]
    engine: list[bytes] = []
    pages = 0
    for toks in prompts:
        keys = page_keys(r.ns, toks)
        first = next((i for i, k in enumerate(keys) if k not in seen), len(keys))
        if first == len(keys):
            continue
        new = keys[first:]
        seen.update(new)
        pages += len(new)
        span = np.asarray(toks[first * ps: len(keys) * ps], dtype=np.uint32)
        node.append(Event(len(node), "stored", [PageRun(r.ns.digest, keys[first - 1] if first else b"", new, span,
                                                       ("l1",))], "srv", False))
        hashes = [hashlib.sha256(k).digest() for k in keys]  # the engine's own block hashes: any other hash
        stored = ["BlockStored", hashes[first:], hashes[first - 1] if first else None, span.tolist(), ps, None,
                  "GPU"]
        engine.append(msgpack.packb([time.time(), [stored]], use_bin_type=True))
    return node, engine, pages


def best_of(reps: int, fn: Any) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="rag")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="out/router_events.json")
    args = ap.parse_args(argv)
    prompts = [q.tokens for q in generate(WorkloadSpec(args.workload, args.requests, 0))]
    probe = new_router(args.page_size)
    node_events, payloads, pages = streams(prompts, probe)

    def node_run() -> None:
        r = new_router(args.page_size)
        for ev in node_events:
            r.apply_event("n0", ev)
        assert len(r.index.feed("n0").pages) == pages

    def engine_run() -> None:
        r = new_router(args.page_size)
        eb = r.engines["e0"]
        for p in payloads:
            eb.apply(decode_batch(p))
        assert len(r.index.feed("e0").pages) == pages and not any(eb.refused.values())

    node_s, engine_s = best_of(args.reps, node_run), best_of(args.reps, engine_run)
    rows = {"node_pages_per_s": pages / node_s, "engine_pages_per_s": pages / engine_s,
            "engine_over_node": node_s / engine_s, "pages": pages, "events": len(payloads),
            "workload": args.workload, "requests": args.requests, "page_size": args.page_size}
    print(f"router event intake, {args.workload} x {args.requests} requests, page {args.page_size}: {pages} pages in "
          f"{len(payloads)} events; best of {args.reps}; {platform.processor() or platform.machine()}")
    print(f"  hicache node (WatchEvents, keys verified)  {rows['node_pages_per_s']:>12,.0f} pages/s")
    print(f"  engine (KV events: msgpack, keys derived)  {rows['engine_pages_per_s']:>12,.0f} pages/s  "
          f"({rows['engine_over_node']:.2f}x the node's)")
    p = Path(args.json)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(rows, indent=2))
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
