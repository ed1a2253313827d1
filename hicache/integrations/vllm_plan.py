"""The scheduler side of hicache's vLLM connector, and what both sides derive from vLLM's configuration.

Nothing here imports vLLM at module level: requests, configs and specs are read by attribute (the names
``tests/integrations`` pins against vLLM 0.34.0), so the planning logic is plain Python.

* :func:`split_config`: ``kv_connector_extra_config`` -> hicache's store fields and the connector's own.
* :func:`check_block_hashes`: refuses a random ``NONE_HASH`` (pages could never hit in another process)
  and hashes that are not one per KV block.
* :func:`shard_of`: the KV layout of one vLLM shard (from its ``KVCacheConfig``) and the page format.
* :class:`Planner`: per request, which blocks to load from the store and which to save to it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.config import ConfigError
from hicache.integrations.store import CONFIG_FIELDS
from hicache.layout import DTYPES, KVLayout

log = logging.getLogger(__name__)

WHERE = "kv_connector_extra_config"
# the connector's own fields of kv_connector_extra_config (the rest are hicache's store fields)
OWN_FIELDS = ("save_queue_mb",)
# A page is one vLLM block: for each layer (in vLLM's layer order), the block's logical [H, N, C] view,
# C being K's then V's channels (MLA: the latent). Independent of VLLM_KV_CACHE_LAYOUT and kernel block
# splitting, so processes with other physical layouts share pages.
PAGE_FORMAT = "layers,heads,tokens,kv-channels"
# vLLM's hash algorithms whose NONE_HASH vLLM seeds at random unless PYTHONHASHSEED is set
RECOMMENDED_ALGOS = ("sha256", "sha256_cbor")


@dataclass(frozen=True)
class Settings:
    """The connector's own settings (``OWN_FIELDS``)."""

    save_queue_mb: int = 1024  # host memory held by saves not yet written; saves beyond it are dropped


def split_config(extra: Mapping[str, Any] | None) -> tuple[dict[str, Any], Settings]:
    """``kv_connector_extra_config`` -> (hicache's store fields, :class:`Settings`); ``ConfigError`` for an
    unknown field or a bad value (one line: ``kv_connector_extra_config: FIELD: problem``)."""
    raw = dict(extra or {})
    unknown = sorted(set(raw) - set(CONFIG_FIELDS) - set(OWN_FIELDS))
    if unknown:
        raise ConfigError(f"{WHERE}: {unknown[0]}: unknown field; known: {sorted((*CONFIG_FIELDS, *OWN_FIELDS))}",
                          f"{WHERE}.{unknown[0]}")
    mb = raw.pop("save_queue_mb", Settings.save_queue_mb)
    if not isinstance(mb, int) or isinstance(mb, bool) or mb < 0:
        raise ConfigError(f"{WHERE}: save_queue_mb: must be an integer >= 0, got {mb!r}", f"{WHERE}.save_queue_mb")
    return raw, Settings(save_queue_mb=mb)


def check_block_hashes(algo: str, resolve_seed: Callable[[], str], hash_block_size: int | None,
                       block_size: int) -> None:
    """Refuse block hashes that cannot name shared pages.

    ``resolve_seed`` is vLLM's own choice of the seed of ``NONE_HASH`` for the configured algorithm
    (``resolve_none_hash_seed``): two calls that differ mean a random per-process seed, so no page one
    process writes could ever hit in another. ``hash_block_size`` must be the block size (one hash per
    block: hybrid models hash finer)."""
    if resolve_seed() != resolve_seed():
        raise ConfigError(
            f"{WHERE}: vLLM would seed its block hashes at random in every process (--prefix-caching-hash-algo "
            f"{algo} without PYTHONHASHSEED), so pages written by one vLLM process could never hit in another: "
            f"use --prefix-caching-hash-algo {' or '.join(RECOMMENDED_ALGOS)} (sha256 is vLLM's default), or set "
            "PYTHONHASHSEED to the same value in every vLLM process", WHERE)
    if hash_block_size not in (None, block_size):
        raise ConfigError(f"{WHERE}: vLLM hashes every {hash_block_size} tokens but its KV blocks hold {block_size}: "
                          "hicache stores whole blocks by their hash (hybrid models are not supported)", WHERE)


