"""Pools, indices and torch references shared by the GPU tests of the CUDA transfer engine (imported
only after a test module has checked for a GPU)."""

from typing import Any

import numpy as np
import torch

from hicache.layout import KVLayout
from hicache.pool import DevicePool, HostPool
from hicache.transfer import create_engine

SLEEP_CYCLES = 100_000_000  # ~50 ms of torch.cuda._sleep on a ~2 GHz GPU


# (layout, expected vector width): piece bytes chosen to exercise every kernel width
LAYOUTS = [
    (KVLayout(3, 2, 64, "bfloat16", 16), 16),  # MHA, 4 KiB pieces
    (KVLayout(2, 1, 576, "bfloat16", 3, "mla"), 16),  # MLA latent, odd page size
    (KVLayout(2, 2, 16, "float8_e4m3fn", 5), 16),  # 1-byte elements, 160-byte pieces
    (KVLayout(2, 2, 2, "float16", 1), 8),  # 8-byte pieces
    (KVLayout(2, 1, 3, "float32", 7), 4),  # 4-byte elements, 84-byte pieces
    (KVLayout(2, 3, 7, "float16", 5), 2),  # 2-byte elements, 210-byte pieces
    (KVLayout(3, 1, 5, "uint8", 3), 1),  # 15-byte pieces: byte kernel
]


IDS = ["mha-bf16", "mla-bf16-p3", "fp8-p5", "fp16-w8", "fp32-p7", "fp16-w2", "u8-w1"]


def rand_bytes(t: torch.Tensor, gen: torch.Generator) -> None:
    b = t.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))


def pools(layout: KVLayout, n_dev: int, n_host: int, host_layout: str, seed: int = 0,
           pin: bool | None = None, block_pages: int = 4) -> tuple[DevicePool, HostPool]:
    gen = torch.Generator().manual_seed(seed)
    dev = DevicePool(layout, n_dev, "cuda")
    host = HostPool(layout, n_host, host_layout, pin_memory=pin, block_pages=block_pages)  # block-first only
    rand_bytes(host.buffer, gen)
    for row in dev.kv:
        for t in row:
            cpu = torch.empty(t.shape, dtype=t.dtype)
            rand_bytes(cpu, gen)
            t.copy_(cpu)
    torch.cuda.synchronize()
    return dev, host


def snapshot(dev: DevicePool) -> list[list[torch.Tensor]]:
    return [[t.view(torch.uint8).cpu() for t in row] for row in dev.kv]


def host_bytes(host: HostPool) -> torch.Tensor:
    """The pool as bytes ``[P / B, L, C, B, S, H, D * element size]`` (every layout)."""
    return host.blocks.view(torch.uint8)


def expect_load(dev_before, host: HostPool, d: np.ndarray, h: np.ndarray, slots: set[tuple[int, int]]):
    out = [[t.clone() for t in row] for row in dev_before]
    for layer, c in slots:
        out[layer][c][torch.from_numpy(d)] = host.read_pieces(layer, c, torch.from_numpy(h))
    return out


def expect_backup(host_before: torch.Tensor, block_pages: int, dev_snap, d: np.ndarray, h: np.ndarray,
                   slots: set[tuple[int, int]]) -> torch.Tensor:
    """``host_before`` (:func:`host_bytes`) with the pieces of device pages ``d`` written to host pages
    ``h``."""
    out = host_before.clone()
    ht = torch.from_numpy(h)
    for layer, c in slots:
        out[:, layer, c][ht // block_pages, ht % block_pages] = dev_snap[layer][c][torch.from_numpy(d)]
    return out


def backend_kw(io_backend: str) -> dict[str, Any]:
    """Engine keywords of a test backend name: ``staged_resident`` is the staged path with its
    device-side copies in one resident kernel, ``staged_lc`` with lc-major slots for a block-first pool
    (instead of slots that mirror its blocks)."""
    if io_backend == "staged_resident":
        return {"io_backend": "staged", "staged_kernel": "resident"}
    if io_backend == "staged_lc":
        return {"io_backend": "staged", "block_staging": "lc_major"}
    return {"io_backend": io_backend}


def indices(n: int, n_dev: int, n_host: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(n_dev)[:n].astype(np.int64), rng.permutation(n_host)[:n].astype(np.int64)


def check_backup(eng: Any, dev: DevicePool, host: HostPool, pages: np.ndarray, n_dev: int, seed: int,
                  every: set[tuple[int, int]]) -> None:
    """Back ``pages`` (host pages, shuffled) up from random L1 pages; the host pool must equal torch's."""
    h = np.random.default_rng(seed).permutation(pages).astype(np.int64)
    d = np.random.default_rng(seed + 1).permutation(n_dev)[:len(h)].astype(np.int64)
    hb = host_bytes(host).clone()
    dsnap = snapshot(dev)
    eng.backup(d, h).wait()
    assert torch.equal(host_bytes(host), expect_backup(hb, host.block_pages, dsnap, d, h, every))


BIG = KVLayout(8, 8, 128, "bfloat16", 256)  # 512 KiB pieces: 64 pages = 64 MiB per layer, ~1.2 ms at 55 GB/s


SMALL = KVLayout(4, 2, 64, "bfloat16", 16)  # 4 KiB pieces


def small_engine(io_backend: str, seed: int) -> tuple[DevicePool, HostPool, Any]:
    """16-page pools of ``SMALL`` (a page-first L2 for the staged paths) and an engine on them."""
    dev, host = pools(SMALL, 16, 16, "page_first" if io_backend.startswith("staged") else "layer_first", seed=seed)
    return dev, host, create_engine("cuda", dev, host, **backend_kw(io_backend))


def load_checked_layer_by_layer(eng: Any, dev: DevicePool, host: HostPool, d: np.ndarray,
                                 h: np.ndarray) -> Any:
    """Load host pages ``h`` into device pages ``d`` behind a busy compute stream, snapshot each layer
    right after ``wait_layer`` returns, and check every snapshot against the host data; the handle."""
    L, C = dev.layout.num_layers, dev.layout.kv_count
    before = snapshot(dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    handle = eng.load(h, d)
    snaps = []
    for layer in range(L):
        handle.wait_layer(layer)
        snaps.append([t.view(torch.uint8).clone() for t in dev.kv[layer]])
    torch.cuda.synchronize()
    want = expect_load(before, host, d, h, {(x, c) for x in range(L) for c in range(C)})
    for layer in range(L):
        for c in range(C):
            assert torch.equal(snaps[layer][c].cpu(), want[layer][c]), (layer, c)
    return handle


def two_loads_behind(held: torch.cuda.Stream, eng: Any, dev: DevicePool, first: tuple[np.ndarray, np.ndarray],
                      second: tuple[np.ndarray, np.ndarray], want: list[list[torch.Tensor]]) -> None:
    """Hold ``held`` with a sleep, queue the loads ``first`` then ``second`` (host pages, device pages),
    wait for both, and check the device pool against ``want``."""
    with torch.cuda.stream(held):
        torch.cuda._sleep(SLEEP_CYCLES)
    a = eng.load(*first)
    b = eng.load(*second)
    b.wait()
    a.wait()
    torch.cuda.synchronize()
    for layer in range(dev.layout.num_layers):
        for c in range(dev.layout.kv_count):
            assert torch.equal(dev.kv[layer][c].view(torch.uint8).cpu(), want[layer][c]), (layer, c)
