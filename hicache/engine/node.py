"""The reference serving node: a decoder computing with pages the cache brought back.

For each batch of requests::

    match -> prefetch (L3 -> L2) -> load_back (L2 -> L1)        # per request, through the cache port
    prefill the uncached suffix only, attending over the cached prefix pages;
        before layer i: load.wait_layer(i)                     # loading overlaps compute
    commit the prompt's full pages -> greedy decode -> commit what decoding filled -> release

A request whose prompt is entirely cached still recomputes its last page (the model needs the last
token's logits); the copy it computes is its own and is freed at release. Batches are admitted in
arrival order; a request that shares more full pages with a request already in the batch than the cache
can give it waits for the next batch, so a shared prefix is computed once, not once per request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache.engine.model import Decoder, make_batch
from hicache.engine.port import CachePort


@dataclass
class GenRequest:
    tokens: Sequence[int]  # the prompt
    max_new_tokens: int = 1  # >= 1: the first generated token comes from the prefill
    ns: Any = None  # cache namespace (tenant); None = the cache's default
    stop_token: int | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) < 1:
            raise ValueError("GenRequest.tokens: the prompt must hold at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"GenRequest.max_new_tokens: must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenResult:
    output: list[int]  # generated tokens (greedy)
    prompt_tokens: int
    computed_tokens: int  # prompt tokens the model computed (the rest came from the cache)
    hit_tokens: dict[str, int]  # prompt tokens matched per tier: {"l1", "l2", "l3"}
    t_start: float  # perf_counter when its batch was admitted
    t_first: float  # ... when its first token was known (host-side, after the device finished)
    t_done: float
    prompt_logits: torch.Tensor | None = None  # fp32 [computed_tokens, vocab] (collect_logits only)
    step_logits: list[torch.Tensor] = field(default_factory=list)  # fp32 [vocab] per generated token

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens - self.computed_tokens

    @property
    def ttft_s(self) -> float:
        return self.t_first - self.t_start


@dataclass
class _Seq:
    idx: int
    req: GenRequest
    handle: Any
    t_start: float
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    load: Any = None
    table: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # L1 page per position // S
    prefix: int = 0  # prompt tokens taken from the cache
    kv_len: int = 0  # tokens whose K/V are in the pages
    committed_pages: int = 0
    out: list[int] = field(default_factory=list)
    t_first: float = 0.0
    prompt_logits: torch.Tensor | None = None
    step_logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        r = self.req
        return len(self.out) >= r.max_new_tokens or (r.stop_token is not None and bool(self.out)
                                                      and self.out[-1] == r.stop_token)


class _PrefixPrints:
    """Fingerprints of a token array's prefixes at page boundaries: entry ``i`` stands for pages
    ``0..i``. Equal prefixes give equal fingerprints; a collision (random 64-bit linear hashing) could
    only change how requests are grouped into batches, never what any request computes."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._rng = np.random.default_rng(0x9E3779B97F4A7C15)
        self._w = self._rng.integers(1, 2**63, page_size, dtype=np.uint64) | np.uint64(1)
        self._m = np.zeros(0, dtype=np.uint64)

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        S = self.page_size
        n = len(tokens) // S
        if n > len(self._m):
            more = self._rng.integers(1, 2**63, max(n, 2 * len(self._m)) - len(self._m), dtype=np.uint64)
            self._m = np.concatenate([self._m, more | np.uint64(1)])
        h = (tokens[: n * S].reshape(n, S).astype(np.uint64) * self._w).sum(1, dtype=np.uint64)
        return np.cumsum(h * self._m[:n], dtype=np.uint64)


