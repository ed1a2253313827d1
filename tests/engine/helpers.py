"""Shared builders for the serving-node tests: a tiny fp32 decoder and a three-tier cache on memory://."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache import HiCache
from hicache.config import config_from_dict
from hicache.engine import Decoder, GenResult, ModelShape

SEED = 1234


def make_cache(shape: ModelShape, page_size: int, l1_tokens: int = 4096, l2_tokens: int = 8192,
               url: str = "memory://", write_policy: str = "write_through", device: str = "cpu") -> HiCache:
    """fp32 cache whose layout fits ``shape``; L3 prefetches every run and waits for it."""
    lay = shape.kv_layout(page_size, "float32")
    cfg = config_from_dict({
        "model": {"name": "tiny-test", "revision": "r1"},
        "layout": {"num_layers": lay.num_layers, "num_kv_heads": lay.num_kv_heads, "head_dim": lay.head_dim,
                   "dtype": "float32", "page_size": page_size, "attention": lay.attention},
        "cache": {"l1_tokens": l1_tokens, "l2_tokens": l2_tokens, "write_policy": write_policy,
                  "device": device},
        "storage": {"url": url, "prefetch_threshold_tokens": 0, "prefetch_policy": "wait_complete"},
    })
    return HiCache(cfg)


def shared_prefix_prompts(rng: np.random.Generator, vocab: int, n: int = 6) -> list[list[int]]:
    """Prompts in two families: a 41-token document + question, and the first 19 tokens of it + another
    continuation; lengths are deliberately not page-aligned."""
    doc = rng.integers(0, vocab, 41).tolist()
    out = []
    for i in range(n):
        head = doc if i % 2 == 0 else doc[:19]
        out.append(head + rng.integers(0, vocab, int(rng.integers(3, 12))).tolist())
    return out


def assert_matches_recompute(model: Decoder, prompt: Sequence[int], res: GenResult, tol: float = 1e-5) -> None:
    """Every logit the node produced equals a from-scratch dense forward over prompt + output."""
    full = list(prompt) + res.output[:-1]
    ref = model.forward_dense(full).cpu()
    n = len(prompt)
    assert res.prompt_logits is not None
    torch.testing.assert_close(res.prompt_logits, ref[n - res.computed_tokens: n], rtol=tol, atol=tol)
    steps = torch.stack(res.step_logits)
    torch.testing.assert_close(steps, ref[n - 1:], rtol=tol, atol=tol)
    assert res.output == ref[n - 1:].argmax(-1).tolist()
