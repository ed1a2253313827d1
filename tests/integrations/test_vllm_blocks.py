"""The vLLM connector's worker side without vLLM: blocks of vLLM's per-layer KV views ``[B, H, N, C]`` (with
and without kernel-block splitting) gathered into host pages (pinned on a GPU), written to a file store,
read back by another store of the same namespace and scattered into other blocks, byte for byte; on the
CPU and, where there is one, on a CUDA GPU (the path a GPU vLLM worker takes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache.config import ConfigError
from hicache.integrations.store import EnginePages, EngineStore
from hicache.integrations.vllm_blocks import BlockIO, page_views
from hicache.integrations.vllm_plan import PAGE_FORMAT, WHERE, Shard
from hicache.layout import KVLayout

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def shard(mla: bool, layers: int = 3, blocks: int = 16, block: int = 16) -> Shard:
    if mla:
        layout = KVLayout(layers, 1, 96, "bfloat16", block, "mla")
        return Shard(layout, tuple(f"layer.{i}" for i in range(layers)), blocks, 1, 96)
    layout = KVLayout(layers, 4, 32, "bfloat16", block, "mha")
    return Shard(layout, tuple(f"layer.{i}" for i in range(layers)), blocks, 4, 64)


def caches(s: Shard, split: int, device: str, seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM's registered tensors: per layer ``[B * split, H, N / split, C]`` (kernel blocks split a block)."""
    _, H, N, C = s.page_shape
    out = {}
    for i, name in enumerate(s.layer_names):
        shape = (s.num_blocks * split, H, N // split, C)
        if seed is None:
            out[name] = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        else:
            g = torch.Generator(device=device).manual_seed(seed + i)
            out[name] = torch.randint(-(2 ** 15), 2 ** 15, shape, dtype=torch.int16, device=device,
                                      generator=g).view(torch.bfloat16)
    return out


def block(t: torch.Tensor, b: int, split: int) -> torch.Tensor:
    return t[b * split:(b + 1) * split].view(torch.int16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_blocks_round_trip_through_a_store(device: str, split: int, mla: bool, tmp_path: Path) -> None:
    s = shard(mla)
    src, dst = caches(s, split, device, seed=3), caches(s, split, device, seed=None)
    a_io, b_io = BlockIO(src, s), BlockIO(dst, s)
    assert a_io.pin == (device == "cuda")
    cfg = {"url": f"file://{tmp_path / 'l3'}"}
    pages = EnginePages("vllm", "org/tiny", s.layout, PAGE_FORMAT, 0, 1)
    a, b = EngineStore(cfg, pages, where=WHERE), EngineStore(cfg, pages, where=WHERE)
    try:
        ids, keys = [3, 5, 7, 2], [bytes([i]) * 32 for i in range(4)]
        host = a_io.host_pages(len(ids))
        assert host.is_pinned() == (device == "cuda")
        a_io.gather(ids, host)
        assert a.set(keys, page_views(host)) == 4
        back = b_io.host_pages(len(ids))
        assert b.get(keys, page_views(back)) == 4
        to = [10, 11, 0, 15]
        b_io.scatter(to, back)
        for name in s.layer_names:
            for i, j in zip(ids, to, strict=True):
                assert torch.equal(block(dst[name], j, split), block(src[name], i, split)), (name, i, j)
            untouched = [k for k in range(s.num_blocks) if k not in to]
            assert not any(block(dst[name], k, split).any() for k in untouched), "a block not loaded changed"
    finally:
        a.close()
        b.close()


def test_tensors_of_another_shape_are_refused() -> None:
    s = shard(False)
    bad = caches(s, 1, "cpu", seed=1)
    bad["layer.1"] = bad["layer.1"][:, :2]
    with pytest.raises(ConfigError, match=r"layer\.1's KV cache is \(16, 2, 16, 64\)"):
        BlockIO(bad, s)
