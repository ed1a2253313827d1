"""Where a node's unary Match spends its CPU, stage by stage, in-process (no sockets).

The prompt of ``grpc_latency.py`` (8,192 tokens, page 64, one cached 128-page run on L1) and the stages the
server runs for one ``Match(peek=True)`` over gRPC, each timed alone over many repetitions: the request's
wire decode (protobuf, the packed uint32 ``tokens`` field), validation (token field checks, namespace
resolution), the cache's peek (token bytes, radix walk under the tree lock; split into the walk alone and
the eviction policy's hooks a touching match adds), the response build + encode, and the RPC bookkeeping
(concurrency bound, latency histogram, status counter). ``peek, old path`` is what a peek did before it
became a walk without touching (match + release: lock, pin, policy hooks, gauges twice), measured in the
same run; ``match+release`` is a Match that opens a request (not a peek). What the server spends beyond the
sum (gRPC's transport: HTTP/2, the completion queue, the asyncio task per call) is server CPU per call from
``grpc_latency.py`` minus this sum.

    python benchmarks/match_stages.py [--tokens 8192] [--reps 3000] [--json out/match_stages.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from grpc_latency import LAYOUT, config, prompt  # noqa: E402


def per_call_us(fn: Callable[[], Any], reps: int) -> float:
    """CPU microseconds per call of ``fn`` (best of three runs of ``reps`` calls)."""
    for _ in range(min(reps, 200)):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - t0) / reps * 1e6)
    return best


def stages(n_tokens: int, reps: int) -> dict[str, float]:
    from hicache.cache import HiCache
    from hicache.config import ServeConfig, config_from_dict
    from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
    from hicache.service.validation import NamespaceResolver, token_bytes

    tokens = prompt(n_tokens)
    cache = HiCache(config_from_dict(config(n_tokens, 0)))
    req = cache.match(tokens)
    cache.commit(req, tokens, cache.alloc(req, n_tokens // LAYOUT["page_size"]))
    cache.release(req)
    tb = tokens.tobytes()
    raw = pb.MatchRequest(tokens=tb, peek=True).SerializeToString()
    msg = pb.MatchRequest.FromString(raw)
    resolver = NamespaceResolver(cache.ns)
    ns = cache.ns
    serve = ServeConfig()

    def validate() -> None:
        token_bytes(msg.tokens, msg.token_ids, serve.max_request_tokens)
        resolver.resolve(msg.namespace.tenant, msg.namespace.model, msg.namespace.revision, msg.namespace.layout)

    def walk() -> None:
        with cache._lock:
            cache.tree.match(ns.digest, tb, touch=False)

    def walk_touch() -> None:
        with cache._lock:
            cache.tree.match(ns.digest, tb, touch=True)

    def peek() -> None:
        cache.peek(np.frombuffer(tb, dtype="<u4"), ns, l3=False, keys=False)

    def old_peek() -> None:  # what cache.peek was: match + release
        r = cache.match(np.frombuffer(tb, dtype="<u4"), ns, l3=False, keys=False, count=False)
        cache.release(r)

    def match_release() -> None:
        cache.release(cache.match(np.frombuffer(tb, dtype="<u4"), ns, l3=False, keys=False))

    def response() -> None:
        pb.MatchResponse(request_id="", l1_pages=128, l2_pages=0, l3_pages=0, page_size=64, num_pages=128,
                         device_indices=()).SerializeToString()

    hist = cache.metrics.match_seconds
    counter = cache.metrics.peeks

    def bookkeeping() -> None:  # what rpc.unary / HiCacheServicer._done add per call
        t0 = time.perf_counter()
        hist.observe(time.perf_counter() - t0)
        counter.inc()

    out = {
        "decode (MatchRequest.FromString, 32 KiB tokens)": per_call_us(lambda: pb.MatchRequest.FromString(raw), reps),
        "validate (token field, namespace)": per_call_us(validate, reps),
        "radix walk under the lock (no touch)": per_call_us(walk, reps),
        "radix walk + touch (recency, policy hooks)": per_call_us(walk_touch, reps),
        "peek, now": per_call_us(peek, reps),
        "peek, old path (match + release)": per_call_us(old_peek, reps),
        "match + release (a Match that opens a request)": per_call_us(match_release, reps),
        "response build + encode": per_call_us(response, reps),
        "rpc bookkeeping (histogram, counter)": per_call_us(bookkeeping, reps),
    }
    cache.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--json", default="out/match_stages.json")
    args = ap.parse_args(argv)
    got = stages(args.tokens, args.reps)
    for name, us in got.items():
        print(f"{name:50s} {us:8.1f} us CPU")
    now = sum(got[k] for k in ("decode (MatchRequest.FromString, 32 KiB tokens)", "validate (token field, namespace)",
                               "peek, now", "response build + encode", "rpc bookkeeping (histogram, counter)"))
    old = now - got["peek, now"] + got["peek, old path (match + release)"]
    print(f"{'sum of the unary peek stages, now':50s} {now:8.1f} us CPU  (old path {old:.1f} us)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "match_stages", "tokens": args.tokens, "cpus": os.cpu_count(),
                               "python": platform.python_version(), "stages_us": got, "sum_now_us": now,
                               "sum_old_path_us": old}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
