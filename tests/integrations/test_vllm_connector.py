"""hicache's vLLM connector, driven by vLLM 0.34.0's own classes on the CPU.

Each :class:`Engine` is a vLLM engine without a model: vLLM's ``VllmConfig`` (with the documented
``--kv-transfer-config``), its ``Scheduler`` (which creates the scheduler-side connector through
``KVConnectorFactory`` from ``kv_connector_module_path``), a worker-side connector from the same factory,
the KV cache tensors vLLM's ``allocate_kv_cache`` makes, vLLM's block hasher and ``Request``s. Only the
model is fake: its "forward" writes each token's KV as a pure function of the tokens up to it (as a real
model's is), so any block's bytes are known. The step follows vLLM's GPU model runner: bind the metadata,
``start_load_kv`` before the forward when ``has_sync_kv_loads``, the forward, ``wait_for_save``,
``get_block_ids_with_load_errors`` into ``KVConnectorOutput``, ``Scheduler.update_from_output``.

Run with the engines' venv: ``.venv-engines/bin/python -m pytest tests/integrations``; skipped without
vLLM. Run as a script (``python test_vllm_connector.py write URL MODEL``) it is the other vLLM process of
the cross-process test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import redis

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform (before vLLM picks one)
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import triton_utils  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_none_hash_seed,
)
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from hicache.config import ConfigError  # noqa: E402
from hicache.integrations import vllm as hv  # noqa: E402
from hicache.storage.redis_local import LocalRedis, redis_server_binary  # noqa: E402

# vLLM's CPU platform refuses x86 without triton-cpu, which only running a model needs; none runs here.
triton_utils.HAS_TRITON = True

needs_redis = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")

BS = 16  # tokens per block
LAYERS, HEADS, HEAD = 2, 2, 8
NUM_BLOCKS = 64
FAST_REDIS = {"timeout_s": 1.0, "connect_timeout_s": 0.5, "retry_attempts": 1, "breaker_base_s": 0.05,
              "breaker_max_s": 0.1}
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": HEADS, "num_hidden_layers": LAYERS, "vocab_size": 256,
        "max_position_embeddings": 1024, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


def model_dir(root: Path, name: str = "tiny", **changes: Any) -> str:
    """A local model directory (a config.json, no weights: no model runs)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**TINY, **changes}))
    return str(d)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {"tiny": model_dir(root), "other": model_dir(root, "other", rms_norm_eps=1e-6)}


def kv_cache_config(layout: KVCacheLayout, mla: bool = False) -> KVCacheConfig:
    """vLLM's KV cache configuration of the tiny model: one group of full attention (or MLA)."""
    if mla:
        spec: FullAttentionSpec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    if layout.is_layer_compact:
        strides = {"layer_stride": page * NUM_BLOCKS, "block_stride": page}
    else:
        strides = {"layer_stride": page, "block_stride": page * LAYERS}
    tensor = KVCacheTensor(size=page * NUM_BLOCKS * LAYERS, layers=names, **strides)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def vllm_config(model: str, extra: dict[str, Any], algo: str = "sha256", tp: int = 1, **kt: Any) -> VllmConfig:
    """What ``vllm serve MODEL --block-size 16 --kv-transfer-config '...'`` builds (the documented JSON)."""
    transfer = {"kv_connector": "HiCacheConnector", "kv_connector_module_path": "hicache.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra, **kt}
    cfg = VllmConfig(model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16"),
                     cache_config=CacheConfig(block_size=BS, prefix_caching_hash_algo=algo),
                     scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=1024,
                                                      is_encoder_decoder=False),
                     parallel_config=ParallelConfig(tensor_parallel_size=tp),
                     kv_transfer_config=KVTransferConfig(**transfer))
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return cfg


def token_kv(tokens: list[int], rank: int = 0) -> torch.Tensor:
    """The fake model's KV of the last of ``tokens`` on TP rank ``rank`` (its heads): ``[L, H, C]``, a pure
    function of the prefix."""
    data = torch.tensor([rank, *tokens], dtype=torch.int32).numpy().tobytes()
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(data).digest()[:8]))
    return torch.randn((LAYERS, HEADS, 2 * HEAD), generator=g).to(torch.bfloat16)


