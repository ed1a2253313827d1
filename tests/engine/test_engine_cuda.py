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


def test_ragged_bf16_on_gpu_matches_padded() -> None:
    """The flash-kernel ragged path (bf16) agrees with the padded path to bf16 rounding."""
    from hicache.engine import attention

    from .ragged_cases import PAGE, SHARED, ragged_vs_padded

    model = Decoder.random(preset("small"), SEED, torch.bfloat16, "cuda")
    got, padded, _, shared = ragged_vs_padded(model)
    assert shared == SHARED * PAGE
    assert not attention._FLASH_BROKEN and not attention._CUDNN_BROKEN  # fused kernels ran, not fallbacks
    assert float((got - padded).norm() / padded.norm()) < 2e-2
    assert float((got.argmax(-1) == padded.argmax(-1)).float().mean()) > 0.9


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_flash_matches_exact_contract(causal: bool) -> None:
    """Flash (bf16) against the exact fp32 path: GQA head mapping, bottom-right causal alignment for
    segments with more keys than queries, and the packed [Hq, Tq] log-sum-exp."""
    from hicache.engine import attention

    g = torch.Generator().manual_seed(1)
    hk, rep, d = 4, 4, 128
    lens_q, lens_k = [3, 64, 17, 1], [40, 64, 300, 9]
    cu_q = [0, *np.cumsum(lens_q).tolist()]
    cu_k = [0, *np.cumsum(lens_k).tolist()]
    q = torch.randn(cu_q[-1], hk * rep, d, generator=g).cuda()
    k = torch.randn(cu_k[-1], hk, d, generator=g).cuda()
    v = torch.randn(cu_k[-1], hk, d, generator=g).cuda()
    cq = torch.tensor(cu_q, dtype=torch.int32, device="cuda")
    ck = torch.tensor(cu_k, dtype=torch.int32, device="cuda")
    o, lse = attention.varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cq, ck, max(lens_q), max(lens_k),
                                        causal, d ** -0.5)
    assert not attention._FLASH_BROKEN
    ro, rl = attention._exact(q, k, v, cu_q, cu_k, causal, d ** -0.5)
    assert lse.shape == rl.shape
    assert float((o.float() - ro).norm() / ro.norm()) < 2e-2
    torch.testing.assert_close(lse, rl, rtol=2e-2, atol=2e-2)


def test_attend_all_cudnn_matches_exact_contract() -> None:
    """The shared-part kernel (cuDNN, grouped-query heads) against the exact fp32 path."""
    from hicache.engine import attention

    g = torch.Generator().manual_seed(2)
    q = torch.randn(300, 32, 128, generator=g).cuda()
    k = torch.randn(1000, 8, 128, generator=g).cuda()
    v = torch.randn(1000, 8, 128, generator=g).cuda()
    o, lse = attention.attend_all(q.bfloat16(), k.bfloat16(), v.bfloat16(), 128 ** -0.5)
    assert not attention._CUDNN_BROKEN
    ro, rl = attention._exact(q, k, v, [0, 300], [0, 1000], False, 128 ** -0.5)
    assert o.shape == ro.shape and lse.shape == rl.shape
    assert float((o.float() - ro).norm() / ro.norm()) < 2e-2
    torch.testing.assert_close(lse, rl, rtol=2e-2, atol=2e-2)
