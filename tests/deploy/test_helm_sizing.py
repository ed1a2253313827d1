"""The chart's sizes and time limits checked against what hicache does with them.

* Memory: ``hicache serve`` refuses to start when its L2 pool does not fit in the memory left under the
  container's limit, and on a CPU node the L1 pool is host memory too. The render fails when
  ``node.resources.limits.memory`` is below L2 + L1 (CPU) + ``node.memoryOverhead``, with the L2 size taken
  from hicache's own ``HostPool`` (its size check, made to fail so nothing is allocated) for many layouts.
* /dev/shm: a CPU node's shared L1 pool is a /dev/shm segment; a ``node.shm.sizeLimit`` that cannot hold it
  would kill the node with SIGBUS, so it fails the render.
* Shutdown: the node's graceful stop can take twice ``serve.shutdown_grace_s`` (an engine's open
  MatchStream holds the RPC drain for the whole grace, then the L3 flush waits as long again) plus its
  writeback threads' joins; ``terminationGracePeriodSeconds`` must cover that. A real node is stopped here to
  show it. The router's grace period covers ``router.config.shutdown_grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
import pytest

helm = pytest.importorskip("helm_python")

from helm_render import container, pod_spec, render  # noqa: E402

import hicache.pool  # noqa: E402
from hicache.config import HiCacheConfig, config_from_dict  # noqa: E402
from hicache.pool import HostMemoryError, HostPool  # noqa: E402

GIB = 1 << 30
OVERHEAD = 2 * GIB  # node.memoryOverhead's default
MEMORY_ERROR = r"node\.resources\.limits\.memory \("


def deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def node_config(values: dict[str, Any]) -> HiCacheConfig:
    """The node's config as the chart renders it (the ConfigMap's hicache.yaml)."""
    return config_from_dict(render(values).config_data())


def l2_bytes(cfg: HiCacheConfig) -> int:
    """Bytes hicache's HostPool asks for the config's L2, as HiCache builds it (at least one page), read from
    the pool's own size check with no memory available, so nothing is allocated."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hicache.pool, "available_host_memory", lambda: 0)
        with pytest.raises(HostMemoryError) as e:
            HostPool(cfg.layout.to_layout(), max(cfg.l2_pages, 1), cfg.cache.host_layout,  # type: ignore[arg-type]
                     pin_memory=False, block_pages=cfg.cache.host_block_pages)
    return e.value.needed


def node_memory(cfg: HiCacheConfig, gpu: bool) -> int:
    """What a node pod's memory limit must hold: L2, the L1 pool on a CPU node, and the overhead."""
    l1 = 0 if gpu else cfg.l1_pages * cfg.layout.to_layout().bytes_per_page
    return l2_bytes(cfg) + l1 + OVERHEAD


def with_limit(values: dict[str, Any], limit: Any) -> dict[str, Any]:
    return deep_merge(values, {"node": {"resources": {"requests": {"memory": limit}, "limits": {"memory": limit}}}})


# --- memory ----------------------------------------------------------------------------------------------

SMALL = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16", "page_size": 16}
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "page-first-partial-page": {"layout": SMALL, "cache": {"l1_tokens": 4096, "l2_tokens": 100_003}},
    "l2-off-keeps-one-page": {"layout": SMALL, "cache": {"l1_tokens": 4096, "l2_tokens": 0}},
    "layer-first": {"layout": SMALL, "cache": {"l1_tokens": 4096, "l2_tokens": 999, "host_layout": "layer_first"}},
    # 512-byte pieces: the default block is capped at 64 pages, so 62 pages take one whole block
    "block-first-capped-block": {"layout": SMALL, "cache": {"l1_tokens": 4096, "l2_tokens": 1000,
                                                             "host_layout": "block_first"}},
    # 32 KiB pieces: blocks of 2 pages, so 7 pages take 4 blocks
    "block-first-default-block": {"layout": {"num_layers": 4, "num_kv_heads": 8, "head_dim": 128,
                                             "dtype": "bfloat16", "page_size": 16},
                                  "cache": {"l1_tokens": 4096, "l2_tokens": 7 * 16, "host_layout": "block_first"}},
    "block-first-given-block": {"layout": SMALL, "cache": {"l1_tokens": 4096, "l2_tokens": 12 * 16,
                                                            "host_layout": "block_first", "host_block_pages": 5}},
    "mla-fp8": {"layout": {"num_layers": 61, "num_kv_heads": 1, "head_dim": 576, "dtype": "float8_e4m3fn",
                           "page_size": 1, "attention": "mla"},
                "cache": {"l1_tokens": 1000, "l2_tokens": 123_457}},
    "float32-large": {"layout": {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128, "dtype": "float32",
                                 "page_size": 32},
                      "cache": {"l1_tokens": 32_768, "l2_tokens": 1_000_000}},
}


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_render_fails_exactly_when_the_limit_cannot_hold_the_pools(case: str, gpu: bool) -> None:
    values: dict[str, Any] = {"node": {"gpu": {"enabled": gpu}}, "config": CONFIGS[case]}
    need = node_memory(node_config(with_limit(values, "1Ei")), gpu)
    r = render(with_limit(values, str(need)))  # exactly enough: renders
    assert container(r.component("node"))["resources"]["limits"]["memory"] == str(need)
    with pytest.raises(helm.HelmRenderError, match=MEMORY_ERROR):
        render(with_limit(values, str(need - 1)))


