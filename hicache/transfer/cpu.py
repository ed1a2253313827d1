"""CPU transfer engine: torch indexing, one background worker, per-layer readiness events.

Copies run on a single worker thread in submission order (torch releases the GIL while copying), so a
caller can start computing layer 0 while later layers are still being copied, exactly as on CUDA.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import numpy as np
import torch

from hicache.pool import DevicePool, HostPool
from hicache.transfer.base import TransferEngine, TransferHandle, register_engine


class CpuHandle(TransferHandle):
    def __init__(self, num_layers: int, num_pages: int) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self._layers = [threading.Event() for _ in range(num_layers)]
        self._error: BaseException | None = None

    def _set_layer(self, layer: int) -> None:
        self._layers[layer].set()

    def _fail(self, err: BaseException) -> None:
        self._error = err
        for ev in self._layers:
            ev.set()

    def wait_layer(self, layer: int) -> None:
        self._layers[layer].wait()
        if self._error is not None:
            raise RuntimeError("page transfer failed") from self._error

    def wait(self) -> None:
        self.wait_layer(self.num_layers - 1)

    def done(self) -> bool:
        return self._layers[-1].is_set()


@register_engine("cpu")
class CpuTransferEngine(TransferEngine):
    name = "cpu"

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        super().__init__(device_pool, host_pool)
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="hicache-transfer", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job()

    def _submit(self, src: np.ndarray, dst: np.ndarray, to_device: bool) -> CpuHandle:
        L, C = self.layout.num_layers, self.layout.kv_count
        handle = CpuHandle(L, len(src))
        if len(src) == 0:
            for layer in range(L):
                handle._set_layer(layer)
            return handle
        s = torch.from_numpy(src)
        d = torch.from_numpy(dst)
        dev, host = self.device_pool, self.host_pool

        def job() -> None:
            try:
                for layer in range(L):
                    for c in range(C):
                        # byte views: exact for every dtype (float8 has no CPU index_copy_)
                        d_view = dev.kv[layer][c].view(torch.uint8)
                        if to_device:
                            d_view.index_copy_(0, d.to(dev.device), host.read_pieces(layer, c, s).to(dev.device))
                        else:
                            host.write_pieces(layer, c, d, d_view[s.to(dev.device)].cpu())
                    handle._set_layer(layer)
            except BaseException as e:  # surfaced to the waiter
                handle._fail(e)

        self._queue.put(job)
        return handle

    def load(self, host_idx: np.ndarray, device_idx: np.ndarray, layer_wise: bool = True) -> TransferHandle:
        # layer by layer either way: the copies go in layer order on one worker thread
        src, dst = self._check(host_idx, device_idx, self.host_pool.num_pages, self.device_pool.num_pages)
        return self._submit(src, dst, to_device=True)

    def backup(self, device_idx: np.ndarray, host_idx: np.ndarray) -> TransferHandle:
        src, dst = self._check(device_idx, host_idx, self.device_pool.num_pages, self.host_pool.num_pages)
        return self._submit(src, dst, to_device=False)

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=5)
