"""Prefill cost of cached-prefix batches against a no-cache prefill, per attention path.

The end-to-end RAG figure (``e2e_rag.py``) is bounded by how much a computed token costs when it is the
suffix of a cached prompt, compared with a token of a no-cache prefill. This script isolates that ratio
on the model alone (no cache bookkeeping): a ``doc``-token document is written once into L1 pages, then

* ``nocache``: one request of ``doc + question`` tokens prefilled from scratch (the baseline; its cost
  per token is what the ideal speedup assumes for every computed token);
* ``ragged``: ``batch`` questions of ``question`` tokens over the cached document: the document's K/V
  once for every query (unmasked), each question's own keys packed, merged by log-sum-exp (the default);
* ``padded``: the same batch with every segment's pages gathered into one padded tensor and masked.

For each path: median milliseconds, cost per computed token relative to ``nocache``, and the share of
the ideal RAG speedup it implies (first request computed in full, the rest as one suffix batch); then
one decode step of the whole batch (which takes the padded path unless it is forced).

    PYTHONPATH=. python benchmarks/prefill_paths.py            # 8B-shaped, bf16, GPU
    PYTHONPATH=. python benchmarks/prefill_paths.py --quick    # tiny model on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache.engine import Decoder, preset
from hicache.engine.model import make_batch
from hicache.pool import DevicePool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn: Any, device: torch.device, reps: int) -> float:
    fn()  # first use (kernel selection, allocator) outside the timing
    ts = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--quick", action="store_true", help="tiny model, small sizes, CPU")
    ap.add_argument("--doc", type=int, default=4096)
    ap.add_argument("--question", type=int, default=128)
    ap.add_argument("--batch", type=int, default=31)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="out/prefill_paths.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.model, a.doc, a.question, a.batch, a.reps = "tiny", 512, 16, 6, 3
    device = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Decoder.random(preset(a.model), 0, dtype, device)
    S = a.page_size
    vocab = model.shape.vocab_size
    rng = np.random.default_rng(0)
    doc = rng.integers(0, vocab, a.doc).tolist()
    qs = [rng.integers(0, vocab, a.question).tolist() for _ in range(a.batch)]
    doc_pages = a.doc // S
    own = -(-a.question // S) + 1
    n_pages = doc_pages + a.batch * own + -(-(a.doc + a.question) // S) + 1
    pool = DevicePool(model.shape.kv_layout(S, str(dtype).removeprefix("torch.")), n_pages, device.type)
    shared = np.arange(doc_pages)
    model.forward_paged(make_batch([doc[: doc_pages * S]], [0], [shared], S, device), pool.kv)
    prefix = doc_pages * S
    tables = [np.concatenate([shared, doc_pages + b * own + np.arange(own)]) for b in range(a.batch)]
    fresh = doc_pages + a.batch * own + np.arange(-(-(a.doc + a.question) // S))
    full = doc + qs[0]

    def nocache() -> None:
        model.forward_paged(make_batch([full], [0], [fresh], S, device), pool.kv)

    def suffix(path: str) -> None:
        model.attention_path = path
        model.forward_paged(make_batch(qs, [prefix] * a.batch, tables, S, device), pool.kv)

    def decode(path: str) -> None:
        model.attention_path = path
        b = make_batch([[1]] * a.batch, [prefix + a.question] * a.batch, tables, S, device)
        if path == "ragged":  # forced: decode steps take the padded path
            b.decode = False
        model.forward_paged(b, pool.kv)

    t_nc = _time(nocache, device, a.reps)
    per_tok_nc = t_nc / len(full)
    rows: dict[str, Any] = {"nocache": {"ms": 1e3 * t_nc, "tokens": len(full), "cost_ratio": 1.0}}
    computed = len(full) + a.batch * a.question  # first request in full, the rest as suffixes
    total = (a.batch + 1) * len(full)
    ideal = total / computed
    print(f"# {a.model} {str(dtype).removeprefix('torch.')} on {device.type}: document {a.doc}, "
          f"{a.batch} x {a.question}-token questions, page {S}; ideal RAG speedup {ideal:.1f}x")
    print(f"nocache  {1e3 * t_nc:8.1f} ms for {len(full)} tokens ({1e6 * per_tok_nc:.1f} us/token)")
    for name in ("ragged", "padded"):
        t = _time(lambda p=name: suffix(p), device, a.reps)
        ratio = t / (a.batch * a.question) / per_tok_nc
        speedup = (a.batch + 1) * t_nc / (t_nc + t)
        rows[name] = {"ms": 1e3 * t, "tokens": a.batch * a.question, "cost_ratio": ratio,
                      "rag_speedup": speedup, "of_ideal": speedup / ideal}
        print(f"{name:8s} {1e3 * t:8.1f} ms for {a.batch * a.question} tokens: {ratio:.2f}x the no-cache cost "
              f"per token -> RAG {speedup:.1f}x = {speedup / ideal:.0%} of ideal")
    base = None
    for name in ("ragged", "padded"):
        t = _time(lambda p=name: decode(p), device, a.reps)
        base = base or t
        rows[f"decode_{name}"] = {"ms": 1e3 * t, "vs_ragged": t / base}
        print(f"decode {name:8s} {1e3 * t:8.2f} ms per step of {a.batch} sequences ({t / base:.2f}x ragged)")
    model.attention_path = "ragged"
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "device": device.type, "ideal": ideal, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
