"""hicache as vLLM's KV connector: an unmodified ``vllm serve`` loads it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": "redis://redis:6379/0"}}'

``kv_connector_extra_config`` holds hicache's storage configuration (:mod:`hicache.integrations.store`:
url, tenant, revision, compression, io_batch_pages, options, metrics) and ``save_queue_mb``, validated
when vLLM builds the connector: a bad value stops vLLM with one line naming the field.

Contract with vLLM (checked against vLLM 0.34.0 by ``tests/integrations``): the KV connector v1 API
(``KVConnectorBase_V1``), the surface vLLM loads by configuration from any module.

* Page identity: vLLM's own block hashes (``Request.block_hashes``), one page per KV block, inside
  hicache's namespace (model, weights revision, KV layout, page format, TP shard, tenant), so another
  vLLM process with the same model and store computes the same keys and hits. A random ``NONE_HASH``
  (``--prefix-caching-hash-algo xxhash`` / ``xxhash_cbor`` without ``PYTHONHASHSEED``) is refused: those
  hashes could never hit across processes.
* Scheduler side: ``get_num_new_matched_tokens`` counts the leading blocks beyond vLLM's own hit that
  every TP shard stored (a hit on the whole prompt leaves one token to compute);
  ``update_state_after_alloc`` and ``build_connector_meta`` hand each worker the blocks to load and the
  blocks completed this step to save (:class:`hicache.integrations.vllm_plan.Planner`).
* Worker side: loads are synchronous, before the forward pass (``start_load_kv``); a page missing,
  damaged or lost to a store failure is reported by ``get_block_ids_with_load_errors`` and vLLM
  recomputes it (``kv_load_failure_policy: recompute``, which the connector requires). Saves are copied
  to host memory in ``wait_for_save`` and written by a background thread
  (:mod:`hicache.integrations.vllm_blocks`); pages a store already holds are not written again.
* MLA: the latent is the same on every TP rank, so the ranks share pages (namespace TP 1) and only
  rank 0 writes them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hicache.config import ConfigError
from hicache.integrations.store import EngineConfig, EnginePages, EngineStore, parse_config
from hicache.integrations.vllm_blocks import BlockIO, SaveQueue, page_views
from hicache.integrations.vllm_plan import (
    PAGE_FORMAT,
    WHERE,
    BlockJob,
    Planner,
    Shard,
    check_block_hashes,
    shard_of,
    split_config,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as e:  # pragma: no cover - only without vLLM
    raise ImportError(f"hicache.integrations.vllm is vLLM's KV connector: install vllm to use it ({e})") from e

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

VLLM_TESTED = "0.34.0"  # the release tests/integrations checks this connector against
__all__ = ["HiCacheConnector", "HiCacheMetadata"]


@dataclass
class HiCacheMetadata(KVConnectorMetadata):  # type: ignore[misc]  # (vLLM's class: Any to mypy)
    """What the scheduler hands every worker for one step."""

    loads: list[BlockJob] = field(default_factory=list)  # blocks to fill from the store before the forward
    saves: list[BlockJob] = field(default_factory=list)  # blocks whose KV this step completes


def _shard(kv_cache_config: Any) -> Shard:
    return shard_of(kv_cache_config, (FullAttentionSpec, MLAAttentionSpec),
                    (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR))


def _tp_rank(vllm_config: VllmConfig) -> int:
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _metrics_for(cfg: EngineConfig, offset: int) -> EngineConfig:
    """Each vLLM process serves its counters on a port of its own: the scheduler on ``metrics``'s port,
    TP worker ``r`` on that port + 1 + r."""
    if not cfg.metrics or offset == 0:
        return cfg
    host, _, port = cfg.metrics.rpartition(":")
    return dataclasses.replace(cfg, metrics=f"{host}:{int(port) + offset}")


class HiCacheConnector(KVConnectorBase_V1):  # type: ignore[misc]  # (vLLM's class: Any to mypy)
    """vLLM's KV connector over a hicache store (module docstring). vLLM builds one per role: the
    scheduler's plans, each worker's moves blocks."""

    def __init__(self, vllm_config: VllmConfig, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kt = self._kv_transfer_config
        store_fields, self.settings = split_config(kt.kv_connector_extra_config)
        cfg = parse_config(store_fields, WHERE)
        if kt.kv_load_failure_policy != "recompute":
            raise ConfigError(f"--kv-transfer-config: kv_load_failure_policy: must be \"recompute\" for "
                              f"{type(self).__name__} (a page missing or damaged in the store is recomputed, not "
                              f"an error for the request), got {kt.kv_load_failure_policy!r}",
                              "kv_load_failure_policy")
        if vllm_config.model_config is None:
            raise ConfigError(f"{WHERE}: vLLM has no model configuration to name pages by", WHERE)
        pc = vllm_config.parallel_config
        for name in ("pipeline_parallel_size", "decode_context_parallel_size"):
            if getattr(pc, name, 1) != 1:
                raise ConfigError(f"{WHERE}: {name} {getattr(pc, name)} is not supported (only tensor "
                                  "parallelism)", WHERE)
        mc = vllm_config.model_config
        if not cfg.revision and mc.revision:
            cfg = dataclasses.replace(cfg, revision=str(mc.revision))
        self.shard = _shard(kv_cache_config)
        self.mla = self.shard.layout.attention == "mla"
        self.tp_size = 1 if self.mla else int(pc.tensor_parallel_size)
        self.model = str(mc.model)
        self._cache_hit_source = (CacheHitSource.DISK if cfg.storage.url.startswith("file:")
                                  else CacheHitSource.EXTERNAL_UNSPECIFIED)
        self.stores: list[EngineStore] = []
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config, cfg)
        else:
            self._init_worker(vllm_config, cfg)

    def _pages(self, tp_rank: int) -> EnginePages:
        return EnginePages("vllm", self.model, self.shard.layout, PAGE_FORMAT, tp_rank, self.tp_size)

    # ------------------------------------------------------------------ scheduler side
    def _init_scheduler(self, vllm_config: VllmConfig, cfg: EngineConfig) -> None:
        cc = vllm_config.cache_config
        algo = str(cc.prefix_caching_hash_algo)
        hash_fn = get_hash_fn_by_name(algo)
        check_block_hashes(algo, lambda: str(resolve_none_hash_seed(hash_fn)),
                           getattr(self._kv_cache_config, "hash_block_size", None), self.shard.layout.page_size)
        # the scheduler looks up every shard's pages: a block is a hit only where every TP rank stored it
        self.stores = [EngineStore(cfg if r == 0 else dataclasses.replace(cfg, metrics=""), self._pages(r),
                                   where=WHERE) for r in range(self.tp_size)]
        kt = self._kv_transfer_config
        self.planner = Planner(self.shard.layout.page_size, self._exists, load=bool(kt.is_kv_consumer),
                               save=bool(kt.is_kv_producer))

    def _exists(self, keys: Sequence[bytes]) -> int:
        n = len(keys)
        for store in self.stores:
            if n == 0:
                break
            n = store.exists(keys[:n])
        return n

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.planner.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.planner.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> HiCacheMetadata:
        cached = scheduler_output.scheduled_cached_reqs
        loads, saves = self.planner.plan(
            ((r.req_id, r.block_ids[0]) for r in scheduler_output.scheduled_new_reqs),
            ((rid, ids[0] if ids else None) for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True)),
            scheduler_output.num_scheduled_tokens)
        return HiCacheMetadata(loads, saves)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.planner.finished(request.request_id)
        return False, None  # saves copy the blocks out in the step that completes them: free them now

    # ------------------------------------------------------------------ worker side
    def _init_worker(self, vllm_config: VllmConfig, cfg: EngineConfig) -> None:
        rank = _tp_rank(vllm_config)
        self.writer = not (self.mla and rank != 0)
        self.store = EngineStore(_metrics_for(cfg, 1 + rank), self._pages(0 if self.mla else rank), where=WHERE)
        self.stores = [self.store]
        self.io: BlockIO | None = None
        self.saver = SaveQueue(self.store, self.settings.save_queue_mb << 20)
        self._load_errors: set[int] = set()
        self._staging: torch.Tensor | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.io = BlockIO(kv_caches, self.shard)
        self._staging = None

    def _io(self) -> BlockIO:
        if self.io is None:
            raise RuntimeError("hicache: vLLM registered no KV caches (register_kv_caches comes first)")
        return self.io

    def _host(self, n: int) -> torch.Tensor:
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = self._io().host_pages(n)
        return self._staging

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for job in meta.loads:
            self._load(job)

    def _load(self, job: BlockJob) -> None:
        io, n = self._io(), len(job.keys)
        got = 0
        try:
            host = self._host(n)
            got = self.store.get(job.keys, page_views(host[:n]))
            if got:
                io.scatter(job.block_ids[:got], host)
        except Exception:  # a bug, not the store being down (that is a miss): recompute, keep serving
            log.exception("hicache: loading %d blocks of request %s failed", n, job.req_id)
            got = 0
        if got < n:
            self._load_errors.update(job.block_ids[got:])
            log.info("hicache: request %s: %d of %d blocks not loaded, vLLM recomputes them", job.req_id, n - got, n)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks (every layer) are saved in wait_for_save

    def wait_for_save(self) -> None:
        if not self.writer or not self.has_connector_metadata():
            return
        for job in self._get_connector_metadata().saves:
            io = self._io()
            host = io.host_pages(len(job.keys))
            io.gather(job.block_ids, host)
            if not self.saver.offer(job.keys, host):
                log.warning("hicache: save queue full (save_queue_mb %d): %d blocks of request %s not saved",
                            self.settings.save_queue_mb, len(job.keys), job.req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def flush(self) -> None:
        """Wait until every save handed to the background writer is written (tests, shutdown)."""
        if hasattr(self, "saver"):
            self.saver.flush()

    # ------------------------------------------------------------------ both
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save lost to preemption is a later miss

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # the worker keeps views of the KV cache tensors

    def hicache_stats(self) -> dict[str, float]:
        """This side's ``hicache_storage_*`` counters, summed over its stores, plus the save queue's."""
        out: dict[str, float] = {}
        for s in self.stores:
            for k, v in s.stats().items():
                out[k] = out.get(k, 0.0) + v
        if hasattr(self, "saver"):
            out.update(save_written_pages=self.saver.written_pages, save_failed_pages=self.saver.failed_pages,
                       save_dropped_pages=self.saver.dropped_pages)
        return out

    def shutdown(self) -> None:
        if hasattr(self, "saver"):
            self.saver.flush()
            self.saver.close()
        for s in self.stores:
            s.close()
        self.stores = []


def _check_version() -> None:
    """Say once, at import, when this vLLM is not the release the connector was checked against."""
    try:
        from vllm import __version__ as version
    except ImportError:  # pragma: no cover
        version = "unknown"
    if not str(version).startswith(VLLM_TESTED):
        log.warning("hicache.integrations.vllm was checked against vLLM %s, this is %s: run tests/integrations",
                    VLLM_TESTED, version)


_check_version()
