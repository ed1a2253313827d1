"""The worker side of hicache's vLLM connector: vLLM's KV blocks <-> hicache pages in host memory.

vLLM (0.34.0) hands a worker one tensor per layer, the logical view ``[B, H, N, C]`` of its KV cache
(blocks, heads, tokens, channels: K's then V's; MLA: ``H == 1`` and the latent) over whatever physical
layout ``VLLM_KV_CACHE_LAYOUT`` chose, with ``B`` kernel blocks, a multiple of the manager's blocks when
kernel blocks split them. A page is one manager block as ``[L, H, N, C]`` (:data:`PAGE_FORMAT`), gathered
into host memory (on the GPU: one indexed copy per layer, then one copy to host) and scattered back the
same way, so every physical layout stores the same bytes.

Saves are written by a background thread from host copies taken at the end of the step, so vLLM may
reuse the blocks at once; the host memory those copies hold is bounded, and saves past the bound are
dropped (a later miss, never a wrong page).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence

import torch

from hicache.config import ConfigError
from hicache.integrations.store import EngineStore
from hicache.integrations.vllm_plan import WHERE, Shard

log = logging.getLogger(__name__)


def page_views(pages: torch.Tensor) -> list[list[memoryview]]:
    """Each page of a contiguous CPU tensor ``[n, ...]`` as one writable byte view (the store's pieces)."""
    u8 = pages.view(torch.uint8).reshape(pages.shape[0], -1).numpy()
    return [[u8[i].data] for i in range(len(u8))]


class BlockIO:
    """Copies between vLLM's per-layer KV views and host pages ``[n, L, H, N, C]``.

    ``ConfigError`` when the tensors vLLM registered are not the views :class:`Shard` describes (another
    vLLM release, a layer missing)."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], shard: Shard) -> None:
        self.shard = shard
        _, H, N, C = shard.page_shape
        self.views: list[torch.Tensor] = []  # per layer: [num_blocks, r, H, N / r, C]
        for name in shard.layer_names:
            t = kv_caches.get(name)
            if t is None:
                raise ConfigError(f"{WHERE}: vLLM registered no KV cache for layer {name}", WHERE)
            dtype = str(t.dtype).removeprefix("torch.")
            r = t.shape[0] // shard.num_blocks if t.dim() == 4 else 0
            if (t.dim() != 4 or r < 1 or t.shape[0] != r * shard.num_blocks or tuple(t.shape[1:]) != (H, N // r, C)
                    or N % r or dtype != shard.layout.dtype):
                raise ConfigError(f"{WHERE}: layer {name}'s KV cache is {tuple(t.shape)} {dtype}, not the "
                                  f"[{shard.num_blocks} blocks, {H}, {N}, {C}] {shard.layout.dtype} view this "
                                  "connector knows (vLLM 0.34.0's [B, H, N, C])", WHERE)
            self.views.append(t.unflatten(0, (shard.num_blocks, r)))
        self.device = self.views[0].device
        self.pin = self.device.type == "cuda"

    def host_pages(self, n: int) -> torch.Tensor:
        """A host buffer for ``n`` pages (pinned when the cache is on a GPU)."""
        L, H, N, C = self.shard.page_shape
        return torch.empty((n, L, H, N, C), dtype=self.views[0].dtype, pin_memory=self.pin)

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` into ``out[:len(block_ids)]`` (waits for the copy)."""
        n, ids = len(block_ids), self._ids(block_ids)
        for layer, v in enumerate(self.views):
            blocks = v.index_select(0, ids)  # [n, r, H, N/r, C]
            out[:n, layer].copy_(blocks.transpose(1, 2).reshape(n, *out.shape[2:]))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Copy pages ``src[:len(block_ids)]`` into blocks ``block_ids`` (waits for the copy)."""
        n, ids = len(block_ids), self._ids(block_ids)
        for layer, v in enumerate(self.views):
            r = v.shape[1]
            page = src[:n, layer].to(self.device)  # [n, H, N, C]
            v[ids] = page.unflatten(2, (r, -1)).transpose(1, 2)  # [n, r, H, N/r, C]
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


class SaveQueue:
    """Writes saved pages to the store from a background thread; at most ``limit_bytes`` of host copies
    wait (beyond that a save is dropped and counted in ``dropped_pages``)."""

    def __init__(self, store: EngineStore, limit_bytes: int) -> None:
        self.store = store
        self.limit = limit_bytes
        self.pending = 0
        self.written_pages = 0
        self.failed_pages = 0
        self.dropped_pages = 0
        self._lock = threading.Lock()
        self._q: queue.Queue[tuple[list[bytes], torch.Tensor] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hicache-vllm-save", daemon=True)
        self._thread.start()

    def offer(self, keys: list[bytes], pages: torch.Tensor) -> bool:
        """Queue ``pages`` (host, ``[len(keys), ...]``) for writing; False when over the limit (dropped)."""
        nbytes = pages.numel() * pages.element_size()
        with self._lock:
            if self.pending + nbytes > self.limit:
                self.dropped_pages += len(keys)
                return False
            self.pending += nbytes
        self._q.put((keys, pages))
        return True

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            keys, pages = job
            try:
                done = self.store.set(keys, page_views(pages))
            except Exception:  # a bug, not the store being down (that is a count): keep serving
                log.exception("hicache: saving %d pages failed", len(keys))
                done = 0
            with self._lock:
                self.pending -= pages.numel() * pages.element_size()
                self.written_pages += done
                self.failed_pages += len(keys) - done
            self._q.task_done()
        self._q.task_done()

    def flush(self) -> None:
        """Wait until every queued save has been written (or failed)."""
        self._q.join()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)
