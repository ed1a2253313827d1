"""The SGLang backend against SGLang's host pool as a GPU server has it: the device KV pool in CUDA memory,
the host pool in pinned memory (SGLang's own allocator: ``cudaHostRegister``).

Pages travel GPU -> pinned host pool through the pool's own ``set_from_flat_data_page`` (a torch copy
from the CUDA tensor), then ``batch_set_v1`` / ``batch_get_v1`` through a file store into a second pinned
pool, then back to the GPU with ``get_data_page``; the bytes on the GPU must be those it started with.
SGLang's CUDA transfer kernels (the ``sgl_kernel`` wheel) are not needed for that and are stubbed where
absent (``sglang_kit``). Skipped without a CUDA GPU or SGLang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from integrations.sglang_kit import create, load_sglang, mha_pool, mla_pool, sglang_available, sglang_keys

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if not sglang_available():
    pytest.skip("sglang is not installed (scripts/engine_env.sh)", allow_module_level=True)
load_sglang()

LAYOUTS = ["page_first", "page_first_direct", "layer_first"]
PAGE = 64


def pools(attn: str, layout: str) -> Any:
    if attn == "mha":  # an 8B-shaped shard of 4 layers: 8 KV heads of 128, 64-token pages (256 KiB a page)
        return mha_pool(layout, layers=4, heads=8, dim=128, page=PAGE, tokens=PAGE * 16, device="cuda", pin=True)
    return mla_pool(layout, layers=4, dim=576, page=PAGE, tokens=PAGE * 16, device="cuda", pin=True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["mha", "mla"])
def test_gpu_pages_round_trip_through_pinned_host_pools(attn: str, layout: str, tmp_path: Path) -> None:
    src, dst = pools(attn, layout), pools(attn, layout)
    assert src.kv_buffer.is_pinned() and dst.kv_buffer.is_pinned(), "SGLang's host pool is not pinned"
    n = 8
    numel = src.get_data_page(PAGE).numel()
    gen = torch.Generator(device="cuda").manual_seed(7)
    on_gpu = [torch.randint(-(2 ** 15), 2 ** 15, (numel,), dtype=torch.int16, device="cuda", generator=gen)
              .view(torch.bfloat16) for _ in range(n)]
    for i, page in enumerate(on_gpu):  # host page 0 is SGLang's padding page
        src.set_from_flat_data_page((1 + i) * PAGE, page)
    torch.cuda.synchronize()
    keys = sglang_keys(list(range(n * PAGE)), page=PAGE)
    store = {"url": f"file://{tmp_path / 'l3'}"}
    a, b = create(store, src), create(store, dst)
    try:
        host = torch.arange(PAGE, (1 + n) * PAGE, dtype=torch.int64)
        assert a.batch_set_v1(keys, host) == [True] * n
        assert b.batch_exists(keys) == n
        at = torch.arange(5 * PAGE, (5 + n) * PAGE, dtype=torch.int64)  # other slots of the other pool
        assert b.batch_get_v1(keys, at) == [True] * n
        for i, page in enumerate(on_gpu):
            back = dst.get_data_page((5 + i) * PAGE).to("cuda", non_blocking=True)
            assert torch.equal(back.view(torch.int16), page.view(torch.int16)), f"page {i} differs after the trip"
        assert b.get_stats().hicache["gets"] == n
    finally:
        a.close()
        b.close()
