"""Radix tree operations on the multi-query RAG workload: microseconds per match, insert, and page keys.

Workload: 32 document sets of 8,192 tokens, 16 questions of 256 tokens each; every request
(document + question, 8,448 tokens) is matched, then inserted, in a shuffled order; page sizes 16 and
64. hicache's tree is timed next to a classic Python radix tree (``_classic_radix.py``: token-list keys,
page-by-page Python compare, ``torch.cat`` of values) on the same requests in the same run; the ratio
is what to read (absolute microseconds depend on the machine).

    python benchmarks/radix_ops.py [--docs 32] [--questions 16] [--json out/radix_ops.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _classic_radix import ClassicRadixTree

from hicache.keys import Namespace, page_keys_from_bytes, tokens_to_bytes
from hicache.layout import KVLayout
from hicache.radix import RadixTree


def workload(docs: int, questions: int, doc_len: int, q_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    doc_toks = [[rng.randrange(128000) for _ in range(doc_len)] for _ in range(docs)]
    reqs = [d + [rng.randrange(128000) for _ in range(q_len)] for d in doc_toks for _ in range(questions)]
    rng.shuffle(reqs)
    return reqs


def run(page_size: int, reqs: list[list[int]]) -> dict[str, float]:
    ns = Namespace("bench", KVLayout(32, 8, 128, "bfloat16", page_size))
    tree = RadixTree(page_size)
    classic = ClassicRadixTree(page_size)
    t_keys, t_match, t_insert, t_cmatch, t_cinsert, hits = [], [], [], [], [], 0
    next_page = 0
    gc.disable()
    try:
        for toks in reqs:
            t0 = time.perf_counter_ns()
            tb = tokens_to_bytes(toks)
            keys = page_keys_from_bytes(ns.digest, tb, page_size)
            t1 = time.perf_counter_ns()
            m = tree.match(ns.digest, tb)
            t2 = time.perf_counter_ns()
            n = len(keys)
            dev = np.arange(next_page, next_page + n, dtype=np.int64)
            next_page += n
            t3 = time.perf_counter_ns()
            tree.insert(ns.digest, tb, keys, device=dev)
            t4 = time.perf_counter_ns()
            hits += m.l1_pages
            value = torch.arange(n * page_size, dtype=torch.int64)
            t5 = time.perf_counter_ns()
            cm = classic.match_prefix(toks)
            t6 = time.perf_counter_ns()
            classic.insert(toks, value)
            t7 = time.perf_counter_ns()
            assert len(cm) == m.l1_pages * page_size, "the two trees disagree"
            t_keys.append(t1 - t0)
            t_match.append(t2 - t1)
            t_insert.append(t4 - t3)
            t_cmatch.append(t6 - t5)
            t_cinsert.append(t7 - t6)
    finally:
        gc.enable()

    def us(xs: list[int]) -> float:
        return statistics.mean(xs) / 1e3

    return {
        "page_size": page_size,
        "requests": len(reqs),
        "hit_ratio": hits * page_size / sum(len(r) for r in reqs),
        "match_us": us(t_match),
        "insert_us": us(t_insert),
        "keys_us": us(t_keys),
        "classic_match_us": us(t_cmatch),
        "classic_insert_us": us(t_cinsert),
        "match_ratio": us(t_match) / us(t_cmatch),
        "insert_ratio": us(t_insert) / us(t_cinsert),
        "keys_p99_us": float(np.percentile(t_keys, 99) / 1e3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--doc-len", type=int, default=8192)
    ap.add_argument("--question-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="out/radix_ops.json")
    args = ap.parse_args()
    reqs = workload(args.docs, args.questions, args.doc_len, args.question_len, args.seed)
    results = [run(ps, reqs) for ps in (16, 64)]
    print(f"radix_ops: {args.docs} docs x {args.questions} questions, {args.doc_len}+{args.question_len} tokens, "
          f"python {platform.python_version()}, {platform.machine()}")
    print(f"{'page':>5} {'match us':>9} {'classic':>8} {'ratio':>6} {'insert us':>10} {'classic':>8} {'ratio':>6} "
          f"{'keys us':>8} {'keys p99':>9} {'hit':>5}")
    for r in results:
        print(f"{r['page_size']:>5} {r['match_us']:>9.1f} {r['classic_match_us']:>8.1f} {r['match_ratio']:>6.2f} "
              f"{r['insert_us']:>10.1f} {r['classic_insert_us']:>8.1f} {r['insert_ratio']:>6.2f} "
              f"{r['keys_us']:>8.1f} {r['keys_p99_us']:>9.1f} {r['hit_ratio']:>5.2f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "radix_ops", "args": vars(args), "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
