"""Page bytes for peers on other hosts: L1 pages <-> canonical page-first bytes ``[n, L, C, S, H, D]``.

The same order :meth:`hicache.pool.HostPool.page_bytes` gives one page in, so a peer can frame, store or
compare pages without knowing either side's pool layout.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.pool import DevicePool


def gather_pages(pool: DevicePool, pages: np.ndarray) -> bytes:
    """Bytes of L1 ``pages``, page after page, each ``[L, C, S, H, D]`` (copied to host)."""
    idx = torch.as_tensor(pages, dtype=torch.long, device=pool.device)
    parts = [torch.stack([kv[idx] for kv in layer], dim=1) for layer in pool.kv]  # each [n, C, S, H, D]
    t = torch.stack(parts, dim=1).contiguous()  # [n, L, C, S, H, D]
    return t.cpu().view(torch.uint8).numpy().tobytes()


def scatter_pages(pool: DevicePool, pages: np.ndarray, data: bytes) -> None:
    """Write canonical page bytes into L1 ``pages`` (``len(data)`` must be ``len(pages) * bytes_per_page``)."""
    lay = pool.layout
    if len(data) != len(pages) * lay.bytes_per_page:
        raise ValueError(f"scatter_pages: {len(data)} bytes for {len(pages)} pages of {lay.bytes_per_page}")
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(lay.torch_dtype)
    src = src.view(len(pages), lay.num_layers, lay.kv_count, *lay.page_shape).to(pool.device)
    idx = torch.as_tensor(pages, dtype=torch.long, device=pool.device)
    for layer, kvs in enumerate(pool.kv):
        for c, kv in enumerate(kvs):
            kv[idx] = src[:, layer, c]