class ServingNode:
    """Serves generation requests with a :class:`Decoder` over a cache port's L1 pool."""

    def __init__(self, model: Decoder, port: CachePort, max_batch: int = 32, max_batch_tokens: int = 32768,
                 collect_logits: bool = False) -> None:
        if max_batch < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch and max_batch_tokens must be >= 1")
        pool = port.device_pool
        if pool.layout.num_layers != model.shape.num_layers or pool.kv[0][0].dtype != model.dtype:
            raise ValueError("the cache's KV layout does not match the model (layers / dtype)")
        if pool.device.type != model.device.type:
            raise ValueError(f"the L1 pool is on {pool.device}, the model on {model.device}")
        self.model = model
        self.port = port
        self.page_size = port.page_size
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.collect_logits = collect_logits
        self._prints = _PrefixPrints(self.page_size)

    # ------------------------------------------------------------------ public
    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Serve ``requests`` in arrival order, in batches; returns one result per request, in order."""
        vocab = self.model.shape.vocab_size
        for i, r in enumerate(requests):
            lo, hi = min(r.tokens), max(r.tokens)
            if lo < 0 or hi >= vocab:
                raise ValueError(f"request {i}: token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab})")
        pending = deque(enumerate(requests))
        results: list[GenResult | None] = [None] * len(requests)
        while pending:
            batch = self._admit(pending)
            try:
                self._prefill(batch)
                self._decode(batch)
                for s in batch:
                    self._commit(s)
            finally:
                for s in batch:
                    self.port.release(s.handle)
            t_done = time.perf_counter()
            for s in batch:
                results[s.idx] = GenResult(
                    s.out, len(s.req.tokens), len(s.req.tokens) - s.prefix,
                    {t: int(getattr(s.handle, f"{t}_pages")) * self.page_size for t in ("l1", "l2", "l3")},
                    s.t_start, s.t_first, t_done, s.prompt_logits, s.step_logits)
        return [r for r in results if r is not None]

    # ------------------------------------------------------------------ steps
    def _admit(self, pending: deque[tuple[int, GenRequest]]) -> list[_Seq]:
        S = self.page_size
        batch: list[_Seq] = []
        seen: list[tuple[Any, set[tuple[int, int]]]] = []  # per namespace: (i, print of pages 0..i) in the batch
        budget = 0
        t0 = time.perf_counter()
        while pending and len(batch) < self.max_batch:
            idx, r = pending[0]
            h = self.port.match(r.tokens, r.ns)
            hit = h.l1_pages + h.l2_pages + h.l3_pages
            arr = np.asarray(r.tokens, dtype=np.int64)
            prints = self._prints(arr)
            # a batch member shares more full pages than the cache gives: compute them once, next batch
            shares_more = hit < len(prints) and any(ns == r.ns and (hit, int(prints[hit])) in st for ns, st in seen)
            new_tokens = len(r.tokens) - hit * S
            if batch and (shares_more or budget + new_tokens > self.max_batch_tokens):
                self.port.release(h)
                break
            pending.popleft()
            budget += new_tokens
            batch.append(_Seq(idx, r, h, t0, list(r.tokens)))
            mine = next((st for ns, st in seen if ns == r.ns), None)
            if mine is None:
                mine = set()
                seen.append((r.ns, mine))
            mine.update(enumerate(prints.tolist()))
        return batch

    def _prefill(self, batch: list[_Seq]) -> None:
        S, port = self.page_size, self.port
        for s in batch:
            port.prefetch(s.handle)
        for s in batch:
            s.load = port.load_back(s.handle)
            dev = np.asarray(s.load.device_indices, dtype=np.int64)
            n = len(s.req.tokens)
            use = min(len(dev), (n - 1) // S)  # keep at least one token to compute
            new = port.alloc(s.handle, -(-n // S) - use)
            s.table = np.concatenate([dev[:use], new])
            s.prefix = use * S

        def layer_ready(layer: int) -> None:
            for s in batch:
                s.load.wait_layer(layer)

        mb = make_batch([s.tokens[s.prefix:] for s in batch], [s.prefix for s in batch], [s.table for s in batch],
                        S, self.model.device)
        logits = self.model.forward_paged(mb, self.port.device_pool.kv, layer_ready, all_logits=self.collect_logits)
        if self.collect_logits:
            per_seq = list(torch.split(logits, [s.req.tokens.__len__() - s.prefix for s in batch]))
            last = torch.stack([x[-1] for x in per_seq])
        else:
            last = logits
        nxt = last.argmax(-1).tolist()
        t = time.perf_counter()
        for i, s in enumerate(batch):
            s.kv_len = len(s.tokens)
            s.out.append(int(nxt[i]))
            s.tokens.append(int(nxt[i]))
            s.t_first = t
            if self.collect_logits:
                s.prompt_logits = per_seq[i].cpu()
                s.step_logits.append(last[i].cpu())
            self._commit(s)

    def _decode(self, batch: list[_Seq]) -> None:
        S = self.page_size
        while True:
            active = [s for s in batch if not s.finished]
            if not active:
                return
            for s in active:
                if s.kv_len // S >= len(s.table):
                    s.table = np.concatenate([s.table, self.port.alloc(s.handle, 1)])
            mb = make_batch([[s.tokens[-1]] for s in active], [s.kv_len for s in active],
                            [s.table for s in active], S, self.model.device)
            logits = self.model.forward_paged(mb, self.port.device_pool.kv)
            nxt = logits.argmax(-1).tolist()
            for i, s in enumerate(active):
                s.kv_len += 1
                s.out.append(int(nxt[i]))
                s.tokens.append(int(nxt[i]))
                if self.collect_logits:
                    s.step_logits.append(logits[i].cpu())

    def _commit(self, s: _Seq) -> None:
        """Commit every full page whose K/V is computed; then read back the tree's pages for them (a page
        another request committed first replaces ours, which the cache frees)."""
        full = s.kv_len // self.page_size
        if full <= s.committed_pages:
            return
        h = s.handle
        dev = np.asarray(s.load.device_indices if s.committed_pages == 0 else h.device_indices, dtype=np.int64)
        pages = np.concatenate([dev, s.table[len(dev):full]])
        self.port.commit(h, s.tokens[: s.kv_len], pages)
        s.committed_pages = full
        after = np.asarray(h.device_indices, dtype=np.int64)
        if len(after):
            s.table = s.table.copy()
            s.table[: len(after)] = after
