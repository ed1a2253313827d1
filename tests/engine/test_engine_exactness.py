"""Reuse must not change logits: requests served from L1, L2 and L3 hits equal a full recomputation."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.engine import Decoder, GenRequest, NoCachePort, ServingNode

from .helpers import assert_matches_recompute, make_cache, shared_prefix_prompts


def _serve(node: ServingNode, prompts: list[list[int]], new: int = 4) -> list:
    return node.generate([GenRequest(p, new) for p in prompts])


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_l1_l2_l3_hits_equal_full_recompute(model: Decoder, page_size: int) -> None:
    rng = np.random.default_rng(page_size)
    prompts = shared_prefix_prompts(rng, model.shape.vocab_size)
    with make_cache(model.shape, page_size) as cache:
        node = ServingNode(model, cache, max_batch=4, collect_logits=True)

        cold = _serve(node, prompts)  # later requests hit what earlier ones committed (L1)
        assert sum(r.hit_tokens["l1"] for r in cold) > 0
        for p, r in zip(prompts, cold, strict=True):
            assert_matches_recompute(model, p, r)

        cache.evict(l1_pages=10**6)  # everything down to L2
        warm_l2 = _serve(node, prompts)
        assert warm_l2[0].hit_tokens["l2"] > 0 and warm_l2[0].hit_tokens["l1"] == 0
        cache.flush()
        cache.evict(l1_pages=10**6, l2_pages=10**6)  # everything down to L3 only
        warm_l3 = _serve(node, prompts)
        assert warm_l3[0].hit_tokens["l3"] > 0 and warm_l3[0].hit_tokens["l1"] + warm_l3[0].hit_tokens["l2"] == 0

        for phase in (warm_l2, warm_l3):
            for p, r, c in zip(prompts, phase, cold, strict=True):
                assert r.computed_tokens < c.computed_tokens or r.computed_tokens <= page_size
                assert_matches_recompute(model, p, r)
                assert r.output == c.output
        cache.check_integrity()


def test_no_cache_baseline_equals_cached_outputs(model: Decoder) -> None:
    rng = np.random.default_rng(7)
    prompts = shared_prefix_prompts(rng, model.shape.vocab_size)
    base = ServingNode(model, NoCachePort(model.shape.kv_layout(4, "float32"), 256), collect_logits=True)
    ref = _serve(base, prompts)
    assert all(r.computed_tokens == len(p) for p, r in zip(prompts, ref, strict=True))
    assert base.port.device_pool.allocator.used_pages == 0  # everything went back at release
    with make_cache(model.shape, 4) as cache:
        got = _serve(ServingNode(model, cache, collect_logits=True), prompts)
    for p, a, b in zip(prompts, ref, got, strict=True):
        assert_matches_recompute(model, p, a)
        assert a.output == b.output


def test_eviction_under_pressure_then_reload(model: Decoder) -> None:
    """L1 holds about two documents; serving eight documents twice evicts to L2 on the way and loads back."""
    rng = np.random.default_rng(3)
    v = model.shape.vocab_size
    docs = [rng.integers(0, v, 60).tolist() for _ in range(8)]
    prompts = [d + rng.integers(0, v, 5).tolist() for d in docs]
    with make_cache(model.shape, 4, l1_tokens=160, l2_tokens=1024) as cache:
        node = ServingNode(model, cache, max_batch=2, collect_logits=True)
        first = _serve(node, prompts, new=3)
        again = _serve(node, [d + rng.integers(0, v, 5).tolist() for d in docs], new=3)
        assert sum(r.hit_tokens["l2"] for r in again) >= 6 * 60 - 4 * 8
        for p, r in zip(prompts, first, strict=True):
            assert_matches_recompute(model, p, r)
        for r in again:
            assert r.computed_tokens < 12
        cache.check_integrity()


def test_fully_cached_prompt_recomputes_only_its_last_page(model: Decoder) -> None:
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, model.shape.vocab_size, 32).tolist()  # page-aligned
    with make_cache(model.shape, 8) as cache:
        node = ServingNode(model, cache, collect_logits=True)
        a = _serve(node, [prompt])[0]
        b = _serve(node, [prompt])[0]
        assert b.hit_tokens["l1"] == 32 and b.computed_tokens == 8
        assert_matches_recompute(model, prompt, b)
        assert a.output == b.output
        cache.check_integrity()


def test_decoded_tokens_are_cached_for_the_next_turn(model: Decoder) -> None:
    """Multi-turn chat: turn 2's prompt = turn 1's prompt + answer + new message; the answer's pages hit."""
    rng = np.random.default_rng(5)
    v = model.shape.vocab_size
    turn1 = rng.integers(0, v, 22).tolist()
    with make_cache(model.shape, 2) as cache:
        node = ServingNode(model, cache, collect_logits=True)
        r1 = _serve(node, [turn1], new=9)[0]
        turn2 = turn1 + r1.output + rng.integers(0, v, 5).tolist()
        r2 = _serve(node, [turn2], new=3)[0]
        assert r2.hit_tokens["l1"] == 30  # 22 prompt + 8 decoded tokens with K/V (the 9th has none yet)
        assert_matches_recompute(model, turn2, r2)
