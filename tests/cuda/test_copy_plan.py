"""Copy-engine planning (pure NumPy, runs anywhere): executing a plan with memmove equals the reference."""

import ctypes
import itertools

import numpy as np
import pytest
import torch

from hicache.layout import KVLayout
from hicache.pool import DevicePool, HostPool
from hicache.transfer import create_engine
from hicache.transfer.copy_engine import MAX_BATCH, batch_bounds, plan_copies


def _run(plan) -> None:
    for dst, src, size in zip(plan.dst.tolist(), plan.src.tolist(), plan.size.tolist(), strict=True):
        ctypes.memmove(dst, src, size)


def _pools(layout: KVLayout, n_dev: int, n_host: int, host_layout: str, rng: np.random.Generator):
    dev = DevicePool(layout, n_dev, "cpu")
    host = HostPool(layout, n_host, host_layout, pin_memory=False, block_pages=8)
    host.buffer.view(torch.uint8).copy_(torch.from_numpy(rng.integers(0, 256, host.buffer.view(torch.uint8).shape,
                                                                      dtype=np.uint8)))
    for row in dev.kv:
        for t in row:
            t.view(torch.uint8).copy_(torch.from_numpy(rng.integers(0, 256, t.view(torch.uint8).shape, dtype=np.uint8)))
    return dev, host


def _geometry(dev: DevicePool, host: HostPool):
    layout = dev.layout
    L, C, piece = layout.num_layers, layout.kv_count, layout.bytes_per_layer_piece
    ptrs = np.array([dev.kv[layer][c].data_ptr() for layer in range(L) for c in range(C)], dtype=np.uint64)
    ps, lcs = host.piece_strides  # in pieces, between host keys
    return ptrs, ps * piece, lcs * piece


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "block_first"])
@pytest.mark.parametrize("layout", [KVLayout(3, 2, 4, "bfloat16", 3), KVLayout(2, 1, 5, "uint8", 3, "mla")],
                         ids=["mha-bf16", "mla-u8"])
@pytest.mark.parametrize("contiguous", [False, True])
def test_plan_matches_reference(host_layout: str, layout: KVLayout, contiguous: bool) -> None:
    rng = np.random.default_rng(7)
    dev, host = _pools(layout, 40, 50, host_layout, rng)
    n = 17
    if contiguous:  # runs that merge into single copies on a layer-first host
        d, h = np.arange(5, 5 + n), np.arange(20, 20 + n)
        d[10:], h[10:] = d[10:] + 3, h[10:] + 9  # two runs
    else:
        d, h = rng.permutation(40)[:n], rng.permutation(50)[:n]
    ptrs, hps, hlcs = _geometry(dev, host)
    piece = layout.bytes_per_layer_piece
    L, C = layout.num_layers, layout.kv_count
    base = host.buffer.data_ptr()
    # load every slot, then check against torch indexing
    expect = [[dev.kv[layer][c].clone() for c in range(C)] for layer in range(L)]
    for layer in range(L):
        for c in range(C):
            expect[layer][c].view(torch.uint8)[torch.from_numpy(d)] = host.read_pieces(layer, c, torch.from_numpy(h))
    plan = plan_copies(ptrs, base, hps, hlcs, piece, d, host.host_keys(h), 0, L * C, to_host=False)
    if contiguous and host_layout == "layer_first":
        assert plan.n_copies == 2 * L * C  # two merged runs per slot
    elif contiguous and host_layout == "block_first":  # runs 20-29 and 39-45 cut at blocks of 8
        assert plan.n_copies == 4 * L * C
    elif host_layout == "page_first":
        assert plan.n_copies == n * L * C  # pieces of consecutive pages are not adjacent
    else:
        assert plan.n_copies <= n * L * C
    assert plan.nbytes == n * L * C * piece
    _run(plan)
    for layer in range(L):
        for c in range(C):
            assert torch.equal(dev.kv[layer][c].view(torch.uint8), expect[layer][c].view(torch.uint8))
    # back up one slot range (the last layer) to other host pages
    h2 = torch.from_numpy(rng.permutation(50)[:n])
    before = host.blocks.view(torch.uint8).clone()
    plan = plan_copies(ptrs, base, hps, hlcs, piece, d, host.host_keys(h2.numpy()), (L - 1) * C, C, to_host=True)
    _run(plan)
    B = host.block_pages
    for c in range(C):
        before[:, L - 1, c][h2 // B, h2 % B] = dev.kv[L - 1][c].view(torch.uint8)[torch.from_numpy(d)]
    assert torch.equal(host.blocks.view(torch.uint8), before)


def test_plan_walks_host_memory_in_order() -> None:
    """Each slot's copies go in ascending host address, whatever order the pairs came in."""
    layout = KVLayout(4, 2, 8, "bfloat16", 2)
    rng = np.random.default_rng(3)
    dev, host = _pools(layout, 64, 64, "page_first", rng)
    ptrs, hps, hlcs = _geometry(dev, host)
    d, h = rng.permutation(64)[:40], rng.permutation(64)[:40]
    L, C = layout.num_layers, layout.kv_count
    for to_host in (False, True):
        plan = plan_copies(ptrs, host.buffer.data_ptr(), hps, hlcs, layout.bytes_per_layer_piece, d, h, 0, L * C,
                           to_host)
        host_addr = (plan.dst if to_host else plan.src).astype(np.int64).reshape(L * C, -1)
        assert (np.diff(host_addr, axis=1) > 0).all()


def test_empty_plan() -> None:
    p = plan_copies(np.zeros(2, np.uint64), 0, 8, 8, 8, np.zeros(0, np.int64), np.zeros(0, np.int64), 0, 2, False)
    assert p.n_copies == 0 and p.nbytes == 0


def test_cuda_engine_rejects_cpu_pool() -> None:
    layout = KVLayout(1, 1, 8)
    with pytest.raises(ValueError, match="cuda"):
        create_engine("cuda", DevicePool(layout, 2, "cpu"), HostPool(layout, 2, pin_memory=False), io_backend="kernel")


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 600, 8192])
def test_batches_cover_every_copy_once_within_the_cap(n: int) -> None:
    b = batch_bounds(n)
    assert b[0] == 0 and b[-1] == n
    assert all(0 < hi - lo <= MAX_BATCH for lo, hi in itertools.pairwise(b))
    assert len(b) - 1 == -(-n // MAX_BATCH)  # as few batches as the cap allows
