"""Reference serving node: a Llama-style (or MLA) decoder whose attention reads the L1 page pool.

It is a client of the cache, not part of it: :class:`ServingNode` talks to any :class:`CachePort`
(an in-process :class:`~hicache.cache.HiCache`, :class:`NoCachePort`, or the node service's client).
"""

from hicache.engine.model import Batch, Decoder, Segment, make_batch
from hicache.engine.node import GenRequest, GenResult, ServingNode
from hicache.engine.port import CachePort, NoCachePort
from hicache.engine.shape import PRESETS, ModelShape, preset

__all__ = [
    "PRESETS",
    "Batch",
    "CachePort",
    "Decoder",
    "GenRequest",
    "GenResult",
    "ModelShape",
    "NoCachePort",
    "Segment",
    "ServingNode",
    "make_batch",
    "preset",
]
