"""KV events of serving engines (vLLM, SGLang) as the router's index updates.

vLLM (``--kv-events-config``) and SGLang publish what their prefix caches store and evict on a ZeroMQ
PUB socket: each message is ``[topic, sequence (8 bytes, big-endian), payload]``, the payload a msgpack
array ``[ts, events, data_parallel_rank?]`` and each event an array led by its type name:

* ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id?, medium?, ...]``:
  consecutive blocks of ``block_size`` tokens, the first one following ``parent_block_hash`` (None: the
  first block of a sequence);
* ``["BlockRemoved", block_hashes, medium?]``;
* ``["AllBlocksCleared"]``.

The engine's block hashes are its own (a hash of its choosing, with its salts), so the router recomputes
each stored block's page key from the parent block's key and the block's tokens, exactly as the nodes key
pages (:mod:`hicache.keys`), and keeps the engine hash -> page key map of every block it holds. A request's
keys then match an engine's blocks like a hicache node's pages: the cached prefix is the run of the
request's keys the engine holds. ``medium`` names the tier: ``GPU`` (or none) is L1, any other (``CPU``, a
disk or offloading connector) L2.

Refused, and counted by reason (:attr:`EngineBlocks.refused`): blocks whose size is not the router's
``layout.page_size`` (``block_size``), blocks under a LoRA adapter (``lora``: the router keys the base
model's pages), blocks whose parent the router does not know (``orphan``: stored before the router
subscribed, or lost in a gap), and events it cannot read (``malformed``). Newer fields after the known ones
are ignored. Routing only ever *prefers* an engine on this information; a wrong guess costs a recompute,
never a wrong result.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np

from hicache.keys import page_keys_from_bytes
from hicache.router.index import L1, L2, KVIndex

REFUSALS = ("block_size", "lora", "orphan", "malformed")


class EngineEventError(ValueError):
    """A payload that is not a KV event batch."""


class Stored(NamedTuple):
    hashes: list[Hashable]
    parent: Hashable | None
    tokens: np.ndarray  # uint32 (little-endian) token ids of the blocks, in order
    block_size: int
    lora_id: int | None
    medium: str | None


class Removed(NamedTuple):
    hashes: list[Hashable]
    medium: str | None


class Cleared(NamedTuple):
    pass


EngineEvent = Stored | Removed | Cleared


class Malformed(NamedTuple):
    """An event the router cannot read (the rest of its batch still applies)."""

    why: str


class Batch(NamedTuple):
    ts: float
    events: list[EngineEvent | Malformed | None]  # None: an event of a kind this router does not know
    dp_rank: int | None


def _hash(v: Any) -> Hashable:
    if isinstance(v, bytes | int | str):
        return v
    if isinstance(v, list):  # a tuple-like hash, as some versions send: hashable once frozen
        return tuple(_hash(x) for x in v)
    raise EngineEventError(f"block hash of type {type(v).__name__}")


def _medium(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _event(e: Any) -> EngineEvent | None:
    if not isinstance(e, list) or not e or not isinstance(e[0], str):
        raise EngineEventError("an event is not an array led by its type name")
    kind, f = e[0], e[1:]
    if kind == "BlockStored":
        if len(f) < 4 or not isinstance(f[0], list) or not isinstance(f[2], list) or not isinstance(f[3], int):
            raise EngineEventError("BlockStored: expected [hashes, parent, token_ids, block_size, ...]")
        try:
            ids = np.asarray(f[2]) if f[2] else np.empty(0, np.int64)
        except (ValueError, OverflowError):
            ids = np.empty(1, object)
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or (len(ids) and (ids.min() < 0 or ids.max() >= 1 << 32)):
            raise EngineEventError("BlockStored: token ids must be integers in [0, 2^32)")
        lora = f[4] if len(f) > 4 and isinstance(f[4], int) else None
        return Stored([_hash(h) for h in f[0]], None if f[1] is None else _hash(f[1]), ids.astype("<u4"), f[3],
                      lora, _medium(f[5]) if len(f) > 5 else None)
    if kind == "BlockRemoved":
        if not f or not isinstance(f[0], list):
            raise EngineEventError("BlockRemoved: expected [hashes, ...]")
        return Removed([_hash(h) for h in f[0]], _medium(f[1]) if len(f) > 1 else None)
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def _read(e: Any) -> EngineEvent | Malformed | None:
    try:
        return _event(e)
    except EngineEventError as err:
        return Malformed(str(err))


def decode_batch(payload: bytes) -> Batch:
    """One published payload; :class:`EngineEventError` if it is not a KV event batch at all. An event
    that cannot be read becomes :class:`Malformed` in its place."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types for bad input
        raise EngineEventError(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[0], int | float) or not isinstance(obj[1], list):
        raise EngineEventError("expected a batch [ts, events, ...]")
    rank = obj[2] if len(obj) > 2 and isinstance(obj[2], int) else None
    return Batch(float(obj[0]), [_read(e) for e in obj[1]], rank)


