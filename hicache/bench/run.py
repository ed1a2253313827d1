"""One benchmark run: build the requests, replay them against the target, compute the bounds and the
hit-rate-vs-capacity curve, and return a typed :class:`BenchResult` (rendered by :mod:`~hicache.bench.report`).

Capacities are tokens, bytes (converted with the *model* layout's KV bytes per token, e.g. 128 KiB for
Llama-3.1-8B in bf16) or shares of the working set (distinct pages of the trace). The replay itself uses
a tiny KV layout (one layer, one head, ``head_dim`` 1, one byte) with the same page size: hit rates
depend only on tokens and pages; bytes and times are derived from the model layout.

Prefill time saved = tokens not recomputed / prefill rate - time to load them (L2 -> L1 at the L2
bandwidth, L3 -> L1 at the L3 bandwidth).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.bench.errors import BenchInputError
from hicache.bench.optimal import PagedTrace, belady, infinite, page_trace
from hicache.bench.replay import ReplayResult, replay
from hicache.bench.sizing import Sizing, size_for_bound
from hicache.bench.targets import GrpcTarget, InProcessTarget, RouterTarget, Target, is_router, open_target
from hicache.bench.tokenizer import WordTokenizer, load_tokenizer
from hicache.bench.traces import MOONCAKE_BLOCK, is_mooncake, load_trace
from hicache.bench.units import Size, parse_size
from hicache.bench.workloads import TraceRequest, WorkloadSpec, generate
from hicache.config import CacheConfig, ConfigError, HiCacheConfig, LayoutConfig, ModelConfig, StorageConfig
from hicache.eviction import policy_names
from hicache.layout import KVLayout

MODEL_LAYOUTS: dict[str, KVLayout] = {
    "llama-3.1-8b": KVLayout(32, 8, 128, "bfloat16"),
    "llama-3.1-70b": KVLayout(80, 8, 128, "bfloat16"),
    "qwen2.5-7b": KVLayout(28, 4, 128, "bfloat16"),
    "deepseek-v3": KVLayout(61, 1, 576, "bfloat16", attention="mla"),
    "small": KVLayout(8, 4, 64, "bfloat16"),  # the reference decoder's "small" preset (CPU-measurable)
    "tiny": KVLayout(2, 2, 16, "bfloat16"),  # its "tiny" preset (tests)
}
DEFAULT_CURVE = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
# DESIGN figures (H200 host): eager 8B prefill ~41k tokens/s; pinned host -> GPU ~50 GB/s; one store ~2 GB/s.
DEFAULT_PREFILL_RATE = 41_000.0
DEFAULT_L2_BW = 50e9
DEFAULT_L3_BW = 2e9


@dataclass
class BenchOptions:
    workload: str = "mixed"
    trace: str | None = None
    trace_format: str = "auto"
    requests: int = 600
    limit: int | None = None  # first N requests of a trace
    seed: int = 0
    plant: str | None = None  # volatile span planted at the start of workload prompts
    tokenizer: str | None = None
    l1: Size = field(default_factory=lambda: parse_size("10%"))
    l2: Size = field(default_factory=lambda: parse_size("25%"))
    l3: str = "file"  # "file" (temporary folder), "memory", "none" or a storage URL
    page_size: int | None = None  # None: 64, or 512 for Mooncake traces
    write_policy: str = CacheConfig.write_policy
    eviction_policy: str = CacheConfig.eviction_policy
    prefetch_policy: str = "wait_complete"
    target: str = "inproc"
    model_layout: str = "llama-3.1-8b"
    prefill_rate: float = DEFAULT_PREFILL_RATE
    l2_bandwidth: float = DEFAULT_L2_BW
    l3_bandwidth: float = DEFAULT_L3_BW
    curve: Sequence[float] = DEFAULT_CURVE
    follow_timestamps: bool = False
    speed: float = 1.0
    settle: bool | None = None  # None: settle unless following the timestamps
    clear: bool = False  # drop a live target's L1 / L2 pages first (its Clear call), so the run starts cold

    @property
    def settles(self) -> bool:
        """Whether the replay waits for background copies after each request (see ``replay``)."""
        return self.settle if self.settle is not None else not self.follow_timestamps

    def check(self) -> None:
        if self.eviction_policy not in policy_names():
            raise BenchInputError(f"--eviction-policy: unknown policy {self.eviction_policy!r}; "
                                  f"known: {', '.join(policy_names())}")
        if self.model_layout not in MODEL_LAYOUTS:
            raise BenchInputError(f"--model-layout: unknown layout {self.model_layout!r}; "
                                  f"known: {', '.join(MODEL_LAYOUTS)}")
        if self.page_size is not None and self.page_size < 1:
            raise BenchInputError(f"--page-size: must be >= 1, got {self.page_size}")
        if not all(math.isfinite(v) and v > 0 for v in (self.prefill_rate, self.l2_bandwidth, self.l3_bandwidth)):
            raise BenchInputError("--prefill-rate and bandwidths must be finite numbers > 0")
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise BenchInputError(f"--speed: must be a finite number > 0, got {self.speed}")


@dataclass
class Workload:
    """The requests of a run and where they came from."""

    requests: list[TraceRequest]
    source: str
    page_size: int
    tokenizer: Any


def load_requests(opts: BenchOptions) -> Workload:
    if opts.page_size is not None and opts.page_size < 1:
        raise BenchInputError(f"--page-size: must be >= 1, got {opts.page_size}")
    if opts.limit is not None and opts.limit < 1:
        raise BenchInputError(f"--limit: must be >= 1, got {opts.limit}")
    tok = load_tokenizer(opts.tokenizer)
    if opts.trace:
        reqs = load_trace(opts.trace, opts.trace_format, tok, opts.limit)
        ps = opts.page_size or (MOONCAKE_BLOCK if is_mooncake(reqs) else 64)
        return Workload(reqs, f"trace {opts.trace}", ps, tok)
    word = tok if isinstance(tok, WordTokenizer) else WordTokenizer()
    spec = WorkloadSpec(opts.workload, opts.requests, opts.seed, volatile=opts.plant)
    src = f"workload {opts.workload} (seed {opts.seed}{', planted ' + opts.plant if opts.plant else ''})"
    return Workload(generate(spec, word), src, opts.page_size or 64, word)


def replay_config(page_size: int, l1_tokens: int, l2_tokens: int, storage_url: str = "",
                  write_policy: str = CacheConfig.write_policy, eviction_policy: str = "lru",
                  prefetch_policy: str = "wait_complete") -> HiCacheConfig:
    """A cache config with the tiny hit-rate layout (see the module docstring)."""
    return HiCacheConfig(
        model=ModelConfig(name="hicache-bench"),
        layout=LayoutConfig(1, 1, 1, "uint8", page_size),
        cache=CacheConfig(l1_tokens=max(l1_tokens, page_size), l2_tokens=l2_tokens, write_policy=write_policy,
                          eviction_policy=eviction_policy, io_backend="cpu"),
        storage=StorageConfig(url=storage_url, prefetch_policy=prefetch_policy, prefetch_threshold_tokens=0),
    )


@contextlib.contextmanager
def storage_url(l3: str) -> Iterator[tuple[str, str]]:
    """Yield (url, description) for ``--l3``: ``file`` makes a temporary folder (removed after),
    falling back to ``memory://`` when the file backend is not installed."""
    if l3 in ("none", ""):
        yield "", "none"
        return
    if l3 == "memory":
        yield "memory://", "memory://"
        return
    if l3 != "file":
        if "://" not in l3:
            raise BenchInputError(f"--l3 {l3!r}: file, memory, none, or a storage URL (redis://..., file:///path)")
        yield l3, l3
        return
    try:
        importlib.import_module("hicache.storage.file_backend")
    except ImportError:
        yield "memory://", "memory:// (file backend unavailable)"
        return
    tmp = tempfile.mkdtemp(prefix="hicache-bench-")
    try:
        yield f"file://{tmp}", f"file://{tmp} (temporary)"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def open_l3(target: str, cfg: HiCacheConfig, url: str) -> Target:
    """:func:`open_target`, with an L3 URL the store's backend cannot open (no host, a port out of range, a
    bucket that does not resolve) as a :class:`BenchInputError` naming ``--l3`` (without its password)."""
    try:
        return open_target(target, cfg)
    except ConfigError:
        raise
    except (ValueError, OSError) as e:
        if not url:
            raise
        hide = re.compile(r"(://)[^/\s]*@")  # user:password@
        why = hide.sub(r"\1<hidden>@", (str(e).strip().splitlines() or [type(e).__name__])[0])
        raise BenchInputError(f"--l3 {hide.sub('://', url).partition('?')[0]}: cannot open the store ({why})") from None


