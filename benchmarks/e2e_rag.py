"""End-to-end benchmark: the reference serving node with and without the cache tiers.

Workloads (synthetic token ids, seeded; the article's three examples plus a working set beyond L1):

* ``rag``      multi-query RAG: one document block, many questions, all arriving at once.
* ``fewshot``  few-shot classification: one example block, many short targets, a short label each.
* ``chat``     multi-turn chat: conversations whose history (system prompt, messages, answers) grows.
* ``rag_ws``   RAG over many documents whose KV is several times L1, one request at a time, after a
               warm-up pass (steady state): does L2 keep what L1 cannot?

Each other workload first runs once unmeasured on the same cache with other tokens (no shared prefix with
the measured run), so kernel selection and allocator growth for its batch shapes fall outside the timing;
the cache then drains (backups and L3 writes of that pass finish) before the measured pass starts. The
measured pass's own backups and L3 writes run during it, as in service.
* ``ttft16k``  one request with a 16k-token prefix: first token from recompute vs from an L2 hit.

Modes: ``nocache`` (recompute everything), ``l1`` (radix cache on the GPU only), ``l1l2`` (+ pinned host
memory), ``l1l2l3`` (+ a file store on local disk; ``memory://`` if the file backend is missing), and
``l1l2redis`` (+ Redis as L3) when Redis is available: ``--redis URL`` names a server, and by default
(``--redis auto``) a local ``redis-server`` is started on a free loopback port when one is installed
and redis-py imports (the mode is left out, with a note, otherwise).

Figures per workload and mode: requests/s, prefill tokens/s (computed, and prompt tokens per prefill
second), TTFT p50/p99/mean (from the arrival of the request's round), hit rate per tier, and the ideal
speedup from token counts (prompt tokens / prompt tokens computed) against the measured prefill speedup.
Ratios are against the in-run ``nocache`` baseline. Writes JSON (``--json``) and prints a markdown table.

    PYTHONPATH=. python benchmarks/e2e_rag.py                 # 8B-shaped, bf16, on the GPU
    PYTHONPATH=. python benchmarks/e2e_rag.py --quick         # tiny model on CPU (smoke test)
"""

from __future__ import annotations

import os

# as `hicache` itself does at start (before CUDA starts): hardware queues enough for the staged path's lanes,
# and command buffers that hold a burst of its copies without stalling the host
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_SCALE_LAUNCH_QUEUES", "4x")

import argparse
import atexit
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache import HiCache
from hicache.config import config_from_dict
from hicache.engine import CachePort, Decoder, GenRequest, GenResult, NoCachePort, ServingNode, preset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling _ttft_probe, however this is loaded
from _ttft_probe import TracedPort, link_seconds, read_seconds

Rounds = Generator[tuple[list[GenRequest], bool], list[GenResult], None]  # yields (requests, measured)
MODES = ("nocache", "l1", "l1l2", "l1l2l3", "l1l2redis")
L3_MODES = ("l1l2l3", "l1l2redis")


@dataclass
class Sizes:
    """Token counts of every workload (defaults: the GPU run; ``quick``: the CPU smoke test)."""

    doc: int = 4096  # rag: document block
    questions: int = 32
    question: int = 128
    rag_new: int = 8
    shots: int = 2048  # fewshot: example block
    targets: int = 32
    target: int = 64
    label_new: int = 2
    convs: int = 8  # chat
    turns: int = 4
    system: int = 512
    message: int = 128
    answer_new: int = 32
    ws_docs: int = 16  # rag_ws: documents of ws_doc tokens; L1 holds ws_l1_docs of them
    ws_doc: int = 4096
    ws_l1_docs: int = 4
    ws_passes: int = 2
    long_prefix: int = 16384  # ttft16k
    reps: int = 5
    l1_tokens: int = 65536
    l2_tokens: int = 32768
    max_batch: int = 32
    max_batch_tokens: int = 32768

    @classmethod
    def quick(cls) -> Sizes:
        return cls(doc=256, questions=8, question=16, rag_new=2, shots=128, targets=8, target=8, convs=3, turns=3,
                   system=32, message=16, answer_new=4, ws_docs=8, ws_doc=64, ws_l1_docs=2, long_prefix=512,
                   reps=2, l1_tokens=4096, l2_tokens=4096, max_batch=8, max_batch_tokens=4096)


