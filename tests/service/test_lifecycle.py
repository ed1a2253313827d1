"""Shutdown flushes L3 writebacks; concurrency limit; /metrics; health and reflection; client retries."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from hicache.client import CallError, HiCacheClient, RetryPolicy
from hicache.config import config_from_dict
from hicache.keys import page_keys
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.storage.base import StorageContext, create_backend

from .service_harness import ServerProc, free_port, serve_prompt

PS = 16


def commit(c: HiCacheClient, toks: np.ndarray, rid: str) -> int:
    m = c.match(toks, rid)
    new = c.allocate(rid, m.num_pages - m.l1_pages)
    res = c.commit(rid, toks, np.concatenate([m.device_indices, new]))
    c.release(rid)
    return res.new_pages


def test_sigterm_flushes_writebacks_to_the_file_store(server_factory: Callable[..., ServerProc],
                                                      tmp_path: Path) -> None:
    pytest.importorskip("hicache.storage.file_backend")
    url = f"file://{tmp_path / 'l3'}"
    srv = server_factory(cache={"write_policy": "write_through"}, storage={"url": url})
    prompts = [np.random.default_rng(i).integers(0, 30_000, 24 * PS).astype(np.uint32) for i in range(6)]
    with HiCacheClient(srv.target) as c:
        total = sum(commit(c, t, f"r{i}") for i, t in enumerate(prompts))
        c.match(prompts[0], "left-open")  # an open request at shutdown is released, not leaked
    assert total == 6 * 24
    assert srv.terminate(30) == 0
    log = srv.log()
    assert f"L3 flush: {total} pages written" in log, log
    assert "NOT written" not in log
    cfg = config_from_dict(srv.config)
    ns = cfg.namespace()
    store = create_backend(url, StorageContext(ns.digest, cfg.layout.to_layout(), ns.model))
    try:
        for t in prompts:
            keys = page_keys(ns, t)
            assert store.batch_exists(keys) == len(keys)
    finally:
        store.close()


def test_flush_waits_for_the_store_while_serving(server_factory: Callable[..., ServerProc], tmp_path: Path) -> None:
    """Flush returns once every page committed so far is in the L3 store, and the node keeps serving."""
    pytest.importorskip("hicache.storage.file_backend")
    url = f"file://{tmp_path / 'l3-flush'}"
    srv = server_factory(cache={"write_policy": "write_through"}, storage={"url": url})
    prompts = [np.random.default_rng(100 + i).integers(0, 30_000, 16 * PS).astype(np.uint32) for i in range(5)]
    cfg = config_from_dict(srv.config)
    ns = cfg.namespace()
    store = create_backend(url, StorageContext(ns.digest, cfg.layout.to_layout(), ns.model))
    try:
        with HiCacheClient(srv.target) as c:
            total = sum(commit(c, t, f"f{i}") for i, t in enumerate(prompts))
            r = c.flush()
            assert r.has_storage and r.complete and r.written_pages == total == 5 * 16
            assert (r.failed_pages, r.dropped_pages, r.pending_pages) == (0, 0, 0)
            for t in prompts:  # read back by a second process's view of the store: all there, now
                keys = page_keys(ns, t)
                assert store.batch_exists(keys) == len(keys)
            assert c.stats().storage_pages_written == total
            for bad in (-1.0, float("nan"), float("inf")):
                with pytest.raises(grpc.RpcError) as ei:
                    c.stub.Flush(pb.FlushRequest(timeout_s=bad), timeout=c.timeout_s)
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in ei.value.details()
            assert c.match(prompts[0], peek=True).l1_pages == 16  # still serving, nothing lost
    finally:
        store.close()


def test_flush_without_a_store(server: ServerProc) -> None:
    with HiCacheClient(server.target) as c:
        r = c.flush()
    assert not r.has_storage and r.complete and r.written_pages == 0


def test_a_store_that_does_not_answer_is_named_at_start_and_serving_goes_on(
        server_factory: Callable[..., ServerProc], tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    s = server_factory(storage={"url": f"file://{blocker}/store"})  # cannot be created under a file
    assert f"L3 file://{blocker}/store does not answer" in s.log()
    with HiCacheClient(s.target) as c:
        tokens = list(range(7000, 7000 + 4 * 16))  # four 16-token pages
        serve_prompt(c, tokens, "after-down-store")
        assert c.match(tokens, peek=True).l1_pages == 4  # L1/L2 serve as usual


def test_storage_up_follows_the_store(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``hicache_storage_up`` is 0 while the store cannot be reached and turns 1 once it can, without a
    restart; each change is logged once."""
    import asyncio
    import logging

    from hicache.service.server import NodeServer

    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")  # a directory cannot be created under a regular file: the store is down
    cfg = config_from_dict({
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16", "page_size": 16},
        "cache": {"l1_tokens": 16 * 64, "l2_tokens": 16 * 64},
        "storage": {"url": f"file://{blocker}/store"},
        "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0},
    })

    async def main() -> None:
        node = NodeServer(cfg, storage_probe_s=0.05)
        with caplog.at_level(logging.INFO, logger="hicache.service"):
            await node.start()
            try:
                assert node.cache is not None
                up = lambda: node.cache.metrics.registry.get_sample_value("hicache_storage_up")  # noqa: E731
                assert up() == 0 and node.storage_up is False
                await asyncio.sleep(0.2)
                assert up() == 0
                blocker.unlink()  # now the store's folder can be made
                for _ in range(100):
                    if up() == 1:
                        break
                    await asyncio.sleep(0.02)
                assert up() == 1 and node.storage_up is True
            finally:
                await node.stop()
        text = caplog.text
        assert text.count("does not answer") == 1 and text.count("answers again") == 1

    asyncio.run(main())


