"""The ragged attention path (segments packed without padding; a shared cached prefix attended once and
merged by log-sum-exp) equals the padded path and a dense recomputation, in fp32 on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.engine import Decoder, GenRequest, ServingNode, preset
from hicache.engine.attention import merge_attention, varlen_attention

from .helpers import SEED, assert_matches_recompute, make_cache
from .ragged_cases import PAGE, SHARED, ragged_vs_padded


def test_ragged_equals_padded_and_dense() -> None:
    model = Decoder.random(preset("tiny"), SEED)
    got, padded, full, shared = ragged_vs_padded(model)
    assert shared == SHARED * PAGE
    torch.testing.assert_close(got, padded, rtol=1e-5, atol=1e-5)
    off = 0
    for toks, n in zip(full, (5, 17, 40), strict=True):
        ref = model.forward_dense(toks)[-n:]
        torch.testing.assert_close(got[off: off + n], ref, rtol=1e-5, atol=1e-5)
        off += n


def test_mla_takes_the_padded_path() -> None:
    mla = Decoder.random(preset("tiny-mla"), SEED)
    got, padded, _, shared = ragged_vs_padded(mla)
    assert shared == 0
    torch.testing.assert_close(got, padded, rtol=1e-5, atol=1e-5)


def test_unknown_attention_path_is_a_clear_error() -> None:
    from hicache.engine.model import make_batch
    from hicache.pool import DevicePool

    model = Decoder.random(preset("tiny"), SEED)
    model.attention_path = "fast"
    pool = DevicePool(model.shape.kv_layout(PAGE, "float32"), 4, "cpu")
    with pytest.raises(ValueError, match="attention_path"):
        model.forward_paged(make_batch([[1, 2]], [0], [np.arange(1)], PAGE, model.device), pool.kv)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 12)), min_size=1, max_size=4),
       st.sampled_from([1, 2, 4]), st.booleans(), st.integers(0, 2**31 - 1))
def test_varlen_and_merge_equal_one_softmax(segs: list[tuple[int, int]], rep: int, causal: bool, seed: int) -> None:
    """Splitting each segment's keys in two (a common block and its own keys), attending to each part and
    merging equals one softmax over all keys, with and without the causal rule on the own part."""
    g = torch.Generator().manual_seed(seed)
    hk, d, n_common = 2, 8, 5
    common_k, common_v = torch.randn(n_common, hk, d, generator=g), torch.randn(n_common, hk, d, generator=g)
    qs, ks, vs, cu_q, cu_k = [], [], [], [0], [0]
    for n, extra in segs:
        m = n + extra
        qs.append(torch.randn(n, hk * rep, d, generator=g))
        ks.append(torch.randn(m, hk, d, generator=g))
        vs.append(torch.randn(m, hk, d, generator=g))
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + m)
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    scale = d ** -0.5
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    max_q, max_k = max(n for n, _ in segs), max(n + e for n, e in segs)
    o_own, l_own = varlen_attention(q, k, v, cq, ck, max_q, max_k, causal, scale)
    T = q.shape[0]
    o_c, l_c = varlen_attention(q, common_k, common_v, torch.tensor([0, T], dtype=torch.int32),
                                torch.tensor([0, n_common], dtype=torch.int32), T, n_common, False, scale)
    got = merge_attention(o_own, l_own, o_c, l_c)
    for b, (n, extra) in enumerate(segs):
        kk = torch.cat([common_k, ks[b]]).repeat_interleave(rep, dim=1).transpose(0, 1)
        vv = torch.cat([common_v, vs[b]]).repeat_interleave(rep, dim=1).transpose(0, 1)
        scores = torch.matmul(qs[b].transpose(0, 1), kk.transpose(-1, -2)) * scale  # [Hq, n, common + m]
        if causal:
            seen = torch.ones(n, n_common + n + extra, dtype=torch.bool).tril(n_common + extra)
            scores = scores.masked_fill(~seen, float("-inf"))
        ref = torch.matmul(torch.softmax(scores, -1), vv).transpose(0, 1)
        torch.testing.assert_close(got[cu_q[b]: cu_q[b + 1]], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["ragged", "padded"])
def test_rag_batch_through_the_node_equals_recompute(path: str) -> None:
    model = Decoder.random(preset("tiny"), SEED)
    model.attention_path = path
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


def test_merge_in_16_bit_stays_within_its_rounding() -> None:
    g = torch.Generator().manual_seed(0)
    oa, ob = torch.randn(50, 4, 16, generator=g), torch.randn(50, 4, 16, generator=g)
    la, lb = torch.randn(4, 50, generator=g) * 3, torch.randn(4, 50, generator=g) * 3
    ref = merge_attention(oa, la, ob, lb)
    got = merge_attention(oa.bfloat16(), la, ob.bfloat16(), lb)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - ref).norm() / ref.norm()) < 1e-2