# ---------------------------------------------------------------------------------------------- workloads
def _toks(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


def rag(z: Sizes, vocab: int, seed: int) -> Rounds:
    rng = np.random.default_rng(seed)
    doc = _toks(rng, vocab, z.doc)
    yield [GenRequest(doc + _toks(rng, vocab, z.question), z.rag_new) for _ in range(z.questions)], True


def fewshot(z: Sizes, vocab: int, seed: int) -> Rounds:
    rng = np.random.default_rng(seed + 1)
    shots = _toks(rng, vocab, z.shots)
    yield [GenRequest(shots + _toks(rng, vocab, z.target), z.label_new) for _ in range(z.targets)], True


def chat(z: Sizes, vocab: int, seed: int) -> Rounds:
    rng = np.random.default_rng(seed + 2)
    system = _toks(rng, vocab, z.system)
    hist = [system + _toks(rng, vocab, z.message) for _ in range(z.convs)]
    for _ in range(z.turns):
        res = yield [GenRequest(h, z.answer_new) for h in hist], True
        hist = [h + r.output + _toks(rng, vocab, z.message) for h, r in zip(hist, res, strict=True)]


def rag_ws(z: Sizes, vocab: int, seed: int) -> Rounds:
    rng = np.random.default_rng(seed + 3)
    docs = [_toks(rng, vocab, z.ws_doc) for _ in range(z.ws_docs)]
    for d in docs:  # warm-up pass: every document once (not measured)
        yield [GenRequest(d + _toks(rng, vocab, 64), 1)], False
    for _ in range(z.ws_passes):
        for i in rng.permutation(z.ws_docs):
            yield [GenRequest(docs[i] + _toks(rng, vocab, 64), 1)], True


WORKLOADS: dict[str, Callable[[Sizes, int, int], Rounds]] = {"rag": rag, "fewshot": fewshot, "chat": chat,
                                                              "rag_ws": rag_ws}


# ---------------------------------------------------------------------------------------------- ports
@dataclass
class Env:
    model: Decoder
    page_size: int
    dtype: str
    device: str
    io_backend: str
    l3_url: str
    write_policy: str
    redis_url: str = ""


def make_port(env: Env, mode: str, l1_tokens: int, l2_tokens: int) -> tuple[CachePort, str]:
    """The cache for ``mode`` and the name of its transfer engine."""
    layout = env.model.shape.kv_layout(env.page_size, env.dtype)
    if mode == "nocache":
        return NoCachePort(layout, l1_tokens // env.page_size, env.device), "-"

    def build(io: str) -> HiCache:
        cfg = config_from_dict({
            "model": {"name": "bench-8b", "revision": "random-seed"},
            "layout": {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                       "head_dim": layout.head_dim, "dtype": env.dtype, "page_size": env.page_size,
                       "attention": layout.attention},
            "cache": {"device": env.device, "l1_tokens": l1_tokens, "l2_tokens": l2_tokens if mode != "l1" else 0,
                      "write_policy": env.write_policy, "io_backend": io},
            "storage": {"url": {"l1l2l3": env.l3_url, "l1l2redis": env.redis_url}.get(mode, ""),
                        "prefetch_threshold_tokens": 0,
                        "prefetch_policy": "wait_complete"},
        })
        return HiCache(cfg)

    try:
        cache = build(env.io_backend)
    except ValueError as e:  # e.g. the CUDA engine is not available: the torch engine still works on GPU
        print(f"  [{mode}] io_backend {env.io_backend!r} unavailable ({e}); using 'cpu'")
        cache = build("cpu")
    return cache, getattr(cache.transfer, "name", type(cache.transfer).__name__)


def start_redis(spec: str) -> tuple[str, Any]:
    """(URL of the Redis for ``l1l2redis``, the local server to stop at the end or None); ("", None) when
    Redis is off or unavailable (a note says why)."""
    if spec == "off":
        return "", None
    try:
        import hicache.storage.redis_backend  # noqa: F401  (registers redis://; needs redis-py)
    except ImportError as e:
        print(f"  l1l2redis: skipped, the Redis backend does not import ({e})")
        return "", None
    if spec != "auto":
        return spec, None
    from hicache.storage.redis_local import LocalRedis, redis_server_binary

    if redis_server_binary() is None:
        print("  l1l2redis: skipped, redis-server is not installed (or pass --redis redis://HOST:PORT/0)")
        return "", None
    server = LocalRedis().start()
    atexit.register(server.stop)  # also when a workload fails
    return server.url, server


def close_port(port: CachePort) -> None:
    if isinstance(port, HiCache):
        port.close()
    del port
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- running
@dataclass
class Figures:
    workload: str
    mode: str
    engine: str
    requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    wall_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        t = sorted(self.ttft_s)
        pt = max(self.prompt_tokens, 1)
        return {
            "workload": self.workload, "mode": self.mode, "engine": self.engine, "requests": self.requests,
            "prompt_tokens": self.prompt_tokens, "computed_tokens": self.computed_tokens,
            "generated_tokens": self.generated_tokens,
            "requests_per_s": self.requests / self.wall_s if self.wall_s else 0.0,
            "prefill_tokens_per_s": self.computed_tokens / self.prefill_s if self.prefill_s else 0.0,
            "effective_prefill_tokens_per_s": self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0,
            "ttft_p50_ms": 1e3 * t[len(t) // 2] if t else 0.0,
            "ttft_p99_ms": 1e3 * t[min(len(t) - 1, int(0.99 * len(t)))] if t else 0.0,
            "ttft_mean_ms": 1e3 * statistics.fmean(t) if t else 0.0,
            "hit_rate": {k: v / pt for k, v in self.hit_tokens.items()},
            "hit_rate_total": sum(self.hit_tokens.values()) / pt,
            "reuse_rate": 1 - self.computed_tokens / pt,
            "ideal_speedup": self.prompt_tokens / max(self.computed_tokens, 1),
            "wall_s": self.wall_s, "prefill_s": self.prefill_s,
        }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_workload(node: ServingNode, rounds: Rounds, fig: Figures) -> None:
    reqs, measured = next(rounds)
    while True:
        sync()
        t0 = time.perf_counter()
        res = node.generate(reqs)
        sync()
        t1 = time.perf_counter()
        if measured:
            fig.requests += len(res)
            fig.wall_s += t1 - t0
            batches = {(r.t_start, r.t_first) for r in res}
            fig.prefill_s += sum(b - a for a, b in batches)
            for r in res:
                fig.prompt_tokens += r.prompt_tokens
                fig.computed_tokens += r.computed_tokens
                fig.generated_tokens += len(r.output)
                fig.ttft_s.append(r.t_first - t0)
                for k, v in r.hit_tokens.items():
                    fig.hit_tokens[k] += v
        try:
            reqs, measured = rounds.send(res)
        except StopIteration:
            return


def drain(port: CachePort) -> None:
    """Wait until the cache has no backup or L3 write in flight (a no-op without tiers)."""
    flush = getattr(port, "flush", None)
    if flush is not None:
        flush()
    sync()


def warm_up(env: Env) -> None:
    """cuBLAS handles, allocator, attention kernels of every path (dense prefill, one padded call over
    cached prefixes, batched decode), the transfer engine: a few requests through the no-cache path and
    through a cache, so no mode pays first-use costs inside its timed run."""
    v = env.model.shape.vocab_size
    doc = [i % v for i in range(1024)]
    reqs = [GenRequest(doc + [(7 * i + j) % v for j in range(128)], 3) for i in range(4)]
    for mode in ("nocache", "l1l2"):
        port, _ = make_port(env, mode, 8192, 8192)
        ServingNode(env.model, port).generate(reqs)
        sync()
        close_port(port)


def ttft_long_prefix(env: Env, z: Sizes) -> dict[str, Any]:
    """First token for a request whose ``long_prefix``-token prefix is recomputed, on L1 (the suffix's
    compute alone), loaded from L2 (served once, then evicted from L1), or from L3 (a file store: evicted
    from L1 and L2), each beside its in-run physical bound (:mod:`_ttft_probe`): an L2 hit against the
    prefix's bytes at the link's speed plus the L1 hit's time, an L3 hit against the prefix's bytes at the
    store's raw read rate plus the L1 hit's time. Each hit also gets the timeline of its last repetition."""
    vocab = env.model.shape.vocab_size
    layout = env.model.shape.kv_layout(env.page_size, env.dtype)
    rng = np.random.default_rng(99)
    prefix = _toks(rng, vocab, z.long_prefix)
    need = z.long_prefix + 4 * env.page_size + 128
    out: dict[str, Any] = {"prefix_tokens": z.long_prefix}
    l3_dir = tempfile.TemporaryDirectory(prefix="hicache-ttft-l3-")
    modes = ["nocache", "l1l2"] + (["l1l2l3"] if env.l3_url.startswith("file://") else [])
    for mode in modes:
        menv = replace(env, l3_url=f"file://{l3_dir.name}") if mode == "l1l2l3" else env
        port, engine = make_port(menv, mode, need * 2, need * 2)
        cache = port if isinstance(port, HiCache) else None
        traced = TracedPort(port)
        node = ServingNode(env.model, traced if cache is not None else port, max_batch=1)
        tier = {"l1l2": "l2", "l1l2l3": "l3"}.get(mode, "")

        def ask(node: ServingNode = node) -> GenResult:
            return node.generate([GenRequest(prefix + _toks(rng, vocab, 64), 1)])[0]

        def drop(cache: HiCache | None = cache, tier: str = tier) -> None:  # off L1 (and L2 for an L3 hit)
            if cache is not None:
                drain(cache)
                cache.evict(l1_pages=10**9, l2_pages=10**9 if tier == "l3" else 0)
            sync()

        ask()  # computes (and caches) the prefix
        drop()
        ask()  # one unmeasured hit: first use of this shape on the load path
        times, r = [], None
        for _ in range(z.reps):
            drop()
            traced.reset()
            r = ask()
            if tier:
                assert r.hit_tokens[tier] >= z.long_prefix - env.page_size, r.hit_tokens
            times.append(r.ttft_s)
        assert r is not None
        row: dict[str, Any] = {"ttft_ms": [1e3 * t for t in times], "ttft_median_ms": 1e3 * statistics.median(times),
                               "engine": engine}
        if tier:
            row["hit_pages"] = pages = r.hit_tokens[tier] // env.page_size
            row["hit_bytes"] = pages * layout.bytes_per_page
            row["timeline"] = traced.timeline.summary(r.t_first)
        if mode == "l1l2":  # the prefix is on L1 now: the suffix's compute alone
            l1 = []
            for _ in range(z.reps):
                traced.reset()
                h = ask()
                assert h.hit_tokens["l1"] >= z.long_prefix - env.page_size, h.hit_tokens
                l1.append(h.ttft_s)
            out["l1_hit"] = {"ttft_ms": [1e3 * t for t in l1], "ttft_median_ms": 1e3 * statistics.median(l1)}
            row["link_s"] = link = link_seconds(row["hit_bytes"], env.device)
            row["link_gb_s"] = row["hit_bytes"] / link / 1e9 if link else 0.0
        if mode == "l1l2l3":
            read_s, nbytes, files = read_seconds(l3_dir.name)
            row["read_s"], row["read_files"] = read_s, files
            row["read_gb_s"] = nbytes / read_s / 1e9 if read_s else 0.0
            row["store_read_s"] = read_s * row["hit_bytes"] / max(nbytes, 1)  # the prefix's share of the files
        out[mode] = row
        close_port(port)
    l3_dir.cleanup()
    suffix_ms = out["l1_hit"]["ttft_median_ms"]
    out["speedup"] = out["nocache"]["ttft_median_ms"] / out["l1l2"]["ttft_median_ms"]
    for mode, key in (("l1l2", "link_s"), ("l1l2l3", "store_read_s")):
        if mode in out:
            m = out[mode]
            m["bound_ms"] = 1e3 * m[key] + suffix_ms
            m["of_bound"] = m["ttft_median_ms"] / m["bound_ms"] if m["bound_ms"] else 0.0
    return out


def ttft_lines(tl: dict[str, Any], reps: int) -> list[str]:
    """The ttft16k figures as printed: each hit beside its bound, then where its time went."""
    suffix = tl["l1_hit"]["ttft_median_ms"]
    lines = [f"TTFT, {tl['prefix_tokens']}-token prefix + 64-token question (median of {reps}): recompute "
             f"{tl['nocache']['ttft_median_ms']:.1f} ms, prefix on L1 (suffix compute) {suffix:.1f} ms"]
    l2 = tl["l1l2"]
    lines.append(f"  L2 hit {l2['ttft_median_ms']:.1f} ms ({tl['speedup']:.1f}x sooner than recompute; engine "
                 f"{l2['engine']}); bound {l2['bound_ms']:.1f} ms = {l2['hit_bytes'] / 1e9:.2f} GB at the link's "
                 f"{l2['link_gb_s']:.1f} GB/s ({1e3 * l2['link_s']:.1f} ms) + {suffix:.1f} ms -> "
                 f"{l2['of_bound']:.2f}x the bound")
    if "l1l2l3" in tl:
        l3 = tl["l1l2l3"]
        lines.append(f"  L3 hit {l3['ttft_median_ms']:.1f} ms (file store); bound {l3['bound_ms']:.1f} ms = "
                     f"{l3['hit_bytes'] / 1e9:.2f} GB at the store's raw read rate {l3['read_gb_s']:.1f} GB/s "
                     f"({1e3 * l3['store_read_s']:.1f} ms) + {suffix:.1f} ms -> {l3['of_bound']:.2f}x the bound")
    for mode in ("l1l2", "l1l2l3"):
        if mode not in tl:
            continue
        t = tl[mode]["timeline"]
        steps = ", ".join(f"{s['step']} {s['ms']:.2f} ms @{s['start_ms']:.1f}" for s in t["steps"]
                          if s["step"] != "commit")
        lines.append(f"  timeline {mode}: {steps}; layer waits on the host {t['layer_wait_host_ms_total']:.1f} ms, "
                     f"GPU stalled {t['gpu_stall_ms_total']:.1f} ms over {t['layers']} layers, last layer ready "
                     f"@{t['host_last_layer_ready_ms']:.1f} ms (host), first token @{t['first_token_ms']:.1f} ms")
    return lines


def check_exactness(env: Env) -> dict[str, float]:
    """bf16 sanity check on the device: paged prefill over cached pages vs a dense forward."""
    m = env.model
    rng = np.random.default_rng(5)
    toks = _toks(rng, m.shape.vocab_size, 700)
    ref = m.forward_dense(toks)[-1]
    port = NoCachePort(m.shape.kv_layout(env.page_size, env.dtype), 64, env.device)
    from hicache.engine.model import make_batch
    pages = np.arange(64)[: -(-700 // env.page_size)]
    dev = torch.device(env.device)
    m.forward_paged(make_batch([toks[:512]], [0], [pages], env.page_size, dev), port.device_pool.kv)
    got = m.forward_paged(make_batch([toks[512:]], [512], [pages], env.page_size, dev), port.device_pool.kv)[0]
    rel = float((got - ref).norm() / ref.norm())
    # the ragged path (two segments over 512 shared cached tokens) against the padded path
    a = _toks(rng, m.shape.vocab_size, 40)
    b = _toks(rng, m.shape.vocab_size, 70)
    tables = [np.concatenate([pages[:8], [40]]), np.concatenate([pages[:8], [41, 42]])]
    outs = []
    for path in ("ragged", "padded"):
        m.attention_path = path
        outs.append(m.forward_paged(make_batch([a, b], [512, 512], tables, env.page_size, dev), port.device_pool.kv,
                                    all_logits=True))
    m.attention_path = "ragged"
    close_port(port)
    crel = float((outs[0] - outs[1]).norm() / outs[1].norm())
    return {"rel_err": rel, "same_argmax": float(int(got.argmax()) == int(ref.argmax())),
            "ragged_vs_padded_rel_err": crel}


# ---------------------------------------------------------------------------------------------- report
def table(rows: list[dict[str, Any]], base: dict[str, dict[str, Any]]) -> str:
    head = ("| workload | mode | req/s | x no-cache | prefill tok/s (computed / effective) | TTFT p50 / p99 / mean ms "
            "| hit L1 / L2 / L3 | ideal x | prefill x (of ideal) |")
    lines = [head, "|---" * 9 + "|"]
    for r in rows:
        b = base.get(r["workload"])
        rps_x = r["requests_per_s"] / b["requests_per_s"] if b and b["requests_per_s"] else float("nan")
        ideal = r["ideal_speedup"] / b["ideal_speedup"] if b else float("nan")
        pf_x = b["prefill_s"] / r["prefill_s"] if b and r["prefill_s"] else float("nan")
        h = r["hit_rate"]
        lines.append(
            f"| {r['workload']} | {r['mode']} | {r['requests_per_s']:.2f} | {rps_x:.2f} | "
            f"{r['prefill_tokens_per_s']:,.0f} / {r['effective_prefill_tokens_per_s']:,.0f} | "
            f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} / {r['ttft_mean_ms']:.1f} | "
            f"{h['l1']:.0%} / {h['l2']:.0%} / {h['l3']:.0%} | {ideal:.1f} | {pf_x:.1f} ({pf_x / ideal:.0%}) |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-8b", help="model preset (default llama-8b; tiny for CPU)")
    ap.add_argument("--dtype", default=None, help="bfloat16 (GPU default) | float32 (CPU default)")
    ap.add_argument("--device", default=None, help="cuda if available, else cpu")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes (CPU smoke test)")
    ap.add_argument("--workloads", default="rag,fewshot,chat,rag_ws,ttft16k")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--io-backend", default="auto")
    ap.add_argument("--write-policy", default="write_through")
    ap.add_argument("--l3-url", default="", help="L3 store of l1l2l3 (default: a file store in a temporary directory)")
    ap.add_argument("--redis", default="auto",
                    help="L3 of l1l2redis: a redis:// URL, 'auto' (start a local redis-server when installed) "
                         "or 'off'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="out/e2e_rag.json")
    a = ap.parse_args(argv)

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    z = Sizes.quick() if a.quick else Sizes()
    model_name = "tiny" if a.quick and a.model == "llama-8b" else a.model
    dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    shape = preset(model_name)
    tmp = tempfile.TemporaryDirectory(prefix="hicache-e2e-")
    l3 = a.l3_url or f"file://{tmp.name}/l3"
    try:
        import hicache.storage.file_backend  # noqa: F401
    except ImportError:
        l3 = a.l3_url or "memory://"
    t0 = time.perf_counter()
    model = Decoder.random(shape, a.seed, tdtype, device)
    sync()
    modes = a.modes.split(",")
    redis_url, local_redis = start_redis(a.redis) if "l1l2redis" in modes else ("", None)
    if not redis_url and "l1l2redis" in modes:
        modes.remove("l1l2redis")
    env = Env(model, a.page_size, dtype, device, a.io_backend, l3, a.write_policy, redis_url)
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    conditions = {
        "model": model_name, "params_b": shape.num_params() / 1e9, "dtype": dtype, "device": gpu,
        "torch": torch.__version__, "page_size": a.page_size, "write_policy": a.write_policy, "l3": l3,
        "redis": redis_url,
        "sizes": asdict(z), "weights": f"random (seed {a.seed})", "init_s": time.perf_counter() - t0,
    }
    print(f"# e2e: {model_name} ({conditions['params_b']:.1f}B params, {dtype}) on {gpu}, page {a.page_size}, "
          f"torch {torch.__version__}")
    conditions["exactness"] = check_exactness(env)
    print(f"  bf16 paged-vs-dense check: {conditions['exactness']}")
    warm_up(env)

    workloads = a.workloads.split(",")
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    base: dict[str, dict[str, Any]] = {}
    result: dict[str, Any] = {"conditions": conditions, "rows": rows, "errors": errors}
    if "ttft16k" in workloads:
        try:
            result["ttft_long_prefix"] = tl = ttft_long_prefix(env, z)
            print("\n".join(ttft_lines(tl, z.reps)), flush=True)
        except Exception as e:
            errors.append(f"ttft16k: {type(e).__name__}: {e}")
            print(f"  ttft16k: FAILED {type(e).__name__}: {e}", flush=True)
    for w in workloads:
        if w == "ttft16k" or w not in WORKLOADS:
            continue
        for mode in modes:
            if w == "rag_ws" and mode == "nocache":
                continue  # the tiers' comparison is l1 vs l1l2 (vs l1l2l3)
            l1, l2 = z.l1_tokens, z.l2_tokens
            if w == "rag_ws":
                l1 = z.ws_l1_docs * (z.ws_doc + 2 * a.page_size)
                per_doc = z.ws_doc + 64 + 2 * a.page_size  # document, question, decoded token
                l2 = (z.ws_docs + z.ws_docs // 2) * per_doc if mode == "l1l2" else 2 * l1  # L3 modes: L2 = 2 x L1
            port, engine = make_port(env, mode, l1, l2)
            node = ServingNode(model, port, 1 if w == "rag_ws" else z.max_batch, z.max_batch_tokens)
            fig = Figures(w, mode, engine)
            try:
                if w != "rag_ws":  # first use of this batch shape: a pass on other tokens, not measured
                    run_workload(node, WORKLOADS[w](z, shape.vocab_size, a.seed + 1000), Figures(w, mode, engine))
                    drain(port)  # its backups and L3 writes finish before the measured pass
                run_workload(node, WORKLOADS[w](z, shape.vocab_size, a.seed), fig)
            except Exception as e:  # keep the other rows; the error is reported in the JSON
                print(f"  {w} {mode}: FAILED {type(e).__name__}: {e}", flush=True)
                errors.append(f"{w}/{mode}: {type(e).__name__}: {e}")
                close_port(port)
                continue
            s = fig.summary()
            s["l1_tokens"], s["l2_tokens"] = l1, (l2 if mode in ("l1l2", *L3_MODES) else 0)
            rows.append(s)
            if mode == "nocache" or (w == "rag_ws" and mode == "l1"):
                base[w] = s
            print(f"  {w:8s} {mode:7s} engine={engine:10s} req/s={s['requests_per_s']:8.2f} "
                  f"prefill tok/s={s['prefill_tokens_per_s']:10,.0f} TTFT p50={s['ttft_p50_ms']:8.1f} ms "
                  f"mean={s['ttft_mean_ms']:8.1f} ms hit={s['hit_rate_total']:.0%} ideal={s['ideal_speedup']:.1f}x",
                  flush=True)
            close_port(port)

    print()
    print(f"Conditions: {model_name}-shaped decoder ({conditions['params_b']:.1f}B params, random weights), {dtype}, "
          f"{gpu}, torch {torch.__version__}, eager PyTorch, L1 page {a.page_size} tokens, write policy "
          f"{a.write_policy}, L3 {l3.split(':')[0]} store (l1l2l3)"
          f"{', Redis (l1l2redis)' if 'l1l2redis' in modes else ''}; ratios vs the in-run no-cache baseline "
          f"(rag_ws: vs L1 only); TTFT from the arrival of the request's round.")
    print(table(rows, base))
    if "ttft_long_prefix" in result:
        tl = result["ttft_long_prefix"]
        print()
        print("\n".join(ttft_lines(tl, z.reps)))
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nJSON: {out}")
    if local_redis is not None:
        local_redis.stop()
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
