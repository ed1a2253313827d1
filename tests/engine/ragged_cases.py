"""A prefill batch over a shared cached prefix, run on the ragged and on the padded attention path."""

from __future__ import annotations

import numpy as np
import torch

from hicache.engine import Decoder
from hicache.engine.model import make_batch
from hicache.pool import DevicePool

PAGE = 16
SHARED = 20  # pages of the common prefix: 320 tokens, above RAGGED_MIN_SHARED


def ragged_vs_padded(model: Decoder, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], int]:
    """(logits on the ragged path, on the padded path, each segment's full token list, tokens the ragged
    path attended as the shared part; 0 where it did not take the batch).

    The prefix is computed once into pages 0..19; three segments then extend it with 5, 17 and 40 new
    tokens (one of them after 10 more cached tokens of its own, so its own part starts mid-page)."""
    dev = model.device
    vocab = model.shape.vocab_size
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, SHARED * PAGE).tolist()
    extra = rng.integers(0, vocab, 10).tolist()
    pool = DevicePool(model.shape.kv_layout(PAGE, str(model.dtype).removeprefix("torch.")), 64, dev.type)
    shared = np.arange(SHARED)
    model.forward_paged(make_batch([prefix], [0], [shared], PAGE, dev), pool.kv)
    own_start = SHARED * PAGE + 10  # segment 2's own cached tokens, on its page 20
    p2 = np.concatenate([shared, [40, 41, 42, 43]])
    model.forward_paged(make_batch([extra], [SHARED * PAGE], [p2], PAGE, dev), pool.kv)
    news = [rng.integers(0, vocab, n).tolist() for n in (5, 17, 40)]
    tables = [np.concatenate([shared, [20]]), np.concatenate([shared, [21, 22]]), p2]
    prefixes = [SHARED * PAGE, SHARED * PAGE, own_start]
    full = [prefix + news[0], prefix + news[1], prefix + extra + news[2]]
    snapshot = [[t.clone() for t in row] for row in pool.kv]
    outs = []
    shared_tokens = 0
    for path in ("ragged", "padded"):
        for row, snap in zip(pool.kv, snapshot, strict=True):
            for t, s in zip(row, snap, strict=True):
                t.copy_(s)
        model.attention_path = path
        batch = make_batch(news, prefixes, tables, PAGE, dev)
        if path == "ragged":
            t = model._ragged_tables(batch, PAGE)
            shared_tokens = 0 if t is None else t.n_shared
        outs.append(model.forward_paged(batch, pool.kv, all_logits=True).cpu())
    model.attention_path = "ragged"
    return outs[0], outs[1], full, shared_tokens