def test_concurrency_limit_metrics_health_reflection(server_factory: Callable[..., ServerProc]) -> None:
    srv = server_factory(serve={"max_concurrency": 1})
    toks = np.arange(4 * PS, dtype=np.uint32)
    with HiCacheClient(srv.target) as c:
        assert c.match(toks, peek=True).num_pages == 4
        events = c.watch_events()
        next(iter(events))  # an event subscription is not counted against the bound ...
        assert c.match(toks, peek=True).num_pages == 4
        stream = c.match_stream()
        assert stream.match(toks, peek=True).num_pages == 4  # ... nor is an idle match stream (its messages are)
        assert c.match(toks, peek=True).num_pages == 4
        hold = threading.Event()

        def header_then_wait() -> Iterator[pb.WritePagesChunk]:
            yield pb.WritePagesChunk(header=pb.WritePagesHeader(tokens=toks.tobytes()))
            hold.wait(10)

        writing = pb_grpc.HiCacheStub(c.channel).WritePages.future(header_then_wait(), timeout=10)
        deadline = time.monotonic() + 5
        while True:  # a WritePages waiting for its pages' bytes is one RPC in flight
            try:
                c.match(toks, peek=True)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "max_concurrency" in e.details()
                break
            assert time.monotonic() < deadline, "the waiting WritePages never took the one slot"
            time.sleep(0.02)
        with pytest.raises(CallError) as si:  # and a stream's message finds no room either, the stream goes on
            stream.match(toks, peek=True)
        assert si.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        hold.set()
        writing.cancel()
        stream.close()
        events.close()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while True:  # the server notices the cancelled stream shortly after
            try:
                c.stats()
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)
        health = health_pb2_grpc.HealthStub(c.channel)
        for service in ("", "hicache.v1.HiCache"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(c.channel)
        services = set(db.get_services())
        assert {"hicache.v1.HiCache", "grpc.health.v1.Health"} <= services
        methods = {m.name for m in db.FindFileContainingSymbol("hicache.v1.HiCache").service[0].method}
        assert {"Match", "MatchStream", "Prefetch", "Allocate", "Commit", "Release", "Stats", "WatchEvents",
                "GetPoolInfo", "Attach", "ReadPages", "WritePages"} <= methods
        # like grpcurl: no generated code, only what reflection serves, JSON in and out
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName("hicache.v1.HiCache").FindMethodByName("Match")
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        match = c.channel.unary_unary("/hicache.v1.HiCache/Match", request_serializer=req_cls.SerializeToString,
                                      response_deserializer=resp_cls.FromString)
        body = json_format.Parse(json.dumps({"token_ids": toks.tolist(), "peek": True}), req_cls())
        reply = json_format.MessageToDict(match(body, timeout=5))
        assert reply["numPages"] == 4 and reply.get("l1Pages", 0) == 0 and reply["pageSize"] == PS  # 0: omitted
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
    assert 'hicache_rpc_seconds_bucket{le="0.001",method="Match"}' in text
    assert 'hicache_rpcs_total{code="RESOURCE_EXHAUSTED",method="Match"}' not in text  # refused before a handler
    rejected = [float(line.split()[1]) for line in text.splitlines() if line.startswith("hicache_rpc_rejected_total")]
    assert rejected and rejected[0] >= 1
    assert 'hicache_hit_tokens_total{tier="l1"}' in text and "hicache_lookup_tokens_total" in text
    assert "hicache_rpc_inflight" in text and "hicache_event_queue_depth" in text


def test_client_retries_unavailable_with_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    import hicache.client.sync as client_sync

    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    pauses: list[float] = []
    real_sleep = time.sleep

    def recording_sleep(s: float) -> None:
        pauses.append(s)
        real_sleep(s)

    monkeypatch.setattr(client_sync.time, "sleep", recording_sleep)
    # attempts=1: one try, no backoff; base_s=2.0 so that any backoff sleep would take >= 1 s
    # attempts=3: three tries, two jittered backoffs of base_s * 2**i * [0.5, 1]
    for attempts, base_s in ((1, 2.0), (3, 0.05)):
        pauses.clear()
        with HiCacheClient(target, retry=RetryPolicy(attempts=attempts, base_s=base_s), timeout_s=5) as c:
            calls = 0
            stats = c.stub.Stats

            def counting(*args: object, _stats: object = stats, **kw: object) -> object:
                nonlocal calls
                calls += 1
                return _stats(*args, **kw)  # type: ignore[operator]

            c.stub.Stats = counting  # type: ignore[method-assign]
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as ei:
                c.stats()
            elapsed = time.monotonic() - t0
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
            assert calls == attempts, (attempts, calls)
            assert len(pauses) == attempts - 1, pauses
            for i, p in enumerate(pauses):
                assert base_s * 2**i * 0.5 <= p <= base_s * 2**i, (i, p)
            if attempts == 1:
                assert elapsed < base_s * 0.5, elapsed  # failed at once: no backoff sleep
            else:
                assert elapsed >= sum(pauses) >= 0.05 * 0.5 + 0.1 * 0.5
                assert elapsed < 4.0, elapsed  # well inside the 5 s budget


def test_client_retry_reaches_a_server_that_comes_up(tmp_path: Path) -> None:
    from .service_harness import start_server

    port = free_port()
    result: list[object] = []

    def call() -> None:
        with HiCacheClient(f"127.0.0.1:{port}", retry=RetryPolicy(attempts=60, base_s=0.2, max_s=0.5),
                           timeout_s=60) as c:
            result.append(c.pool_info().num_pages)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)
    srv = start_server(tmp_path, serve={"port": port})
    try:
        t.join(60)
        assert result and int(result[0]) > 0  # type: ignore[call-overload]
    finally:
        srv.terminate()