def test_default_limit_holds_the_default_pools_on_gpu_nodes_only() -> None:
    r = render({})
    cfg = config_from_dict(r.config_data())
    limit = container(r.component("node"))["resources"]["limits"]["memory"]
    assert limit == "40Gi"
    assert node_memory(cfg, gpu=True) == 34 * GIB <= 40 * GIB  # 32 GiB of L2 + the overhead
    assert "= 34.0 GiB (limit 40Gi)" in r.notes
    # a CPU node's L1 (8 GiB) is host memory too: 42 GiB do not fit in 40Gi, and the message says what to do
    assert node_memory(cfg, gpu=False) == 42 * GIB
    with pytest.raises(helm.HelmRenderError, match=r"limits.memory \(40Gi\).*42\.0 GiB.*at least 42Gi"):
        render({"node": {"gpu": {"enabled": False}}})
    cpu = render(with_limit({"node": {"gpu": {"enabled": False}}}, "42Gi"))
    assert "L2 32.0 GiB + L1 8.0 GiB + overhead 2.0 GiB = 42.0 GiB (limit 42Gi)" in cpu.notes


# 42 GiB is 45097156608 bytes: what a CPU node with the default config needs
@pytest.mark.parametrize(("limit", "fits"), [
    ("42Gi", True), ("45097156608", True), (45097156608, True), ("45.1G", True), ("43008Mi", True),
    ("0.05Ti", True), ("41.99Gi", False), ("45097156607", False), (45097156607, False), ("45.09G", False),
    ("43007Mi", False), ("44040191Ki", False),
])
def test_memory_quantities_are_read_in_bytes(limit: Any, fits: bool) -> None:
    values = with_limit({"node": {"gpu": {"enabled": False}}}, limit)
    if fits:
        render(values)
    else:
        with pytest.raises(helm.HelmRenderError, match=MEMORY_ERROR):
            render(values)


def test_overhead_and_no_limit() -> None:
    """node.memoryOverhead is part of the sum; without a memory limit there is nothing to check."""
    with pytest.raises(helm.HelmRenderError, match=MEMORY_ERROR):
        render({"node": {"memoryOverhead": "8.5Gi"}})  # 32 + 8.5 > 40
    render({"node": {"memoryOverhead": "8Gi"}})
    r = render({"node": {"gpu": {"enabled": False}, "resources": {"limits": None}}})
    assert "memory" not in (container(r.component("node"))["resources"].get("limits") or {})
    assert "no memory limit set" in r.notes


# --- /dev/shm --------------------------------------------------------------------------------------------

SHM_CONFIG = {"layout": SMALL, "cache": {"l1_tokens": 4096, "l2_tokens": 4096}}


def test_shm_size_limit_must_hold_the_cpu_l1_pool() -> None:
    from hicache.service.shared_pool import SharedPool

    cfg = config_from_dict(SHM_CONFIG)
    shared = SharedPool(cfg.layout.to_layout(), cfg.l1_pages, "cpu")  # the segment the node creates
    try:
        pool = shared.nbytes
    finally:
        shared.close()
    assert pool == 512 << 10

    def values(size: str) -> dict[str, Any]:
        return {"config": SHM_CONFIG, "node": {"gpu": {"enabled": False}, "shm": {"sizeLimit": size}}}

    def shm(r: Any) -> dict[str, Any]:
        return dict(next(v for v in pod_spec(r.component("node"))["volumes"] if v["name"] == "dshm"))

    assert shm(render(values("512Ki")))["emptyDir"] == {"medium": "Memory", "sizeLimit": "512Ki"}
    with pytest.raises(helm.HelmRenderError, match=r"node.shm.sizeLimit \(511Ki\) cannot hold the shared L1 pool"):
        render(values("511Ki"))
    with pytest.raises(helm.HelmRenderError, match=r"node\.shm\.sizeLimit \("):
        render(values(str(pool - 1)))
    render(values(str(pool)))
    # no CPU pool in /dev/shm: a GPU node, a pool not shared, or the host's /dev/shm (no size)
    render({**values("1Ki"), "node": {"gpu": {"enabled": True}, "shm": {"sizeLimit": "1Ki"}}})
    render({**values("1Ki"), "config": {**SHM_CONFIG, "serve": {"shared_pool": False}}})
    render({**values("1Ki"), "node": {"gpu": {"enabled": False}, "shm": {"sizeLimit": "1Ki", "hostPath": "/dev/shm"}}})
    # the default size holds the pool, with 1 GiB to spare
    default = shm(render({"config": SHM_CONFIG, "node": {"gpu": {"enabled": False}}}))["emptyDir"]
    assert default["medium"] == "Memory" and int(default["sizeLimit"].removesuffix("Mi")) << 20 >= pool + GIB