def check_store(target: Target) -> None:
    """Refuse to replay against an L3 that does not answer (its hit rate would read 0%, silently):
    :class:`BenchInputError` naming ``--l3`` and the reason; closes ``target`` first."""
    if not isinstance(target, InProcessTarget) or target.cache.storage is None:
        return
    store = target.cache.storage
    why = store.probe()
    if why is not None:
        target.close()
        raise BenchInputError(f"--l3 {store.url_safe}: the store does not answer ({why})")


class TierStats(dict[str, float]):
    """tokens / token_rate / request_rate for one tier (a dict for JSON)."""


@dataclass
class CurvePoint:
    fraction: float  # of the working set
    capacity_tokens: int
    policy: float  # hit rate of the eviction policy (in-process, L1 only)
    optimal: float  # Belady at that capacity


@dataclass
class BenchResult:
    source: str
    requests: int
    prompt_tokens: int
    working_set_tokens: int
    page_size: int
    model_layout: str
    bytes_per_token: int
    l1_tokens: int
    l2_tokens: int
    l3: str
    target: str
    policies: dict[str, str]
    tiers: dict[str, TierStats]  # l1, l2, l3, total
    reused_tokens: int  # tokens not recomputed
    prefill_seconds_saved: float
    prefill_seconds_total: float  # recomputing every prompt token
    optimal_same_capacity: float  # Belady at L1+L2 (infinite with an in-process L3 store and L2 > 0;
    # a remote target's: L1+L2)
    optimal_l1: float  # Belady at the L1 capacity alone
    infinite: float  # every page seen before hits
    curve: list[CurvePoint]
    wall_s: float
    cache_s: float
    stats: dict[str, Any]
    per_request: ReplayResult | None = None
    settled: bool = False  # background copies waited for after each request
    sizing: Sizing | None = None  # the L2 that would close the gap to the bound, replayed (in-process only)
    prefill_rate: float = DEFAULT_PREFILL_RATE  # tokens/s the time figures assume
    l2_bandwidth: float = DEFAULT_L2_BW  # bytes/s
    l3_bandwidth: float = DEFAULT_L3_BW

    @property
    def hit_rate(self) -> float:
        return self.tiers["total"]["token_rate"]

    @property
    def gap(self) -> float:
        return self.optimal_same_capacity - self.hit_rate

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k != "per_request"}
        d["curve"] = [vars(p) for p in self.curve]
        d["sizing"] = None if self.sizing is None else self.sizing.to_dict()
        d["hit_rate"] = self.hit_rate
        d["gap_to_optimal"] = self.gap
        return d