class Engine:
    """One vLLM engine (a scheduler and a worker per TP rank) without a model (module docstring)."""

    def __init__(self, model: str, extra: dict[str, Any], *, layout: KVCacheLayout = KVCacheLayout.LBHNC,
                 kernel_block: int | None = None, algo: str = "sha256", tp: int = 1) -> None:
        self.config = vllm_config(model, extra, algo, tp=tp)
        self.kcc = kv_cache_config(layout)
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kcc,
                                   structured_output_manager=StructuredOutputManager(self.config), block_size=BS)
        hash_fn = get_hash_fn_by_name(algo)
        init_none_hash(hash_fn)  # as vLLM's EngineCore does, after it built the scheduler
        self.hasher = get_request_block_hasher(BS, hash_fn)
        self.workers: list[hv.HiCacheConnector] = []
        self.kvs: list[dict[str, torch.Tensor]] = []
        for rank in range(tp):  # (vLLM's TP process group is the one thing faked: the worker's rank)
            with mock.patch("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", return_value=rank):
                w = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kcc)
            assert isinstance(w, hv.HiCacheConnector)
            kv = allocate_kv_cache(self.kcc, torch.device("cpu"), layout, [kernel_block] if kernel_block else None)
            w.register_kv_caches(kv)
            self.workers.append(w)
            self.kvs.append(kv)
        self.ratio = BS // (kernel_block or BS)
        self.errors: set[int] = set()

    @property
    def worker(self) -> hv.HiCacheConnector:
        return self.workers[0]

    @property
    def connector(self) -> hv.HiCacheConnector:
        c = self.scheduler.connector
        assert isinstance(c, hv.HiCacheConnector)
        return c

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
        r = Request(req_id, tokens, SamplingParams(max_tokens=max_tokens), None, block_hasher=self.hasher)
        self.scheduler.add_request(r)
        return r

    def schedule(self, load: bool = True) -> SchedulerOutput:
        """vLLM's scheduling step and the workers' part before the forward (the sync loads; ``load=False``
        leaves them to :meth:`load`)."""
        out = self.scheduler.schedule()
        for w in self.workers:
            w.bind_connector_metadata(out.kv_connector_metadata)
        if load:
            self.load(out)
        return out

    def load(self, out: SchedulerOutput) -> None:
        if out.has_sync_kv_loads:
            for w in self.workers:
                w.start_load_kv(None)

    def finish(self, out: SchedulerOutput) -> SchedulerOutput:
        """The forward, the workers' part after it (their outputs merged as vLLM's KVOutputAggregator
        does), and the scheduler's update."""
        if not out.has_sync_kv_loads:
            for w in self.workers:
                w.start_load_kv(None)
        sampled = []
        for req_id, start in self._starts(out).items():
            r = self.scheduler.requests[req_id]
            n = out.num_scheduled_tokens[req_id]
            ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            for p in range(start, start + n):
                for rank in range(len(self.workers)):
                    self.write_slot(ids[p // BS], p % BS, token_kv(r.all_token_ids[: p + 1], rank), rank)
            done = start + n >= r.num_tokens
            sampled.append([sum(r.all_token_ids) % 256] if done else [])
        errors: set[int] = set()
        for w in self.workers:
            w.wait_for_save()
            errors |= w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
        self.errors |= errors
        mro = ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled,
                                kv_connector_output=KVConnectorOutput(invalid_block_ids=errors))
        self.scheduler.update_from_output(out, mro)
        return out

    def step(self) -> SchedulerOutput:
        return self.finish(self.schedule())

    def run(self) -> None:
        """Steps until every request finished; saves flushed."""
        for _ in range(50):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        for w in self.workers:
            w.flush()

    @staticmethod
    def _starts(out: SchedulerOutput) -> dict[str, int]:
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        c = out.scheduled_cached_reqs
        starts.update(zip(c.req_ids, c.num_computed_tokens, strict=True))
        return starts

    def _slot(self, layer: int, block: int, offset: int, rank: int) -> torch.Tensor:
        v = self.kvs[rank][self.kcc.kv_cache_groups[0].layer_names[layer]]  # [B', H, N', C]
        nk = BS // self.ratio
        return v[block * self.ratio + offset // nk, :, offset % nk, :]

    def write_slot(self, block: int, offset: int, value: torch.Tensor, rank: int = 0) -> None:
        for layer in range(LAYERS):
            self._slot(layer, block, offset, rank).copy_(value[layer])

    def block(self, block: int, rank: int = 0) -> torch.Tensor:
        """The KV of one block on TP rank ``rank`` as ``[L, BS, H, C]``."""
        return torch.stack([torch.stack([self._slot(layer, block, o, rank) for o in range(BS)])
                            for layer in range(LAYERS)])

    @staticmethod
    def expected(tokens: list[int], i: int, rank: int = 0) -> torch.Tensor:
        """What block ``i`` of a request with ``tokens`` holds on TP rank ``rank`` once computed."""
        rows = [token_kv(tokens[: p + 1], rank) for p in range(i * BS, (i + 1) * BS)]
        return torch.stack(rows).transpose(0, 1)  # [L, BS, H, C]

    def stats(self) -> dict[str, float]:
        """The workers' counters, summed."""
        out: dict[str, float] = {}
        for w in self.workers:
            for k, v in w.hicache_stats().items():
                out[k] = out.get(k, 0.0) + v
        return out

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.connector.shutdown()


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


def new_engine(engines: list[Engine], *args: Any, **kw: Any) -> Engine:
    e = Engine(*args, **kw)
    engines.append(e)
    return e


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    with LocalRedis() as r:
        yield r


@pytest.fixture(params=["file", pytest.param("redis", marks=[pytest.mark.redis, needs_redis])])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    server: LocalRedis = request.getfixturevalue("redis_server")
    server.client().flushall()
    return server.url


# ---------------------------------------------------------------------- the surface
def test_vllm_builds_the_connector_from_the_documented_config(models: dict[str, str], tmp_path: Path) -> None:
    cfg = vllm_config(models["tiny"], {"url": f"file://{tmp_path}"})
    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is hv.HiCacheConnector
    assert issubclass(hv.HiCacheConnector, KVConnectorBase_V1)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager  # vLLM turned HMA off for it by itself
    c = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(KVCacheLayout.LBHNC))
    assert isinstance(c, hv.HiCacheConnector)
    c.shutdown()


def test_docs_show_the_config_the_tests_use() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    line = doc.split("--kv-transfer-config '", 1)[1].split("'", 1)[0]
    cfg = json.loads(line)
    assert cfg["kv_connector"] == "HiCacheConnector" and cfg["kv_connector_module_path"] == "hicache.integrations.vllm"
    assert cfg["kv_load_failure_policy"] == "recompute" and "url" in cfg["kv_connector_extra_config"]


# ---------------------------------------------------------------------- round trips and sharing
@pytest.mark.parametrize(("layout", "kernel_block"), [(KVCacheLayout.BLNHC, None), (KVCacheLayout.LBNHC, 8)])
def test_second_engine_hits_byte_exact(engines: list[Engine], models: dict[str, str], store_url: str,
                                       layout: KVCacheLayout, kernel_block: int | None) -> None:
    extra = {"url": store_url, "options": FAST_REDIS} if store_url.startswith("redis") else {"url": store_url}
    first = new_engine(engines, models["tiny"], extra)
    prompts = {"a": prompt(1, 5 * BS + 3), "b": prompt(2, 4 * BS)}  # b: a whole-prompt hit later
    for rid, toks in prompts.items():
        first.add(rid, toks)
    first.run()
    assert first.stats()["save_written_pages"] == 5 + 4
    assert first.connector.planner.tracked() == 0  # finished requests are forgotten

    # a fresh engine from scratch, another physical layout (and kernel block splitting): same pages
    second = new_engine(engines, models["tiny"], extra, layout=layout, kernel_block=kernel_block)
    for rid, toks in prompts.items():
        second.add(rid, toks)
    out = second.schedule()
    computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    assert computed == {"a": 5 * BS, "b": 4 * BS - 1}  # b leaves one token to compute, for its logits
    assert out.has_sync_kv_loads
    for rid, toks in prompts.items():
        ids = second.scheduler.kv_cache_manager.get_block_ids(rid)[0]
        for i in range(len(toks) // BS):
            assert same_bytes(second.block(ids[i]), first.expected(toks, i)), (rid, i)
    second.finish(out)
    second.run()
    assert second.errors == set()
    s = second.stats()
    assert s["gets"] == 9 and s["corrupt_pages"] == 0 and s["skipped_writes"] == 0
    assert s["save_written_pages"] == 0  # nothing new to save: the loaded blocks are not written again


def test_another_process_hits_what_this_one_wrote(engines: list[Engine], models: dict[str, str],
                                                 tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    proc = subprocess.run([sys.executable, __file__, "write", url, models["tiny"]], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["save_written_pages"] == 3
    e = new_engine(engines, models["tiny"], {"url": url})
    e.add("x", prompt(7, 3 * BS + 5))
    out = e.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BS
    e.finish(out)
    assert e.errors == set() and e.stats()["gets"] == 3


def _write_in_this_process(url: str, model: str) -> None:
    e = Engine(model, {"url": url})
    e.add("x", prompt(7, 3 * BS + 5))
    e.run()
    print(json.dumps(e.stats()))
    e.close()


def test_two_models_and_two_tenants_never_share(engines: list[Engine], models: dict[str, str],
                                                store_url: str) -> None:
    toks = prompt(3, 3 * BS)
    first = new_engine(engines, models["tiny"], {"url": store_url})
    first.add("a", toks)
    first.run()
    for model, extra in ((models["other"], {"url": store_url}),  # another config.json: other weights
                         (models["tiny"], {"url": store_url, "tenant": "t2"}),
                         (models["tiny"], {"url": store_url, "revision": "v2"})):
        e = new_engine(engines, model, extra)
        e.add("a", toks)
        out = e.schedule()
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0, extra
        e.finish(out)


def test_tp_ranks_keep_their_own_pages(engines: list[Engine], models: dict[str, str], store_url: str) -> None:
    toks = prompt(9, 4 * BS + 2)
    first = new_engine(engines, models["tiny"], {"url": store_url}, tp=2)
    req = first.add("a", toks)
    hashes = list(req.block_hashes)
    first.run()
    assert first.stats()["save_written_pages"] == 2 * 4  # each rank its own heads
    assert {w.store.ns.digest for w in first.workers} == {s.ns.digest for s in first.connector.stores}
    assert len({w.store.ns.digest for w in first.workers}) == 2

    # the same model without TP: another namespace, no hit
    single = new_engine(engines, models["tiny"], {"url": store_url})
    single.add("a", toks)
    out = single.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    single.finish(out)

    # rank 1 lost block 2: a block is a hit only where every rank has it
    first.workers[1].store.delete(hashes[2:3])
    second = new_engine(engines, models["tiny"], {"url": store_url}, tp=2)
    second.add("a", toks)
    out = second.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 2 * BS
    ids = second.scheduler.kv_cache_manager.get_block_ids("a")[0]
    for rank in (0, 1):
        for i in range(2):
            assert same_bytes(second.block(ids[i], rank), Engine.expected(toks, i, rank)), (rank, i)
    second.finish(out)
    assert second.errors == set()


# ---------------------------------------------------------------------- failures become recomputation
def _corrupt(url: str, storage_key: bytes) -> None:
    if url.startswith("file://"):
        (path,) = Path(url.removeprefix("file://")).rglob(f"{storage_key.hex()}*")
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        r = redis.Redis.from_url(url)
        key = b"hicache:{%s}" % storage_key.hex().encode()  # the Redis backend's key of a page
        last = r.strlen(key) - 1
        r.setrange(key, last, bytes([r.getrange(key, last, last)[0] ^ 0xFF]))
        r.close()


def test_damaged_page_is_a_miss_and_vllm_recomputes(engines: list[Engine], models: dict[str, str],
                                                    store_url: str) -> None:
    toks = prompt(4, 4 * BS + 1)
    first = new_engine(engines, models["tiny"], {"url": store_url})
    req = first.add("a", toks)
    hashes = list(req.block_hashes)
    first.run()
    _corrupt(store_url, first.worker.store.storage_keys([hashes[1]])[0])

    second = new_engine(engines, models["tiny"], {"url": store_url})
    second.add("a", toks)
    out = second.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * BS  # the lookup cannot see the damage
    ids = second.scheduler.kv_cache_manager.get_block_ids("a")[0]
    second.finish(out)
    assert second.errors == set(ids[1:4])  # block 1 and every block after it: vLLM was told
    assert second.stats()["corrupt_pages"] == 1
    assert second.scheduler.requests["a"].num_computed_tokens == BS  # vLLM keeps block 0 and recomputes
    second.run()
    for i in range(4):
        assert same_bytes(second.block(ids[i]), second.expected(toks, i)), i


@pytest.mark.redis
@needs_redis
def test_redis_cut_mid_batch_then_killed_then_restarted(engines: list[Engine], models: dict[str, str]) -> None:
    from tcpproxy import TcpProxy

    with LocalRedis() as server, TcpProxy(server.port) as proxy:
        extra = {"url": proxy.url, "io_batch_pages": 1, "options": FAST_REDIS}
        toks = prompt(5, 6 * BS + 2)
        first = new_engine(engines, models["tiny"], extra)
        first.add("a", toks)
        first.run()
        assert first.stats()["save_written_pages"] == 6

        # the connection breaks while the 6-page load is under way: that load fails from the cut on
        second = new_engine(engines, models["tiny"], extra)
        second.add("a", toks)
        out = second.schedule(load=False)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 6 * BS
        ids = second.scheduler.kv_cache_manager.get_block_ids("a")[0]
        proxy.arm(2 * second.worker.store.page_bytes + 400)  # past page 0's reply (its frame), inside page 1's
        second.load(out)
        second.finish(out)
        assert proxy.cuts == 1
        assert second.errors and second.errors <= set(ids[1:6]) and ids[0] not in second.errors
        second.run()  # vLLM recomputed the rest
        for i in range(6):
            assert same_bytes(second.block(ids[i]), second.expected(toks, i)), i

        # Redis killed (straight to the server now: the proxy cannot reconnect to a dead upstream):
        # lookups miss, saves fail, nothing raises; the engine goes on computing
        extra = {**extra, "url": server.url}
        port = server.port
        server.kill()
        down = new_engine(engines, models["tiny"], extra)
        down.add("b", prompt(6, 3 * BS))
        out = down.schedule()
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
        down.finish(out)
        down.run()
        assert down.stats()["save_failed_pages"] == 3 and down.stats()["errors"] > 0

        # restarted (empty, on the same port): the next batch is written and read again
        with LocalRedis(port=port):
            for i in range(40):  # the store's breaker lets a probe through within its cooldown (0.1 s)
                toks = prompt(100 + i, 3 * BS)
                written = down.stats()["save_written_pages"]
                down.add(f"c{i}", toks)
                down.run()
                if down.stats()["save_written_pages"] == written + 3:
                    break
                time.sleep(0.05)
            else:
                pytest.fail("no save succeeded after Redis came back")
            again = new_engine(engines, models["tiny"], extra)
            again.add("c", toks)
            out = again.schedule()
            assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BS - 1
            again.finish(out)
            assert again.errors == set()


# ---------------------------------------------------------------------- refused configurations
def test_random_none_hash_is_refused(models: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    extra = {"url": f"file://{tmp_path}"}
    kcc = kv_cache_config(KVCacheLayout.LBHNC)
    for algo in ("xxhash", "xxhash_cbor"):
        with pytest.raises(ConfigError, match=r"random.*never hit.*sha256") as e:
            KVConnectorFactory.create_connector(vllm_config(models["tiny"], extra, algo), KVConnectorRole.SCHEDULER,
                                                kcc)
        assert "\n" not in str(e.value)
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # the same seed everywhere: deterministic, accepted
    KVConnectorFactory.create_connector(vllm_config(models["tiny"], extra, "xxhash"), KVConnectorRole.SCHEDULER,
                                        kcc).shutdown()
    monkeypatch.delenv("PYTHONHASHSEED")
    KVConnectorFactory.create_connector(vllm_config(models["tiny"], extra, "sha256_cbor"), KVConnectorRole.SCHEDULER,
                                        kcc).shutdown()


@pytest.mark.parametrize(("extra", "kt", "match"), [
    ({"url": "file:///tmp/x", "colour": 1}, {}, "kv_connector_extra_config: colour: unknown field"),
    ({}, {}, "kv_connector_extra_config: url: required"),
    ({"url": "file:///tmp/x", "save_queue_mb": -1}, {}, "save_queue_mb: must be an integer >= 0"),
    ({"url": "file:///tmp/x"}, {"kv_load_failure_policy": "fail"}, "kv_load_failure_policy: must be \"recompute\""),
])
def test_bad_configuration_is_one_line(models: dict[str, str], extra: dict[str, Any], kt: dict[str, Any],
                                       match: str) -> None:
    cfg = vllm_config(models["tiny"], extra, **kt)
    with pytest.raises(ConfigError, match=match) as e:
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(KVCacheLayout.LBHNC))
    assert "\n" not in str(e.value)


def test_hybrid_models_are_refused(models: dict[str, str], tmp_path: Path) -> None:
    kcc = kv_cache_config(KVCacheLayout.LBHNC)
    two = dataclasses.replace(kcc, kv_cache_groups=[*kcc.kv_cache_groups, kcc.kv_cache_groups[0]])
    cfg = vllm_config(models["tiny"], {"url": f"file://{tmp_path}"})
    with pytest.raises(ConfigError, match="2 KV cache groups"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, two)


def test_mla_pages_are_shared_by_tp_ranks(models: dict[str, str], tmp_path: Path) -> None:
    cfg = vllm_config(models["tiny"], {"url": f"file://{tmp_path}"})
    kcc = kv_cache_config(KVCacheLayout.LBHNC, mla=True)
    c = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    assert isinstance(c, hv.HiCacheConnector)
    assert c.shard.layout.attention == "mla" and c.store.ns.tp_size == 1
    kv = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC)
    c.register_kv_caches(kv)
    io = c._io()
    host = io.host_pages(2)
    host.copy_(torch.randn(host.shape).to(host.dtype))
    io.scatter([3, 5], host)
    back = io.host_pages(2)
    io.gather([3, 5], back)
    assert same_bytes(host, back)
    c.shutdown()


# ---------------------------------------------------------------------- the vLLM signatures relied on
BASE = KVConnectorBase_V1
PINNED: dict[str, tuple[Any, str]] = {
    "__init__": (BASE.__init__, "(self, vllm_config: 'VllmConfig', role: vllm.distributed.kv_transfer.kv_connector"
                 ".v1.base.KVConnectorRole, kv_cache_config: 'KVCacheConfig')"),
    "get_num_new_matched_tokens": (BASE.get_num_new_matched_tokens, "(self, request: 'Request', "
                                   "num_computed_tokens: int) -> tuple[int | None, bool]"),
    "update_state_after_alloc": (BASE.update_state_after_alloc, "(self, request: 'Request', "
                                 "blocks: 'KVCacheBlocks', num_external_tokens: int)"),
    "build_connector_meta": (BASE.build_connector_meta, "(self, scheduler_output: vllm.v1.core.sched.output."
                             "SchedulerOutput) -> vllm.distributed.kv_transfer.kv_connector.v1.base."
                             "KVConnectorMetadata"),
    "request_finished": (BASE.request_finished, "(self, request: 'Request', block_ids: list[int]) -> "
                         "tuple[bool, dict[str, typing.Any] | None]"),
    "register_kv_caches": (BASE.register_kv_caches, "(self, kv_caches: dict[str, torch.Tensor])"),
    "start_load_kv": (BASE.start_load_kv, "(self, forward_context: 'ForwardContext', **kwargs: Any) -> None"),
    "wait_for_layer_load": (BASE.wait_for_layer_load, "(self, layer_name: str) -> None"),
    "save_kv_layer": (BASE.save_kv_layer, "(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "
                      "'AttentionMetadata', **kwargs: Any) -> None"),
    "wait_for_save": (BASE.wait_for_save, "(self)"),
    "get_block_ids_with_load_errors": (BASE.get_block_ids_with_load_errors, "(self) -> set[int]"),
    "shutdown": (BASE.shutdown, "(self)"),
    "supports_sleep_mode": (BASE.supports_sleep_mode, "(kv_transfer_config: 'KVTransferConfig') -> bool"),
    "bind_connector_metadata": (BASE.bind_connector_metadata, "(self, connector_metadata: vllm.distributed."
                                "kv_transfer.kv_connector.v1.base.KVConnectorMetadata) -> None"),
    "_get_connector_metadata": (BASE._get_connector_metadata, "(self) -> vllm.distributed.kv_transfer."
                                "kv_connector.v1.base.KVConnectorMetadata"),
    "resolve_none_hash_seed": (resolve_none_hash_seed,
                               "(hash_fn: collections.abc.Callable[[typing.Any], bytes]) -> str"),
    "get_hash_fn_by_name": (get_hash_fn_by_name, "(hash_fn_name: 'str') -> 'Callable[[Any], bytes]'"),
}
FIELDS: dict[type, set[str]] = {
    NewRequestData: {"req_id", "block_ids", "num_computed_tokens"},
    CachedRequestData: {"req_ids", "new_block_ids", "num_computed_tokens"},
    SchedulerOutput: {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "has_sync_kv_loads"},
    KVCacheConfig: {"num_blocks", "kv_cache_groups", "hash_block_size"},
    KVCacheGroupSpec: {"layer_names", "kv_cache_spec"},
    FullAttentionSpec: {"block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "kv_quant_mode",
                        "num_head_slots", "state_content_bytes", "tokens_per_state"},
    KVConnectorOutput: {"invalid_block_ids"},
}


def test_vllm_version_is_the_pinned_one() -> None:
    assert vllm.__version__ == hv.VLLM_TESTED, "a new vLLM: check the signatures below, then move VLLM_TESTED"


@pytest.mark.parametrize("name", sorted(PINNED))
def test_vllm_signature_is_unchanged(name: str) -> None:
    fn, expect = PINNED[name]
    assert str(inspect.signature(fn)) == expect, f"vLLM changed {name}: the connector relies on it"


@pytest.mark.parametrize("cls", list(FIELDS), ids=lambda c: c.__name__)
def test_vllm_fields_are_there(cls: type) -> None:
    have = {f.name for f in dataclasses.fields(cls)}
    assert FIELDS[cls] <= have, f"vLLM dropped {sorted(FIELDS[cls] - have)} from {cls.__name__}"


def test_request_attributes_are_there() -> None:
    r = Request("r", list(range(40)), SamplingParams(max_tokens=1), None,
                block_hasher=get_request_block_hasher(BS, get_hash_fn_by_name("sha256")))
    assert r.request_id == "r" and r.num_tokens == 40 and r.num_computed_tokens == 0
    assert len(r.block_hashes) == 2 and all(isinstance(h, bytes) and len(h) == 32 for h in r.block_hashes)


if __name__ == "__main__" and sys.argv[1:2] == ["write"]:
    _write_in_this_process(sys.argv[2], sys.argv[3])