GPU = "GPU"  # the medium of blocks in the engine's device memory (an event that names none means it)


@functools.cache
def tiers_of(media: frozenset[str]) -> int:
    """The index's tier mask for a block held on ``media``: the GPU is L1, anything else (CPU, disk, an
    offloading connector) L2."""
    return (L1 if GPU in media else 0) | (L2 if media - {GPU} else 0)


@dataclass
class EngineBlocks:
    """One engine's blocks as the router knows them, written through to the index under the node's name.

    ``blocks``: engine hash -> (page key, the media holding the block). Two hashes may name one page (the
    same tokens under two cache salts), so the index holds a key on a tier while any block holds it there
    (``_held``: per key, how many blocks hold it on L1 and on L2). Single-threaded (the router's event
    loop)."""

    index: KVIndex
    node: str
    ns_digest: bytes
    page_size: int
    blocks: dict[Hashable, tuple[bytes, frozenset[str]]] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSALS, 0))
    batches: int = 0  # event batches applied
    gaps: dict[str, int] = field(default_factory=lambda: {"replayed": 0, "lost": 0})  # sequence gaps, by outcome
    restarts: int = 0  # the engine's run ended (a disconnect, or its sequence went back): its blocks forgotten
    _held: dict[bytes, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._feed = self.index.feed(self.node)  # the node's entry in the index (kept for the node's life)

    def apply(self, batch: Batch) -> None:
        self.batches += 1
        for ev in batch.events:
            if isinstance(ev, Stored):
                self._stored(ev)
            elif isinstance(ev, Removed):
                self._removed(ev)
            elif isinstance(ev, Cleared):
                self.clear()
            elif isinstance(ev, Malformed):
                self.refused["malformed"] += 1

    def clear(self) -> None:
        """Forget every block (the engine cleared its cache, restarted, or events were lost)."""
        self.index.drop(self.node)
        self.blocks.clear()
        self._held.clear()

    def _count(self, key: bytes, mask: int, step: int) -> None:
        """Add ``step`` holders of ``key`` on the tiers of ``mask`` and write the key's tiers to the index."""
        if not mask:
            return
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = [0, 0]
        if mask & L1:
            held[0] += step
        if mask & L2:
            held[1] += step
        now = (L1 if held[0] > 0 else 0) | (L2 if held[1] > 0 else 0)
        if not now:
            del self._held[key]
        self.index.set_page(self.node, self._feed, key, now)

    def _hold(self, h: Hashable, key: bytes, media: frozenset[str]) -> None:
        """Block ``h`` now holds page ``key`` on ``media`` (none: the block is gone)."""
        old = self.blocks.get(h)
        before = 0
        if old is not None:
            if old[0] == key:
                before = tiers_of(old[1])
            else:  # the engine reused a hash for other content
                self._count(old[0], tiers_of(old[1]), -1)
        if media:
            self.blocks[h] = (key, media)
        else:
            self.blocks.pop(h, None)
        after = tiers_of(media)
        if before != after:
            self._count(key, before & ~after, -1)
            self._count(key, after & ~before, 1)

    def _stored(self, ev: Stored) -> None:
        n = len(ev.hashes)
        if ev.block_size != self.page_size:
            self.refused["block_size"] += n
            return
        if ev.lora_id is not None:
            self.refused["lora"] += n
            return
        if len(ev.tokens) != n * ev.block_size:
            self.refused["malformed"] += n
            return
        start: bytes | None = None
        if ev.parent is not None:
            known = self.blocks.get(ev.parent)
            if known is None:
                self.refused["orphan"] += n
                return
            start = known[0]
        keys = page_keys_from_bytes(self.ns_digest, ev.tokens.tobytes(), self.page_size, start)
        only = frozenset((ev.medium.upper() if ev.medium else GPU,))
        for h, key in zip(ev.hashes, keys, strict=True):
            old = self.blocks.get(h)
            self._hold(h, key, old[1] | only if old is not None and old[0] == key else only)

    def _removed(self, ev: Removed) -> None:
        medium = ev.medium.upper() if ev.medium else GPU
        for h in ev.hashes:
            old = self.blocks.get(h)
            if old is not None and medium in old[1]:
                self._hold(h, old[0], old[1] - {medium})