def _tiers(r: ReplayResult) -> dict[str, TierStats]:
    out: dict[str, TierStats] = {}
    for name, col in (("l1", r.l1), ("l2", r.l2), ("l3", r.l3), ("total", r.hit)):
        out[name] = TierStats(tokens=float(col.sum()), token_rate=r.rate(col), request_rate=r.request_rate(col))
    return out


def _saved_seconds(r: ReplayResult, bpt: int, opts: BenchOptions) -> float:
    from_l2 = np.minimum(r.l2, np.maximum(r.reused - r.l1, 0))
    from_l3 = np.maximum(r.reused - r.l1 - from_l2, 0)
    load = (float(from_l2.sum()) * bpt / opts.l2_bandwidth) + (float(from_l3.sum()) * bpt / opts.l3_bandwidth)
    return float(r.reused.sum()) / opts.prefill_rate - load


def policy_hit_rate(requests: Sequence[TraceRequest], page_size: int, capacity_tokens: int, policy: str) -> float:
    """Hit rate of an in-process L1-only cache of ``capacity_tokens`` under eviction ``policy``."""
    cfg = replay_config(page_size, capacity_tokens, 0, eviction_policy=policy)
    with InProcessTarget(cfg) as t:
        return replay(requests, t).hit_rate


def curve(requests: Sequence[TraceRequest], pt: PagedTrace, fractions: Sequence[float], policy: str,
          tick: Callable[[], None] | None = None) -> list[CurvePoint]:
    out = []
    for f in fractions:
        cap_pages = max(1, int(f * pt.num_pages))
        cap = cap_pages * pt.page_size
        out.append(CurvePoint(f, cap, policy_hit_rate(requests, pt.page_size, cap, policy),
                              belady(pt, cap_pages).hit_rate))
        if tick is not None:
            tick()
    return out


