"""What the soak tests share: a deterministic model of page K/V, the bookkeeping of what engines saw, and
the thread harness.

A plain module (not a conftest), imported by the in-process and the gRPC soak alike.

The model is what makes a soak a correctness test: the K/V of a page is a function of its tenant and of
every token up to the page's end, nothing else, so any page the cache hands back can be checked bit for
bit against what a forward pass over the same prefix would have written.
"""

from __future__ import annotations

import faulthandler
import hashlib
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

KV = Sequence[Sequence[torch.Tensor]]  # per layer: [K, V], each [pages, S, H, D]


class PageModel:
    """K/V of whole pages, shaped ``[LAYERS, 2, PS, HEADS, DIM]`` (``page_shape``) in ``dtype``.

    Values are drawn from a generator seeded with a hash of the tenant and the page's token prefix and
    cached per (tenant, prefix); comparisons are bit for bit (through the unsigned view of ``dtype``).
    Thread-safe: racing threads compute and store the same value.
    """

    def __init__(self, page_shape: tuple[int, int, int, int, int], dtype: type[np.floating]) -> None:
        self.shape = page_shape
        self.page_size = page_shape[2]
        self.dtype = np.dtype(dtype)
        self.bits = np.dtype(f"<u{self.dtype.itemsize}")
        self._cache: dict[tuple[str, bytes], np.ndarray] = {}

    def prefix(self, tokens: np.ndarray, page: int) -> bytes:
        """The tokens up to the end of page ``page``, as uint32 LE bytes (what the page is a function of)."""
        return tokens[: (page + 1) * self.page_size].astype("<u4").tobytes()

    def page(self, tenant: str, prefix: bytes) -> np.ndarray:
        """The K/V of the last page of ``prefix`` under ``tenant``."""
        k = (tenant, prefix)
        v = self._cache.get(k)
        if v is None:
            seed = int.from_bytes(hashlib.blake2b(tenant.encode() + b"\0" + prefix, digest_size=8).digest(),
                                  "little")
            v = np.random.default_rng(seed).standard_normal(self.shape, dtype=np.float32).astype(self.dtype)
            self._cache[k] = v
        return v

    def pages(self, tenant: str, tokens: np.ndarray, first: int, n: int) -> np.ndarray:
        """``[n, *page_shape]``: pages ``first..first+n-1`` of ``tokens``."""
        out = np.empty((n, *self.shape), dtype=self.dtype)
        for i in range(n):
            out[i] = self.page(tenant, self.prefix(tokens, first + i))
        return out

    def write(self, kv: KV, pages: np.ndarray, tenant: str, tokens: np.ndarray, first: int) -> None:
        """What a forward pass does: fill L1 pages ``pages`` (pages ``first..`` of ``tokens``) with their K/V."""
        if len(pages) == 0:
            return
        want = torch.from_numpy(self.pages(tenant, tokens, first, len(pages)))
        idx = torch.from_numpy(np.asarray(pages, dtype=np.int64))
        for layer, lkv in enumerate(kv):
            for c, t in enumerate(lkv):
                t[idx] = want[:, layer, c]

    def check(self, kv: KV, pages: np.ndarray, tenant: str, tokens: np.ndarray, what: str,
              layers: Sequence[int] | None = None) -> None:
        """Assert L1 pages ``pages`` (pages ``0..`` of ``tokens``) hold the model's K/V in ``layers``
        (default: all)."""
        if len(pages) == 0:
            return
        want = self.pages(tenant, tokens, 0, len(pages)).view(self.bits)
        idx = torch.from_numpy(np.asarray(pages, dtype=np.int64))
        for layer in range(len(kv)) if layers is None else layers:
            for c in range(2):
                got = kv[layer][c][idx].numpy().view(self.bits)
                bad = np.flatnonzero((got != want[:, layer, c]).reshape(len(pages), -1).any(axis=1))
                assert len(bad) == 0, (f"{what}: page(s) {bad.tolist()} of {len(pages)} (L1 pages "
                                       f"{np.asarray(pages)[bad].tolist()}) layer {layer} {'KV'[c]} differ from "
                                       f"what the model computes (tenant {tenant!r})")


@dataclass
class Counters:
    """Base of a soak's tally: integer fields summed over threads by :meth:`add`, under ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **d: int) -> None:
        with self.lock:
            for k, v in d.items():
                setattr(self, k, getattr(self, k) + v)


def run_threads(targets: Sequence[tuple[str, Callable[[], None]]], stop: threading.Event, errors: list[str],
                seconds: float) -> None:
    """Run ``(name, fn)`` threads for ``seconds`` (or until one sets ``stop``), then stop and join them.

    Fails the test when a thread is still running 30 s after ``stop`` (with every thread's stack) or when
    any thread recorded an error in ``errors``.
    """
    threads = [threading.Thread(target=fn, name=name) for name, fn in targets]
    for th in threads:
        th.start()
    stop.wait(seconds)
    stop.set()
    for th in threads:
        th.join(timeout=30)
    if any(th.is_alive() for th in threads):
        faulthandler.dump_traceback(file=sys.stderr)
        pytest.fail("a thread did not stop within 30 s (deadlock?); stacks above")
    assert not errors, "\n".join(errors)