# --- shutdown --------------------------------------------------------------------------------------------


def stop_seconds(grace: float) -> int:
    """How long the node's graceful stop may take: the RPC drain and the L3 flush, each up to the grace, then
    the writeback worker and notifier joins, up to 10 s each (hicache.storage.writeback.Writeback.close)."""
    return 2 * math.ceil(grace) + 20


def test_default_grace_period_covers_the_node_shutdown() -> None:
    r = render({})
    grace = config_from_dict(r.config_data()).serve.shutdown_grace_s
    assert pod_spec(r.component("node"))["terminationGracePeriodSeconds"] >= stop_seconds(grace) == 80


@pytest.mark.parametrize("grace", [30.0, 12.5, 0.0])
def test_grace_period_below_the_node_shutdown_fails_the_render(grace: float) -> None:
    need = stop_seconds(grace)
    ok = render({"config": {"serve": {"shutdown_grace_s": grace}}, "node": {"terminationGracePeriodSeconds": need}})
    assert pod_spec(ok.component("node"))["terminationGracePeriodSeconds"] == need
    with pytest.raises(helm.HelmRenderError, match=rf"terminationGracePeriodSeconds \({need - 1}\) must be at least "
                                                    rf"{need}"):
        render({"config": {"serve": {"shutdown_grace_s": grace}}, "node": {"terminationGracePeriodSeconds": need - 1}})


def test_router_grace_period_covers_its_shutdown_grace() -> None:
    def router_grace(values: dict[str, Any]) -> int:
        return int(pod_spec(render(values).component("router"))["terminationGracePeriodSeconds"])

    assert router_grace({}) == 30  # Kubernetes' own default, above the router's 5 s
    assert router_grace({"router": {"config": {"shutdown_grace_s": 45.5}}}) >= 46 + 5


def test_node_stop_takes_the_grace_twice_with_an_open_match_stream() -> None:
    """The premise of the grace period check, on a real node: a client's MatchStream left open holds the RPC
    drain for the whole grace, then queued writebacks to a slow store get the grace again, then the writer
    finishes its batch; the stop takes more than twice the grace, and less than the chart's bound."""
    from hicache.client import HiCacheClient
    from hicache.service.server import NodeServer
    from hicache.storage.base import StorageContext
    from hicache.storage.memory import MemoryBackend

    grace, page_s, pages = 1.0, 0.4, 10  # writes of 4 s queued when the stop starts
    cfg = config_from_dict({
        "layout": SMALL, "cache": {"l1_tokens": 64 * 16, "l2_tokens": 64 * 16, "write_policy": "write_through"},
        "storage": {"io_batch_pages": 1},
        "serve": {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": grace}})

    class SlowStore(MemoryBackend):
        def batch_set(self, keys: Sequence[bytes], host_pool: HostPool, host_indices: Sequence[int]) -> int:
            time.sleep(page_s * len(keys))
            return super().batch_set(keys, host_pool, host_indices)

    ns = cfg.namespace()
    store = SlowStore("memory://", StorageContext(ns.digest, cfg.layout.to_layout(), ns.model))

    def engine(target: str) -> tuple[HiCacheClient, Any]:
        client = HiCacheClient(target)
        for i in range(pages):  # one page each: one writeback each
            tokens = np.arange(i * 16, (i + 1) * 16, dtype=np.uint32)
            m = client.match(tokens, f"r{i}")
            new = client.allocate(f"r{i}", m.num_pages - m.l1_pages)
            client.commit(f"r{i}", tokens, np.concatenate([m.device_indices, new]))
            client.release(f"r{i}")
        stream = client.match_stream()
        stream.match(np.arange(16, dtype=np.uint32), peek=True)  # left open, as an engine keeps it
        return client, stream

    async def main() -> tuple[float, Any]:
        node = NodeServer(cfg, storage=store)
        await node.start()
        client, stream = await asyncio.to_thread(engine, f"127.0.0.1:{node.port}")
        try:
            t0 = time.monotonic()
            report = await node.stop()
            return time.monotonic() - t0, report
        finally:
            with contextlib.suppress(grpc.RpcError):  # the node cancelled the stream at the end of the grace
                await asyncio.to_thread(stream.close)
            await asyncio.to_thread(client.close)

    elapsed, report = asyncio.run(main())
    assert report is not None and report.pending_pages > 0  # the flush gave up: writebacks were still queued
    assert 2 * grace < elapsed < stop_seconds(grace), elapsed