def run_bench(opts: BenchOptions, wl: Workload | None = None,
              progress: Callable[[str, int, int], None] | None = None) -> BenchResult:
    """Run the benchmark; ``progress(stage, done, total)`` is called as it goes."""
    opts.check()
    wl = wl or load_requests(opts)
    reqs, ps = wl.requests, wl.page_size
    remote: GrpcTarget | RouterTarget | None = None
    if opts.target.startswith("grpc://"):  # the node (or the router's nodes) decide page size and capacities
        remote = RouterTarget(opts.target) if is_router(opts.target) else GrpcTarget(opts.target)
        if opts.page_size is not None and opts.page_size != remote.page_size:
            remote.close()
            raise BenchInputError(f"--page-size {opts.page_size}: the node at {opts.target} uses pages of "
                                  f"{remote.page_size} tokens")
        ps = remote.page_size
    layout = MODEL_LAYOUTS[opts.model_layout]
    bpt = layout.bytes_per_token
    pt = page_trace(reqs, ps)
    ws = pt.working_set_tokens
    l1 = remote.l1_tokens if remote else opts.l1.to_tokens(bpt, ws) // ps * ps
    l2 = remote.l2_tokens if remote else opts.l2.to_tokens(bpt, ws) // ps * ps
    if l1 < ps:
        raise BenchInputError(f"--l1: {opts.l1.describe()} is less than one page of {ps} tokens")
    # the replay fills no more than every distinct page plus one request's: a larger L1 or L2 replays the
    # same, so its pools stop there (--l1 100g on a small trace would otherwise ask for 200 GB)
    room = ws + max((len(r.tokens) + len(r.output) for r in reqs), default=0) // ps * ps + ps
    with storage_url("none" if remote else opts.l3) as (url, l3_desc):
        if remote:
            target: Target = remote
            l3_desc = "the node's"
        else:
            cfg = replay_config(ps, min(l1, room), min(l2, room), url, opts.write_policy, opts.eviction_policy,
                                opts.prefetch_policy)
            target = open_l3(opts.target, cfg, url)
            check_store(target)
        try:
            if opts.clear:
                target.clear()
            cb = (lambda i: progress("replay", i, len(reqs))) if progress else None
            r = replay(reqs, target, cb, opts.follow_timestamps, opts.speed, opts.settles)
        finally:
            target.close()
    inf = infinite(pt).hit_rate
    l3_unbounded = bool(url) and l2 > 0  # a remote node's L3 is not known: its optimum covers L1 + L2
    opt_same = inf if l3_unbounded else belady(pt, (l1 + l2) // ps).hit_rate
    opt_l1 = belady(pt, l1 // ps).hit_rate
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress:
            progress("capacity sweep", done[0], len(opts.curve))

    pts = curve(reqs, pt, opts.curve, opts.eviction_policy, tick)
    return BenchResult(
        source=wl.source, requests=len(reqs), prompt_tokens=pt.total_prompt_tokens, working_set_tokens=ws,
        page_size=ps, bytes_per_token=bpt,
        model_layout=f"{opts.model_layout}: {layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
        f"{layout.head_dim} {layout.dtype} {layout.attention}",
        l1_tokens=l1, l2_tokens=l2, l3=l3_desc, target=opts.target,
        policies=({"write": "node's", "eviction": "node's", "prefetch": "node's"} if remote else
                  {"write": opts.write_policy, "eviction": opts.eviction_policy, "prefetch": opts.prefetch_policy}),
        tiers=_tiers(r), reused_tokens=int(r.reused.sum()),
        prefill_seconds_saved=_saved_seconds(r, bpt, opts),
        prefill_seconds_total=pt.total_prompt_tokens / opts.prefill_rate,
        optimal_same_capacity=opt_same, optimal_l1=opt_l1, infinite=inf, curve=pts,
        wall_s=r.wall_s, cache_s=r.cache_s, stats=r.stats, per_request=r, settled=r.settled,
        prefill_rate=opts.prefill_rate, l2_bandwidth=opts.l2_bandwidth, l3_bandwidth=opts.l3_bandwidth,
        sizing=None if remote else check_sizing(reqs, ps, l1, l2, _tiers(r)["total"]["token_rate"], inf, pts, opts),
    )


def check_sizing(requests: Sequence[TraceRequest], page_size: int, l1: int, l2: int, hit_rate: float,
                 bound: float, pts: Sequence[CurvePoint], opts: BenchOptions) -> Sizing | None:
    """The L2 suggested by the curve (:func:`~hicache.bench.sizing.size_for_bound`), replayed in-process
    with the run's L1 and policies and no L3, so its hit rate is measured."""
    s = size_for_bound(hit_rate, bound, l1, l2, pts)
    if s is None:
        return None
    cfg = replay_config(page_size, l1, s.l2_tokens, "", opts.write_policy, opts.eviction_policy, opts.prefetch_policy)
    with InProcessTarget(cfg) as t:
        return s.checked(replay(requests, t, settle=opts.settles).hit_rate)