@dataclass(frozen=True)
class Shard:
    """One vLLM worker's KV cache as hicache pages."""

    layout: KVLayout  # layers, KV heads, head size, dtype, block size, MHA / MLA
    layer_names: tuple[str, ...]  # vLLM's layers, in page order
    num_blocks: int  # blocks of vLLM's KV cache (its block ids are 0 .. num_blocks - 1)
    heads: int  # H of vLLM's [B, H, N, C] layer view
    channels: int  # C, in elements

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        """``[L, H, N, C]``: one page in :data:`PAGE_FORMAT` order."""
        return (len(self.layer_names), self.heads, self.layout.page_size, self.channels)


def shard_of(kv_cache_config: Any, spec_types: tuple[type, ...], plain_quant: Iterable[Any]) -> Shard:
    """The :class:`Shard` of a vLLM ``KVCacheConfig``; ``ConfigError`` for a cache hicache cannot store as
    pages: several KV cache groups (hybrid / sliding-window models), attention other than full or MLA
    (``spec_types``), KV quantisation with per-token scales (``plain_quant``: the modes without), packed
    head slots, an unknown dtype."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ConfigError(f"{WHERE}: the model has {len(groups)} KV cache groups (hybrid, sliding-window or "
                          "Mamba layers with the hybrid KV cache manager): only models with one group of full or "
                          "MLA attention are supported", WHERE)
    spec = groups[0].kv_cache_spec
    if type(spec) not in spec_types:
        raise ConfigError(f"{WHERE}: KV cache spec {type(spec).__name__} is not supported (only "
                          f"{', '.join(t.__name__ for t in spec_types)})", WHERE)
    if spec.kv_quant_mode not in tuple(plain_quant):
        raise ConfigError(f"{WHERE}: KV cache quantisation {spec.kv_quant_mode!r} keeps scales beside the cache, "
                          "which hicache does not store", WHERE)
    if spec.num_head_slots is not None or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
        raise ConfigError(f"{WHERE}: packed KV cache pages ({type(spec).__name__} with head slots / packed "
                          "states) are not supported", WHERE)
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ConfigError(f"{WHERE}: KV cache dtype {dtype} is not one of {sorted(DTYPES)}", WHERE)
    mla = spec.head_size_v == 0
    heads = int(spec.num_kv_heads)
    channels = int(spec.head_size) + int(spec.head_size_v)
    if not mla and spec.head_size_v != spec.head_size:
        raise ConfigError(f"{WHERE}: K and V head sizes differ ({spec.head_size} / {spec.head_size_v})", WHERE)
    names = tuple(groups[0].layer_names)
    if mla:
        layout = KVLayout(len(names), 1, channels, dtype, int(spec.block_size), "mla")
    else:
        layout = KVLayout(len(names), heads, int(spec.head_size), dtype, int(spec.block_size), "mha")
    expect = len(names) * int(spec.real_page_size_bytes)
    if layout.bytes_per_page != expect:
        raise ConfigError(f"{WHERE}: a block is {expect} bytes in vLLM but {layout.bytes_per_page} as {layout} "
                          "(a vLLM release this connector does not know?)", WHERE)
    return Shard(layout, names, int(kv_cache_config.num_blocks), heads, channels)


# ---------------------------------------------------------------------- per-step work handed to the workers
@dataclass
class BlockJob:
    """Blocks of one request to load or save: ``keys[i]`` (vLLM's block hash) names block ``block_ids[i]``."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class _Tracked:
    request: Any  # vLLM's Request (read: request_id, block_hashes, num_computed_tokens)
    block_ids: list[int] = field(default_factory=list)  # the request's blocks, in token order
    next_save: int = 0  # index of the first block neither loaded nor saved yet
    load: BlockJob | None = None  # loads for the next step


class Planner:
    """Which blocks each request loads and saves (the connector's scheduler side).

    ``exists(keys)`` is the count of leading keys the store holds (for every shard). Lookups count
    leading hits from the first block not computed locally; a hit on the whole prompt leaves its last
    token to compute, so vLLM has logits. A block is saved once, in the step after which its KV is
    complete: it has a hash (all its tokens are known) and the step computes up to its end. Loaded and
    locally cached blocks are not saved again.
    """

    def __init__(self, block_size: int, exists: Callable[[Sequence[bytes]], int], *, load: bool = True,
                 save: bool = True) -> None:
        self.block_size = block_size
        self.exists = exists
        self.load_enabled = load
        self.save_enabled = save
        self._lookups: dict[str, tuple[int, int]] = {}  # req -> (tokens computed locally, blocks stored)
        self._reqs: dict[str, _Tracked] = {}

    def matched(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (block-aligned) that can be loaded for ``request``."""
        bs = self.block_size
        first = num_computed_tokens // bs
        hashes = list(request.block_hashes[first:])
        if not self.load_enabled or not hashes:
            self._lookups[request.request_id] = (num_computed_tokens, 0)
            return 0
        stored = self.exists([bytes(h) for h in hashes])
        self._lookups[request.request_id] = (num_computed_tokens, stored)
        hit = min((first + stored) * bs, request.num_tokens - 1)
        return max(0, hit - num_computed_tokens)

    def allocated(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` for ``request`` and will take ``num_external_tokens`` from us."""
        req_id = request.request_id
        local, _ = self._lookups.pop(req_id, (0, 0))
        t = _Tracked(request, list(block_ids), next_save=local // self.block_size)
        if num_external_tokens > 0:
            first = local // self.block_size
            end = math.ceil((local + num_external_tokens) / self.block_size)
            keys = [bytes(h) for h in request.block_hashes[first:end]]
            if len(keys) != end - first or len(block_ids) < end:
                raise RuntimeError(f"hicache: request {req_id}: {num_external_tokens} external tokens from token "
                                   f"{local} but {len(keys)} block hashes / {len(block_ids)} blocks to load into")
            t.load = BlockJob(req_id, keys, list(block_ids[first:end]))
            t.next_save = end
        self._reqs[req_id] = t

    def plan(self, new: Iterable[tuple[str, Sequence[int]]], cached: Iterable[tuple[str, Sequence[int] | None]],
             num_scheduled: Mapping[str, int]) -> tuple[list[BlockJob], list[BlockJob]]:
        """This step's ``(loads, saves)``. ``new``: requests scheduled afresh with all their blocks;
        ``cached``: running requests with the blocks added this step (or None); ``num_scheduled``: tokens
        each request computes this step. Loads recorded since the last call are handed out once."""
        for req_id, ids in new:
            if (t := self._reqs.get(req_id)) is not None:
                t.block_ids = list(ids)
        for req_id, added in cached:
            if added and (t := self._reqs.get(req_id)) is not None:
                t.block_ids.extend(added)
        loads: list[BlockJob] = []
        for t in self._reqs.values():
            if t.load is not None:
                loads.append(t.load)
                t.load = None
        saves: list[BlockJob] = []
        if not self.save_enabled:
            return loads, saves
        for req_id, n in num_scheduled.items():
            t = self._reqs.get(req_id)
            if t is None:
                continue
            r = t.request
            full = min(len(r.block_hashes), (r.num_computed_tokens + n) // self.block_size, len(t.block_ids))
            if full > t.next_save:
                keys = [bytes(h) for h in r.block_hashes[t.next_save:full]]
                saves.append(BlockJob(req_id, keys, t.block_ids[t.next_save:full]))
                t.next_save = full
        return loads, saves

    def finished(self, req_id: str) -> None:
        self._lookups.pop(req_id, None)
        self._reqs.pop(req_id, None)

    def tracked(self) -> int:
        """Requests being followed (for tests: finished ones must not stay)."""
        return len(self._reqs)
