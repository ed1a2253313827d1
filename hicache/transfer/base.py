"""Transfer interface: move pages between L2 (host) and L1 (device).

Contract:

* ``load(host_idx, device_idx)`` copies host pages ``host_idx[i]`` into device pages ``device_idx[i]``
  for every layer and returns a :class:`TransferHandle` right away. Layers complete in order;
  ``wait_layer(i)`` returns once layer ``i`` is readable by the caller's compute (on CUDA: the compute
  stream waits on layer ``i``'s event or flag, no host synchronisation), ``wait()`` once all are, and ``done()``
  polls without blocking. An engine may submit a layer-wise load's later layers from these calls rather
  than inside ``load`` (the CUDA engine's ``submit_ahead``): a caller observes a load only through its
  handle, or the engine's ``synchronize``/``close``, never through a device-wide synchronisation alone.
* ``backup(device_idx, host_idx)`` copies device pages to host pages and returns a handle; it never
  reads a page before the writes the caller issued before calling it have finished (on CUDA it waits on
  an event recorded on the compute stream).
* Index arrays are int64 page indices, equal length, in range, without duplicates in the destination;
  implementations raise ``ValueError`` otherwise and copy nothing.
* Engines are chosen through a registry (:func:`register_engine`, :func:`create_engine`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import numpy as np

from hicache.pool import DevicePool, HostPool
from hicache.registry import Registry


class TransferHandle(abc.ABC):
    """Completion of one load or backup."""

    num_layers: int
    num_pages: int

    @abc.abstractmethod
    def wait_layer(self, layer: int) -> None:
        """Block (CPU) or make the current compute stream wait (CUDA) until ``layer`` has landed."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Until every layer has landed; raises if a copy failed (the CPU engine wraps the cause in a
        ``RuntimeError``)."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once every layer has landed, or once the transfer has failed and nothing of it writes any
        more (``wait`` then raises the failure); never blocks on the copies, never raises."""


class TransferEngine(abc.ABC):
    """Moves pages between one device pool and one host pool."""

    name: str = "abstract"

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        if device_pool.layout != host_pool.layout:
            raise ValueError("transfer: device and host pools have different KV layouts")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.layout = device_pool.layout

    def _check(self, src: np.ndarray, dst: np.ndarray, src_cap: int, dst_cap: int) -> tuple[np.ndarray, np.ndarray]:
        src = np.ascontiguousarray(src, dtype=np.int64)
        dst = np.ascontiguousarray(dst, dtype=np.int64)
        if src.shape != dst.shape or src.ndim != 1:
            raise ValueError(f"transfer: index arrays differ in shape {src.shape} vs {dst.shape}")
        if src.size:
            if src.min() < 0 or src.max() >= src_cap or dst.min() < 0 or dst.max() >= dst_cap:
                raise ValueError("transfer: page index out of range")
            if len(sorted_unique(dst)) != len(dst):
                raise ValueError("transfer: duplicate destination pages")
        return src, dst

    @abc.abstractmethod
    def load(self, host_idx: np.ndarray, device_idx: np.ndarray, layer_wise: bool = True) -> TransferHandle:
        """L2 -> L1. ``layer_wise``: the caller computes layer by layer after ``wait_layer(i)``, so the
        engine should make early layers ready early; ``False``: the caller waits for the whole load
        (``wait()``), so the engine may move the pages in whatever order is fastest. Either way every
        layer's ``wait_layer`` is correct; the hint changes only speed."""

    @abc.abstractmethod
    def backup(self, device_idx: np.ndarray, host_idx: np.ndarray) -> TransferHandle:
        """L1 -> L2."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work and release resources."""


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-D integer array, ascending (as ``np.unique``, by sorting: for the few
    thousand page indices of a transfer about 15x faster than ``np.unique``'s hashing in NumPy 2.4)."""
    s = np.sort(a)
    if s.size > 1:
        keep = np.empty(s.size, dtype=bool)
        keep[0] = True
        np.not_equal(s[1:], s[:-1], out=keep[1:])
        s = s[keep]
    return s


ENGINES: Registry[Callable[..., TransferEngine]] = Registry("transfer engine", lazy={"cuda": "hicache.transfer.cuda"})


def register_engine(name: str) -> Callable[[Any], Any]:
    return ENGINES.register(name)


def create_engine(name: str, device_pool: DevicePool, host_pool: HostPool, **kwargs: Any) -> TransferEngine:
    """``name``: a registered engine, or ``auto`` (CUDA when the device pool is on a GPU, else CPU)."""
    if name == "auto":
        name = "cuda" if device_pool.device.type == "cuda" else "cpu"
    try:
        factory = ENGINES.get(name, known_extra=" or 'auto'")
    except ImportError as e:
        raise ValueError(f"transfer engine {name!r} unavailable: {e}") from e
    return factory(device_pool, host_pool, **kwargs)
