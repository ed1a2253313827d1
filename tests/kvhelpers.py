"""Helpers shared by the cache tests: a tiny config, and what an engine does with the cache.

A plain module (not a conftest) so every test package imports the same one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hicache.cache import HiCache, Request
from hicache.config import HiCacheConfig, config_from_dict


def small_config(**sections: dict[str, Any]) -> HiCacheConfig:
    """A tiny cache (3 layers, pages of 4 tokens) whose requests run in milliseconds on CPU."""
    base: dict[str, dict[str, Any]] = {
        "layout": {"num_layers": 3, "num_kv_heads": 2, "head_dim": 4, "dtype": "float32", "page_size": 4},
        "cache": {"l1_tokens": 64, "l2_tokens": 128},
        "storage": {"prefetch_threshold_tokens": 0, "prefetch_policy": "wait_complete"},
    }
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return config_from_dict(base)


def write_kv(cache: HiCache, pages: np.ndarray, seed: int) -> list[list[torch.Tensor]]:
    """Fill ``pages`` of L1 with random KV (what a forward pass would write); returns the written values."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.from_numpy(np.asarray(pages, dtype=np.int64))
    out = []
    for layer in cache.device_pool.kv:
        row = []
        for t in layer:
            v = torch.randn((len(pages), *t.shape[1:]), generator=g).to(t.dtype)
            t[idx] = v
            row.append(v)
        out.append(row)
    return out


def read_kv(cache: HiCache, pages: np.ndarray) -> list[list[torch.Tensor]]:
    idx = torch.from_numpy(np.asarray(pages, dtype=np.int64))
    return [[t[idx].clone() for t in layer] for layer in cache.device_pool.kv]


def serve(cache: HiCache, tokens: list[int], seed: int = 0, ns: Any = None) -> tuple[Request, Any]:
    """One full request as an engine would run it: match, prefetch, load back, compute the rest, commit."""
    req = cache.match(tokens, ns)
    cache.prefetch(req)
    load = cache.load_back(req)
    load.wait()
    n_pages = len(tokens) // cache.page_size
    new = cache.alloc(req, n_pages - len(load.device_indices))
    write_kv(cache, new, seed)
    cache.commit(req, tokens, np.concatenate([load.device_indices, new]))
    return req, load


def kv_equal(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def commit_fresh(cache: HiCache, tokens: list[int], seed: int) -> list[list[torch.Tensor]]:
    """Compute and commit a prompt the cache has never seen; returns the KV written."""
    req = cache.match(tokens)
    assert req.hit_pages == 0
    pages = cache.alloc(req, len(tokens) // cache.page_size)
    kv = write_kv(cache, pages, seed)
    cache.commit(req, tokens, pages)
    cache.release(req)
    return kv
