"""Cascade attention (shared prefix once, unmasked; own keys masked; merged by log-sum-exp) equals the
plain paths and a dense recomputation, in fp32 on the CPU."""

from __future__ import annotations

import numpy as np
import torch

from hicache.engine import Decoder, GenRequest, ServingNode, preset

from .cascade_cases import cascade_vs_plain
from .helpers import SEED, assert_matches_recompute, make_cache


def test_cascade_equals_plain_and_dense() -> None:
    model = Decoder.random(preset("tiny"), SEED)
    got, plain, full, taken = cascade_vs_plain(model)
    assert taken
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    off = 0
    for toks, n in zip(full, (5, 17, 40), strict=True):
        ref = model.forward_dense(toks)[-n:]
        torch.testing.assert_close(got[off: off + n], ref, rtol=1e-5, atol=1e-5)
        off += n


def test_cascade_is_skipped_for_mla_and_short_prefixes() -> None:
    mla = Decoder.random(preset("tiny-mla"), SEED)
    got, plain, _, taken = cascade_vs_plain(mla)
    assert not taken
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


def test_rag_batch_through_the_node_equals_recompute() -> None:
    model = Decoder.random(preset("tiny"), SEED)
    model.cascade = True
    rng = np.random.default_rng(3)
    vocab = model.shape.vocab_size
    doc = rng.integers(0, vocab, 300).tolist()
    prompts = [doc + rng.integers(0, vocab, int(rng.integers(3, 30))).tolist() for _ in range(5)]
    with make_cache(model.shape, 16) as cache:
        node = ServingNode(model, cache, collect_logits=True)
        res = node.generate([GenRequest(p, 3) for p in prompts])
        assert sum(r.cached_tokens for r in res) >= 4 * 288  # the batch after the first used the document
        for p, r in zip(prompts, res, strict=True):
            assert_matches_recompute(model, p, r)
        cache.check_integrity()
