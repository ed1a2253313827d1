"""Serving-node behaviour: batching, per-layer waits, tenants, bad input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from hicache.cache import HiCache
from hicache.engine import (
    Decoder,
    GenRequest,
    ModelShape,
    NoCachePort,
    ServingNode,
    make_batch,
    preset,
)
from hicache.engine.weights import load_safetensors, random_weights, save_safetensors

from .helpers import SEED, assert_matches_recompute, make_cache


def test_shared_prefix_is_computed_once_per_batch(model: Decoder) -> None:
    rng = np.random.default_rng(1)
    doc = rng.integers(0, model.shape.vocab_size, 64).tolist()
    qs = [rng.integers(0, model.shape.vocab_size, 6).tolist() for _ in range(8)]
    with make_cache(model.shape, 16) as cache:
        res = ServingNode(model, cache, max_batch=8).generate([GenRequest(doc + q, 2) for q in qs])
    assert [r.computed_tokens for r in res] == [70] + [6] * 7
    assert res[0].t_first < res[1].t_start  # the document's owner ran first, alone


def test_requests_sharing_uncached_pages_wait_unless_tenants_differ(model: Decoder) -> None:
    """Admission keeps a request for the next batch when a batch member computes full pages it could
    reuse; a different tenant, or a prompt diverging inside the first page, is admitted at once."""
    rng = np.random.default_rng(2)
    v = model.shape.vocab_size
    doc = rng.integers(0, v, 40).tolist()  # 2 full pages of 16, then a partial one
    near = [*doc[:5], (doc[5] + 1) % v, *doc[6:]]  # diverges inside page 0: shares no full page
    with make_cache(model.shape, 16) as cache:
        reqs = [GenRequest([*doc, 1, 2]), GenRequest([*near, 3]), GenRequest([*doc, 4], ns=cache.namespace("b")),
                GenRequest([*doc[:32], 5, 6])]
        res = ServingNode(model, cache, max_batch=8).generate(reqs)
    starts = [r.t_start for r in res]
    assert starts[0] == starts[1] == starts[2] < starts[3]  # the last shares both full pages with the first
    assert res[3].computed_tokens == 2


def test_prefix_prints_follow_page_prefixes() -> None:
    from hicache.engine.node import _PrefixPrints

    prints = _PrefixPrints(4)
    a = np.arange(20, dtype=np.int64)
    b = a.copy()
    b[9] = 99  # page 2 differs
    pa, pb = prints(a), prints(b)
    assert len(pa) == 5
    assert (pa[:2] == pb[:2]).all() and (pa[2:] != pb[2:]).all()
    assert (prints(a[:13]) == pa[:3]).all()  # a shorter array: the same prints for its full pages
    assert (prints(np.arange(400, dtype=np.int64))[:5] == pa).all()  # tables grow without changing old prints


class _RecordingPort:
    """The real cache, with each load's per-layer waits recorded (order of calls)."""

    def __init__(self, cache: HiCache) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.device_pool = cache.device_pool
        self.waits: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def load_back(self, req: Any) -> Any:
        load = self.cache.load_back(req)
        port = self

        class _Load:
            device_indices = load.device_indices

            def wait_layer(self, layer: int) -> None:
                port.waits.append(layer)
                load.wait_layer(layer)

        return _Load()


def test_each_layer_waits_for_its_pages_before_compute(model: Decoder) -> None:
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, model.shape.vocab_size, 40).tolist()
    with make_cache(model.shape, 4) as cache:
        port = _RecordingPort(cache)
        node = ServingNode(model, port, collect_logits=True)
        node.generate([GenRequest(prompt, 1)])
        cache.evict(l1_pages=10**6)
        port.waits.clear()
        r = node.generate([GenRequest([*prompt, 1, 2], 1)])[0]
        assert r.hit_tokens["l2"] == 40
        assert port.waits == list(range(model.shape.num_layers))
        assert_matches_recompute(model, [*prompt, 1, 2], r)


def test_tenants_never_share_pages(model: Decoder) -> None:
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, model.shape.vocab_size, 30).tolist()
    with make_cache(model.shape, 4) as cache:
        node = ServingNode(model, cache)
        node.generate([GenRequest(prompt, 1, ns=cache.namespace("a"))])
        b = node.generate([GenRequest(prompt, 1, ns=cache.namespace("b"))])[0]
        a = node.generate([GenRequest(prompt, 1, ns=cache.namespace("a"))])[0]
    assert b.computed_tokens == 30 and a.computed_tokens < 30


def test_safetensors_round_trip(tmp_path: Any) -> None:
    pytest.importorskip("safetensors")
    shape = preset("tiny")
    w = random_weights(shape, SEED)
    save_safetensors(w, tmp_path / "model.safetensors")
    loaded = Decoder(shape, load_safetensors(tmp_path, shape))
    ref = Decoder(shape, w)
    toks = list(range(20))
    torch.testing.assert_close(loaded.forward_dense(toks), ref.forward_dense(toks))
    with pytest.raises(ValueError, match="missing"):
        load_safetensors(tmp_path, shape.with_(num_layers=3))


def test_bad_input_is_rejected() -> None:
    shape = preset("tiny")
    with pytest.raises(ValueError, match="num_q_heads"):
        ModelShape(vocab_size=8, hidden=8, num_layers=1, num_q_heads=3, num_kv_heads=2, head_dim=4, ffn=8)
    with pytest.raises(ValueError, match="MLA"):
        shape.with_(attention="mla", num_kv_heads=1)
    with pytest.raises(ValueError, match="unknown"):
        preset("nope")
    with pytest.raises(ValueError, match="prompt"):
        GenRequest([], 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenRequest([1], 0)
    model = Decoder.random(shape, SEED)
    with pytest.raises(ValueError, match="vocabulary"):
        ServingNode(model, NoCachePort(shape.kv_layout(4, "float32"), 8)).generate([GenRequest([1, 256], 1)])
    with pytest.raises(ValueError, match="layout"):
        ServingNode(model, NoCachePort(shape.kv_layout(4, "bfloat16"), 8))
    with pytest.raises(ValueError, match="cannot hold"):
        make_batch([[1, 2, 3]], [2], [np.array([0])], 4, torch.device("cpu"))
    port = NoCachePort(shape.kv_layout(4, "float32"), 2)
    from hicache.cache import CacheFullError
    with pytest.raises(CacheFullError):
        ServingNode(model, port).generate([GenRequest(list(range(20)), 1)])
    assert port.device_pool.allocator.used_pages == 0
