"""The serving node on a GPU with the CUDA transfer engine: L2 hits still equal a full recomputation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.engine import Decoder, GenRequest, ServingNode, preset

from .helpers import SEED, assert_matches_recompute, make_cache

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("name", ["tiny", "tiny-mla", "small"])
def test_gpu_l2_hits_equal_full_recompute(name: str) -> None:
    model = Decoder.random(preset(name), SEED, torch.float32, "cuda")
    rng = np.random.default_rng(0)
    doc = rng.integers(0, model.shape.vocab_size, 300).tolist()
    prompts = [doc + rng.integers(0, model.shape.vocab_size, 20).tolist() for _ in range(4)]
    with make_cache(model.shape, 16, l1_tokens=4096, l2_tokens=4096, device="cuda") as gpu_cache:
        assert gpu_cache.device_pool.device.type == "cuda"
        node = ServingNode(model, gpu_cache, collect_logits=True)
        first = node.generate([GenRequest(p, 4) for p in prompts])
        gpu_cache.evict(l1_pages=10**6)
        again = node.generate([GenRequest(p, 4) for p in prompts])
        assert again[0].hit_tokens["l2"] >= 288
        for p, a, b in zip(prompts, first, again, strict=True):
            assert_matches_recompute(model, p, b, tol=1e-4)
            assert a.output == b.output
        gpu_cache.check_integrity()


def test_cascade_bf16_on_gpu_matches_plain() -> None:
    """The flash-kernel cascade (bf16) agrees with the padded path to bf16 rounding."""
    from .cascade_cases import cascade_vs_plain

    model = Decoder.random(preset("small"), SEED, torch.bfloat16, "cuda")
    got, plain, _, taken = cascade_vs_plain(model)
    assert taken
    assert float((got - plain).norm() / plain.norm()) < 2e-2
    assert float((got.argmax(-1) == plain.argmax(-1)).float().mean()) > 0.9
