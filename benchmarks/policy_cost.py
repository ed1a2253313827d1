"""What the eviction policy adds to a request's CPU: in-process match + release, ``lru`` vs ``hedge_lru``.

The prompt of ``grpc_latency.py`` (8,192 tokens, page 64: 128 pages) matched in full on L1 and released, as
the server does for a Match that opens a request (``match_stages.py``'s ``match + release``), on two CPU
caches per policy: a small one that holds just that prompt (``hedge_lru`` simulates every page: sampling
rate 1) and a large one of ``--large-pages`` L1 pages holding many prompts of the same length (sampling
rate > 1; the matches rotate over them). The KV layout is a thin one (1 layer, 1 head of 8): what is timed
touches no KV. Per cache: CPU us per match + release of each policy (best of ``--rounds`` rounds, the
policies interleaved, each round best of three runs of ``--reps`` calls), the in-run ratio hedge / lru and
the difference (the policy's cost per request). ``--before`` embeds an earlier run's JSON (the code before
a change) and prints the change.

    python benchmarks/policy_cost.py [--tokens 8192] [--large-pages 20480] [--reps 2000] [--rounds 3]
                                     [--before old.json] [--json out/policy_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from grpc_latency import LAYOUT, config, prompt  # noqa: E402
from match_stages import per_call_us  # noqa: E402

POLICIES = ("lru", "hedge_lru")
THIN = {**LAYOUT, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8}  # the timed path reads no KV


def build(policy: str, n_tokens: int, l1_pages: int) -> tuple[Any, list[np.ndarray]]:
    """A CPU HiCache of ``l1_pages`` L1 pages under ``policy``, filled with prompts of ``n_tokens`` up to
    about 94% of L1 (at least one: ``grpc_latency.prompt``); returns it and the prompts it holds."""
    from hicache.cache import HiCache
    from hicache.config import config_from_dict

    page = THIN["page_size"]
    cfg = config(n_tokens, 0)
    cfg["layout"] = THIN
    cfg["cache"].update(l1_tokens=l1_pages * page, eviction_policy=policy)
    cache = HiCache(config_from_dict(cfg))
    n_prompts = max(1, int(0.94 * l1_pages) // (n_tokens // page))
    rng = np.random.default_rng(1)
    prompts = [prompt(n_tokens)] + [rng.integers(0, 128_000, n_tokens).astype(np.uint32)
                                    for _ in range(n_prompts - 1)]
    for tokens in prompts:
        req = cache.match(tokens)
        cache.commit(req, tokens, cache.alloc(req, n_tokens // page))
        cache.release(req)
    return cache, prompts


def match_release(cache: Any, prompts: list[np.ndarray]) -> Any:
    """One match + release of the next cached prompt (round robin), as the server runs a Match."""
    ns, n, i = cache.ns, len(prompts), [0]
    want = len(prompts[0]) // THIN["page_size"]

    def call() -> None:
        tokens = prompts[i[0] % n]
        i[0] += 1
        r = cache.match(tokens, ns, l3=False, keys=False)
        cache.release(r)

    r = cache.match(prompts[0], ns, l3=False, keys=False)
    assert r.l1_pages == want, (r.l1_pages, want)
    cache.release(r)
    return call


def measure(n_tokens: int, large_pages: int, reps: int, rounds: int) -> dict[str, dict[str, Any]]:
    page = THIN["page_size"]
    sizes = {"small (one prompt)": max(2 * n_tokens // page, 1024), f"large ({large_pages} pages)": large_pages}
    out: dict[str, dict[str, Any]] = {}
    for label, pages in sizes.items():
        built = {p: build(p, n_tokens, pages) for p in POLICIES}
        best = dict.fromkeys(POLICIES, float("inf"))
        for _ in range(rounds):
            for p, (cache, prompts) in built.items():
                best[p] = min(best[p], per_call_us(match_release(cache, prompts), reps))
        hedge = built["hedge_lru"][0].tree.policy
        out[label] = {"l1_pages": pages, "prompts": len(built["lru"][1]), "sample_rate": hedge.rate,
                      "us": best, "ratio_hedge_lru": best["hedge_lru"] / best["lru"],
                      "policy_us": best["hedge_lru"] - best["lru"]}
        for cache, _ in built.values():
            cache.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--large-pages", type=int, default=20480)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", help="an earlier run's JSON, embedded as 'before' (its own 'before' dropped)")
    ap.add_argument("--json", default="out/policy_cost.json")
    args = ap.parse_args(argv)
    got = measure(args.tokens, args.large_pages, args.reps, args.rounds)
    before = None
    if args.before:
        before = json.loads(Path(args.before).read_text())
        before.pop("before", None)
    print(f"match + release, {args.tokens} tokens, page {THIN['page_size']}: CPU us per call (best of {args.rounds})")
    for label, r in got.items():
        line = (f"{label:22s} rate {r['sample_rate']:3d}  lru {r['us']['lru']:7.1f}  hedge_lru "
                f"{r['us']['hedge_lru']:7.1f}  hedge/lru {r['ratio_hedge_lru']:5.2f}x  policy {r['policy_us']:6.1f} us")
        if before is not None and label in before["caches"]:
            b = before["caches"][label]
            line += (f"  (before: hedge_lru {b['us']['hedge_lru']:.1f}, {b['ratio_hedge_lru']:.2f}x, "
                     f"policy {b['policy_us']:.1f} us)")
        print(line)
    doc: dict[str, Any] = {"benchmark": "policy_cost", "tokens": args.tokens, "page_size": THIN["page_size"],
                           "reps": args.reps, "rounds": args.rounds, "cpus": os.cpu_count(),
                           "python": platform.python_version(), "caches": got}
    if before is not None:
        doc["before"] = before
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
