"""Page transfer between L2 and L1: interface, registry, CPU engine (the CUDA engine registers itself)."""

from hicache.transfer import cpu as _cpu  # noqa: F401  (registers "cpu")
from hicache.transfer.base import TransferEngine, TransferHandle, create_engine, register_engine

__all__ = ["TransferEngine", "TransferHandle", "create_engine", "register_engine"]
