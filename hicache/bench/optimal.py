"""Offline bounds on the prefix-cache hit rate: Belady's optimum on the prefix tree, and infinite capacity.

A request is a path of pages from the root: its prompt's full pages (whose hits count) followed by the
pages its output adds (cached after the request, never counted as hits of that request). A page is
named by its whole prefix, so a page can only be used when every page before it is cached.

:func:`belady` keeps at most ``capacity`` pages and, whenever a page of the current request is not
cached, keeps it only if some cached page is next used (as a prompt page) later than it, evicting the one
used furthest in the future, deeper pages first on ties -- MIN with bypass. A page's next use is never
earlier than its parent's, so the evicted page is always a leaf of the cached set and the set stays
prefix-closed: the prefix hit count equals the classic page hit count, for which MIN is optimal. Every
online prefix cache with the same capacity (any eviction policy, request-at-a-time) therefore hits at most
what :func:`belady` hits. ``capacity=None`` gives the infinite-capacity bound: every page seen before hits.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hicache.bench.workloads import TraceRequest

INF = 1 << 62


class PagedTrace(NamedTuple):
    """A trace as page ids: equal ids <=> equal pages *and* equal prefixes."""

    page_size: int
    prompt: list[list[int]]  # per request: ids of the prompt's full pages, root side first
    extra: list[list[int]]  # per request: ids of the further full pages of prompt + output
    prompt_tokens: np.ndarray  # per request: prompt length in tokens (partial page included)
    num_pages: int  # distinct pages in the trace (the working set, in pages)

    @property
    def working_set_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_prompt_tokens(self) -> int:
        return int(self.prompt_tokens.sum())


def page_trace(requests: Sequence[TraceRequest], page_size: int) -> PagedTrace:
    """Intern every full page of every request's prompt + output by (parent page, tokens)."""
    ids: dict[tuple[int, bytes], int] = {}
    stride = page_size * 4
    prompt: list[list[int]] = []
    extra: list[list[int]] = []
    for r in requests:
        seq = np.concatenate([r.tokens, r.output]).astype("<u4", copy=False).tobytes()
        n_prompt = len(r.tokens) // page_size
        path: list[int] = []
        parent = -1
        for off in range(0, len(seq) - len(seq) % stride, stride):
            key = (parent, seq[off: off + stride])
            pid = ids.get(key)
            if pid is None:
                pid = ids[key] = len(ids)
            path.append(pid)
            parent = pid
        prompt.append(path[:n_prompt])
        extra.append(path[n_prompt:])
    lengths = np.array([len(r.tokens) for r in requests], dtype=np.int64)
    return PagedTrace(page_size, prompt, extra, lengths, len(ids))


class BoundResult(NamedTuple):
    capacity_pages: int | None  # None: infinite
    hit_pages: np.ndarray  # per request: prompt pages hit
    page_size: int
    prompt_tokens: np.ndarray

    @property
    def hit_tokens(self) -> int:
        return int(self.hit_pages.sum()) * self.page_size

    @property
    def hit_rate(self) -> float:
        total = int(self.prompt_tokens.sum())
        return self.hit_tokens / total if total else 0.0

    @property
    def request_hit_rate(self) -> float:
        return float((self.hit_pages > 0).mean()) if len(self.hit_pages) else 0.0


def _next_uses(trace: PagedTrace) -> tuple[list[list[int]], list[list[int]]]:
    """For each page occurrence, the index of the next request whose *prompt* holds that page (INF: none)."""
    last: dict[int, int] = {}
    nu_p: list[list[int]] = [[] for _ in trace.prompt]
    nu_x: list[list[int]] = [[] for _ in trace.prompt]
    for r in range(len(trace.prompt) - 1, -1, -1):
        get = last.get
        nu_p[r] = [get(p, INF) for p in trace.prompt[r]]
        nu_x[r] = [get(p, INF) for p in trace.extra[r]]
        for p in trace.prompt[r]:
            last[p] = r
    return nu_p, nu_x


def infinite(trace: PagedTrace) -> BoundResult:
    """Hit pages when nothing is ever evicted."""
    seen: set[int] = set()
    hits = np.zeros(len(trace.prompt), dtype=np.int64)
    for r, (pp, xx) in enumerate(zip(trace.prompt, trace.extra, strict=True)):
        k = 0
        for p in pp:
            if p not in seen:
                break
            k += 1
        hits[r] = k
        seen.update(pp)
        seen.update(xx)
    return BoundResult(None, hits, trace.page_size, trace.prompt_tokens)


def belady(trace: PagedTrace, capacity_pages: int | None) -> BoundResult:
    """Optimal prompt-page hits with at most ``capacity_pages`` cached (see the module docstring)."""
    if capacity_pages is None or capacity_pages >= trace.num_pages:
        return infinite(trace)
    cap = max(int(capacity_pages), 0)
    nu_p, nu_x = _next_uses(trace)
    key: dict[int, tuple[int, int]] = {}  # cached page -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, page), lazily invalidated
    hits = np.zeros(len(trace.prompt), dtype=np.int64)
    for r in range(len(trace.prompt)):
        pp = trace.prompt[r]
        k = 0
        for p in pp:
            if p not in key:
                break
            k += 1
        hits[r] = k
        path = pp + trace.extra[r]
        nus = nu_p[r] + nu_x[r]
        for depth, (p, nu) in enumerate(zip(path, nus, strict=True)):
            if p in key:
                key[p] = (nu, depth)
                heapq.heappush(heap, (-nu, -depth, p))
                continue
            if nu >= INF or cap == 0:
                break
            if len(key) < cap:
                key[p] = (nu, depth)
                heapq.heappush(heap, (-nu, -depth, p))
                continue
            while True:  # the valid furthest entry
                fn, fd, f = heap[0]
                if key.get(f) == (-fn, -fd):
                    break
                heapq.heappop(heap)
            if (-fn, -fd) > (nu, depth):
                heapq.heappop(heap)
                del key[f]
                key[p] = (nu, depth)
                heapq.heappush(heap, (-nu, -depth, p))
            else:
                break  # bypass: every later page of this path is used no earlier than this one
        if len(heap) > 4 * cap + 64:  # drop stale entries
            heap = [(-n, -d, p) for p, (n, d) in key.items()]
            heapq.heapify(heap)
    return BoundResult(cap, hits, trace.page_size, trace.prompt_tokens)
