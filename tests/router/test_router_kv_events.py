"""The router follows vLLM / SGLang engines through their own ZeroMQ KV events (``router.kv_events``).

The publisher here speaks the engines' wire format (``[topic, sequence, msgpack batch]`` on PUB, the replay
protocol on a ROUTER socket), so the router under test reads what an engine sends: block hashes of the
engine's own, parents, token ids and media. The router must key the blocks as the nodes key pages (a
request's keys then match the engine's cached prefix), keep tiers apart by medium, refuse what it cannot
key, fill gaps from the replay buffer, count what stays lost, and forget an engine that restarted."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.server
import re
import threading
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from prometheus_client import generate_latest
from router_helpers import PS, node_config, tokens

from hicache.config import ConfigError
from hicache.keys import page_keys
from hicache.router import Router
from hicache.router.client import AsyncRouterClient
from hicache.router.config import NodeSpec, RouterConfig, load_router_config
from hicache.router.kv_events import Cleared, EngineEventError, Malformed, Removed, Stored, decode_batch
from hicache.router.server import RouterServer


def block_hash(parent: bytes | None, toks: np.ndarray) -> bytes:
    """An engine's own block hash (not hicache's key): what vLLM's sha256 hashing looks like on the wire."""
    return hashlib.sha256((parent or b"root") + toks.astype("<u4").tobytes()).digest()


def stored(toks: np.ndarray, first: int = 0, parent: bytes | None = None, *, medium: str | None = "GPU",
           lora: int | None = None, block_size: int = PS, hashes: list[Any] | None = None) -> tuple[list[Any], bytes]:
    """A BlockStored event for pages [first, end) of ``toks`` and the last block's hash."""
    hs, p = [], parent
    for i in range(first, len(toks) // PS):
        p = block_hash(p, toks[i * PS:(i + 1) * PS])
        hs.append(p)
    ev = ["BlockStored", hashes or hs, parent, [int(t) for t in toks[first * PS:]], block_size, lora, medium]
    return ev, hs[-1]


def chain(toks: np.ndarray) -> list[bytes]:
    hs, p = [], None
    for i in range(len(toks) // PS):
        p = block_hash(p, toks[i * PS:(i + 1) * PS])
        hs.append(p)
    return hs


def batch(*events: list[Any]) -> bytes:
    return msgpack.packb([1.0, list(events)], use_bin_type=True)


def new_router(*engines: str) -> Router:
    rc = RouterConfig(nodes=[NodeSpec(n, f"127.0.0.1:{8000 + i}") for i, n in enumerate(engines)],
                      kv_events={n: f"tcp://127.0.0.1:{5557 + i}" for i, n in enumerate(engines)})
    return Router(node_config(), rc)


def prefix(r: Router, toks: np.ndarray) -> dict[str, tuple[int, int]]:
    d = r.route(toks.astype("<u4").tobytes(), peek=True)
    return {n: (s.l1_pages, s.l2_pages) for n, s in d.scores.items()}


# ---------------------------------------------------------------------------------------------- decoding
def test_batches_decode_as_the_engines_encode_them() -> None:
    toks = tokens(1, 2)
    ev, _ = stored(toks)
    b = decode_batch(msgpack.packb([2.5, [ev, ["BlockRemoved", [7, 8], "CPU"], ["AllBlocksCleared"],
                                          ["SomethingNewer", 1]], 3], use_bin_type=True))
    assert b.ts == 2.5 and b.dp_rank == 3
    st, rm, cl, unknown = b.events
    assert isinstance(st, Stored) and st.tokens.tolist() == toks.tolist() and st.block_size == PS
    assert st.tokens.dtype == np.dtype("<u4")
    assert st.medium == "GPU" and st.lora_id is None and st.parent is None
    assert rm == Removed([7, 8], "CPU") and cl == Cleared() and unknown is None
    short = decode_batch(msgpack.packb([1, [["BlockStored", [1], None, [5] * PS, PS]]]))  # trailing fields omitted
    (ev0,) = short.events
    assert isinstance(ev0, Stored) and ev0.tokens.tolist() == [5] * PS and short.dp_rank is None
    assert (ev0.hashes, ev0.parent, ev0.block_size, ev0.lora_id, ev0.medium) == ([1], None, PS, None, None)
    for bad in (b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb(["x", []])):
        with pytest.raises(EngineEventError):
            decode_batch(bad)
    # an event that cannot be read stands as Malformed; the rest of its batch still applies
    bad_ids = ([-1] * PS, [1.5] * PS, [2**40] * PS, [True] * PS, ["a"] * PS, [[1]] * PS)
    mixed = decode_batch(msgpack.packb([1, [["BlockStored", [1], None], [3], *(
        ["BlockStored", [1], None, ids, PS] for ids in bad_ids), ["BlockRemoved", [1]]]]))
    assert [type(e).__name__ for e in mixed.events] == ["Malformed"] * (2 + len(bad_ids)) + ["Removed"]
    assert all(isinstance(e, Malformed) and e.why for e in mixed.events[:-1])


# ---------------------------------------------------------------------------------------------- indexing
def test_stored_blocks_are_keyed_as_the_nodes_key_pages() -> None:
    r = new_router("e0", "e1")
    toks = tokens(1, 6)
    head, last = stored(toks[: 3 * PS])
    r.engines["e0"].apply(decode_batch(batch(head)))
    tail, _ = stored(toks, 3, last)  # the next blocks, continuing the engine's chain
    r.engines["e0"].apply(decode_batch(batch(tail)))
    assert set(r.index.feed("e0").pages) == set(page_keys(r.ns, toks))
    assert prefix(r, toks) == {"e0": (6, 0), "e1": (0, 0)}
    assert r.route(toks.astype("<u4").tobytes()).node == "e0"
    other = tokens(2, 4)
    assert prefix(r, other)["e0"] == (0, 0)


def test_media_removals_and_clears() -> None:
    r = new_router("e0")
    eb = r.engines["e0"]
    toks = tokens(3, 4)
    hs = chain(toks)
    eb.apply(decode_batch(batch(stored(toks)[0], stored(toks, medium="CPU")[0])))  # offloaded copies too
    assert prefix(r, toks)["e0"] == (4, 0)
    eb.apply(decode_batch(batch(["BlockRemoved", hs[2:], "GPU"])))  # evicted from the GPU, still on the CPU
    assert prefix(r, toks)["e0"] == (2, 2)
    eb.apply(decode_batch(batch(["BlockRemoved", hs[3:], "CPU"])))
    assert prefix(r, toks)["e0"] == (2, 1)
    eb.apply(decode_batch(batch(["BlockRemoved", [b"never stored"], None])))  # unknown: nothing happens
    eb.apply(decode_batch(batch(["BlockRemoved", hs[:1], "DISK"])))  # a medium the block is not on: nothing
    assert prefix(r, toks)["e0"] == (2, 1)
    eb.apply(decode_batch(batch(stored(toks, medium="DISK")[0], ["BlockRemoved", hs, "CPU"])))
    assert prefix(r, toks)["e0"] == (2, 2)  # still on the disk: L2 stays with the last offloaded copy
    eb.apply(decode_batch(batch(["AllBlocksCleared"])))
    assert prefix(r, toks)["e0"] == (0, 0) and not r.index.feed("e0").pages and not eb.blocks


def test_every_tenant_matches_an_engines_cache() -> None:
    r = new_router("e0")
    toks = tokens(6, 3)
    r.engines["e0"].apply(decode_batch(batch(stored(toks)[0])))
    for tenant in ("", "acme"):
        d = r.route(toks.astype("<u4").tobytes(), tenant=tenant, peek=True)
        assert (d.node, d.l1_pages) == ("e0", 3), tenant


def test_two_engine_hashes_of_one_page_hold_it_until_both_go() -> None:
    r = new_router("e0")
    eb = r.engines["e0"]
    toks = tokens(4, 2)
    salted = [b"salt-a", b"salt-b"]
    eb.apply(decode_batch(batch(stored(toks)[0], stored(toks, hashes=salted)[0])))
    eb.apply(decode_batch(batch(["BlockRemoved", chain(toks), "GPU"])))
    assert prefix(r, toks)["e0"] == (2, 0)  # the salted blocks still hold the same pages
    eb.apply(decode_batch(batch(["BlockRemoved", salted, "GPU"])))
    assert prefix(r, toks)["e0"] == (0, 0)


def test_blocks_the_router_cannot_key_are_refused_and_counted() -> None:
    r = new_router("e0")
    eb = r.engines["e0"]
    toks = tokens(5, 2)
    eb.apply(decode_batch(batch(
        stored(toks, lora=3)[0],  # under a LoRA adapter
        ["BlockStored", [b"x"], None, [1] * (2 * PS), 2 * PS, None, "GPU"],  # another block size
        stored(toks, 1, parent=b"never seen")[0],  # a parent the router never saw
        ["BlockStored", [b"y", b"z"], None, [1] * PS, PS, None, "GPU"])))  # tokens for one block, two hashes
    assert eb.refused == {"lora": 2, "block_size": 1, "orphan": 1, "malformed": 2}
    assert not r.index.feed("e0").pages


# ---------------------------------------------------------------------------------------------- over ZeroMQ
class Publisher:
    """An engine's KV-event publisher: XPUB (a PUB that sees subscriptions) and the replay ROUTER."""

    def __init__(self, ctx: zmq.asyncio.Context, ports: tuple[int, int] | None = None) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.replay = ctx.socket(zmq.ROUTER)
        if ports is None:
            self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        else:  # an engine restarted on its old ports
            self.port, self.replay_port = ports
            self.pub.bind(f"tcp://127.0.0.1:{self.port}")
            self.replay.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self._task = asyncio.create_task(self._serve_replay())

    async def subscribed(self) -> None:
        msg = await asyncio.wait_for(self.pub.recv(), 10)
        assert msg[:1] == b"\x01"

    async def publish(self, payload: bytes, *, send: bool = True, keep: bool = True) -> int:
        seq, self.seq = self.seq, self.seq + 1
        if keep:
            self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        return seq

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.replay.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._task.cancel()
        self.pub.close(0)
        self.replay.close(0)


async def until(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def metric(text: str, name: str, **labels: str) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}\{{{sel}\}} (\S+)$", text, re.M)
    assert m is not None, f"{name}{{{sel}}} missing"
    return float(m[1])


class Engines:
    """Publishers of engines' KV events and routers following them, torn down together."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pubs: list[Publisher] = []

    def publisher(self, ports: tuple[int, int] | None = None) -> Publisher:
        p = Publisher(self.ctx, ports)
        self.pubs.append(p)
        return p

    def silent_endpoint(self) -> str:
        """A replay endpoint that takes requests and never answers."""
        sock = self.ctx.socket(zmq.ROUTER)
        return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"

    @contextlib.asynccontextmanager
    async def router(self, engines: dict[str, Publisher], replay: dict[str, str],
                     addresses: dict[str, str] | None = None, **kw: Any) -> AsyncIterator[RouterServer]:
        """A router following ``engines``; their node addresses are ``addresses`` (default: closed ports, and
        their load is not read)."""
        if addresses is None:
            kw.setdefault("engine_metrics_path", "")
        where = addresses or {}
        rc = RouterConfig(port=0, nodes=[NodeSpec(n, where.get(n, f"127.0.0.1:{8000 + i}"))
                                         for i, n in enumerate(engines)],
                          kv_events={n: f"tcp://127.0.0.1:{p.port}" for n, p in engines.items()},
                          kv_events_replay=replay, **kw)
        router = RouterServer(node_config(), rc)
        await router.start()
        try:
            yield router
        finally:
            await router.stop(0.1)

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.pubs:
            p.close()
        self.ctx.destroy(0)


def replay_of(p: Publisher) -> str:
    return f"tcp://127.0.0.1:{p.replay_port}"


def test_a_router_follows_engines_over_zeromq() -> None:
    async def main() -> None:
        with Engines() as env:
            e0, e1 = env.publisher(), env.publisher()
            async with env.router({"e0": e0, "e1": e1}, {"e0": replay_of(e0)}) as router:
                r = router.router
                # blocks e0 stored before the router subscribed come back through the replay buffer
                a, b = tokens(10, 4), tokens(11, 3)
                await e0.publish(batch(stored(a)[0]), send=False)
                await e0.subscribed()
                await e1.subscribed()
                await e0.publish(batch(stored(b)[0]))
                await until(lambda: prefix(r, a)["e0"] == (4, 0) and prefix(r, b)["e0"] == (3, 0), "e0's blocks")
                async with AsyncRouterClient(f"127.0.0.1:{router.port}") as client:
                    d = await client.route(a)
                    assert d.node == "e0" and d.l1_pages == 4
                    await client.complete(d.route_id)

                # a batch lost on the wire is replayed from the buffer before the next one applies
                c = tokens(12, 2)
                await e0.publish(batch(["BlockRemoved", chain(b), "GPU"]), send=False)
                await e0.publish(batch(stored(c)[0]))
                await until(lambda: prefix(r, c)["e0"] == (2, 0), "the batch after the gap")
                assert prefix(r, b)["e0"] == (0, 0)

                # e1 has no replay endpoint: its gap stays, counted, and what was known is kept
                await e1.publish(batch(stored(a)[0]))
                await until(lambda: prefix(r, a)["e1"] == (4, 0), "e1's blocks")
                await e1.publish(batch(["AllBlocksCleared"]), send=False)
                await e1.publish(batch(stored(c)[0]))
                await until(lambda: prefix(r, c)["e1"] == (2, 0), "e1 after its gap")
                assert prefix(r, a)["e1"] == (4, 0)

                # e1 restarts: its sequence starts over and what the router knew of it is forgotten
                e1.seq, e1.buffer = 0, []
                await e1.publish(batch(stored(b)[0]))
                await until(lambda: prefix(r, b)["e1"] == (3, 0), "e1's new run")
                assert prefix(r, a)["e1"] == (0, 0) and prefix(r, c)["e1"] == (0, 0)

                views = {v.name: v for v in r.views()}
                assert views["e0"].connected and views["e1"].connected and views["e1"].event_sequence == 0
                text = generate_latest(router.registry).decode()
                # the first batch received caught up from 0 through the replay as well; that is no gap
                assert metric(text, "hicache_router_engine_gaps_total", node="e0", outcome="replayed") == 1.0
                assert metric(text, "hicache_router_engine_gaps_total", node="e1", outcome="lost") == 1.0
                assert metric(text, "hicache_router_engine_restarts_total", node="e1") == 1.0
                assert metric(text, "hicache_router_engine_batches_total", node="e0") == 4.0
                assert metric(text, "hicache_router_engine_blocks_refused_total", node="e0", reason="orphan") == 0.0
                assert metric(text, "hicache_router_node_connected", node="e0") == 1.0

    asyncio.run(main())


def test_bad_engine_settings_are_refused() -> None:
    nodes = ["e0=127.0.0.1:8000"]
    cases = [({"kv_events": {"nope": "tcp://127.0.0.1:5557"}}, "'nope' is not a node"),
             ({"kv_events": {"e0": "http://127.0.0.1:5557"}}, "not a ZeroMQ endpoint to connect to"),
             ({"kv_events": {"e0": "tcp://*:5557"}}, "'*' binds on the engine's side"),
             ({"kv_events": {"e0": "tcp://10.0.0.1:70000"}}, "port must be in 1-65535"),
             ({"kv_events": {"e0": "tcp://127.0.0.1:5557"}, "kv_events_replay": {"e0": "tcp://h:1", "x": "tcp://h:2"}},
              "not a node"),
             ({"kv_events": {"e0": "tcp://127.0.0.1:5557"}, "index": "approximate"}, "use router.index: events")]
    for extra, msg in cases:
        with pytest.raises(ConfigError, match=re.escape(msg)):
            load_router_config(None, env={}, overrides={"router": {"nodes": nodes, **extra}})
    rc = load_router_config(None, env={"HICACHE_ROUTER__KV_EVENTS": "{e0: 'tcp://10.0.0.1:5557'}"},
                            overrides={"router": {"nodes": nodes}})[1]
    assert rc.kv_events == {"e0": "tcp://10.0.0.1:5557"}


def test_the_cli_names_a_bad_kv_events_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.cli import main

    assert main(["route", "--node", "e0=127.0.0.1:8000", "--kv-events", "tcp://127.0.0.1:5557"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hicache route: --kv-events:") and "NAME=ENDPOINT" in err[0]


def test_a_late_router_catches_up_from_the_oldest_batch_still_buffered() -> None:
    async def main() -> None:
        with Engines() as env:
            e0 = env.publisher()
            async with env.router({"e0": e0}, {"e0": replay_of(e0)}) as router:
                r = router.router
                a, b, c = tokens(20, 2), tokens(21, 3), tokens(22, 2)
                await e0.publish(batch(stored(a)[0]), send=False, keep=False)  # gone from the publisher's buffer
                await e0.publish(batch(stored(b)[0]), send=False)  # still buffered
                await e0.subscribed()
                await e0.publish(batch(stored(c)[0]))
                await until(lambda: prefix(r, c)["e0"] == (2, 0), "the batch received")
                assert prefix(r, b)["e0"] == (3, 0) and prefix(r, a)["e0"] == (0, 0)
                eb = r.engines["e0"]
                assert eb.batches == 2 and eb.gaps == {"replayed": 0, "lost": 0}

    asyncio.run(main())


def test_an_engine_that_goes_away_is_disconnected_and_forgotten() -> None:
    """Connected while the publisher's link is up, even idle; when it drops the engine's blocks go, since a
    restarted engine may come back with a higher sequence than its old run reached and never remove them."""

    async def main() -> None:
        with Engines() as env:
            e0 = env.publisher()
            async with env.router({"e0": e0}, {"e0": replay_of(e0)}) as router:
                r = router.router
                await e0.subscribed()
                await until(lambda: r.nodes["e0"].connected, "an idle engine to count as connected")
                a, b = tokens(30, 3), tokens(31, 2)
                for _ in range(3):
                    await e0.publish(batch(stored(a)[0]))
                await until(lambda: prefix(r, a)["e0"] == (3, 0), "the first run's blocks")
                e0.close()  # the engine stops
                await until(lambda: not r.nodes["e0"].connected, "the link to drop")
                assert prefix(r, a)["e0"] == (0, 0) and r.engines["e0"].restarts == 1
                e0 = env.publisher((e0.port, e0.replay_port))  # back, its sequence past the old run's
                e0.seq = 10
                await e0.subscribed()
                await e0.publish(batch(stored(b)[0]))
                await until(lambda: prefix(r, b)["e0"] == (2, 0), "the new run's blocks")
                assert r.nodes["e0"].connected and prefix(r, a)["e0"] == (0, 0)
                assert r.engines["e0"].gaps == {"replayed": 0, "lost": 0}

    asyncio.run(main())


def test_an_unreadable_batch_is_a_lost_gap_and_a_silent_replay_endpoint_is_left_alone() -> None:
    async def main() -> None:
        with Engines() as env:
            e0 = env.publisher()
            async with env.router({"e0": e0}, {"e0": env.silent_endpoint()}) as router:
                r = router.router
                eb = r.engines["e0"]
                await e0.subscribed()
                a = tokens(40, 2)
                await e0.publish(batch(stored(a)[0]))
                await until(lambda: eb.batches == 1, "the first batch")
                await e0.publish(b"not msgpack \xc1")
                await until(lambda: eb.gaps["lost"] == 1, "the unreadable batch")
                assert eb.refused["malformed"] == 1 and prefix(r, a)["e0"] == (2, 0)
                loop = asyncio.get_running_loop()
                await e0.publish(b"", send=False)  # a gap: the replay endpoint does not answer
                t0 = loop.time()
                await e0.publish(batch(["BlockRemoved", chain(a), "GPU"]))
                await until(lambda: eb.gaps["lost"] == 2, "the first gap")
                await e0.publish(b"", send=False)  # another gap: the endpoint is left alone, no wait
                t1 = loop.time()
                await e0.publish(batch(stored(a)[0]))
                await until(lambda: eb.gaps["lost"] == 3, "the second gap")
                assert loop.time() - t1 < 0.9 <= t1 - t0 and prefix(r, a)["e0"] == (2, 0)  # no second 1 s wait

    asyncio.run(main())


class MetricsPage:
    """An engine's HTTP server, as far as its Prometheus page goes: ``body`` at /metrics, 404 elsewhere."""

    def __init__(self, body: str, status: int = 200) -> None:
        page = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = page.body.encode()
                self.send_response(status if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.body = body
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


VLLM_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""
SGLANG_METRICS = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 2.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 7.0
"""


def test_an_engines_load_is_read_from_its_metrics_page() -> None:
    """Running + waiting requests become the node's queue depth: a busy engine holding the prefix loses the
    request to an idle one once the load outweighs the prefix; a page that is not there stops the polls
    (the breaker stays closed); an engine that cannot be reached feeds its breaker."""

    async def main() -> None:
        busy, idle = MetricsPage(VLLM_METRICS), MetricsPage(SGLANG_METRICS)
        missing, garbled = MetricsPage("not found", 404), MetricsPage("vllm:num_requests_running{ 3")
        pages = (busy, idle, missing, garbled)
        try:
            with Engines() as env:
                pubs = {f"e{i}": env.publisher() for i in range(5)}
                e0 = pubs["e0"]
                addresses = {"e0": busy.address, "e1": idle.address, "e2": missing.address, "e3": "127.0.0.1:9",
                             "e4": garbled.address}
                async with env.router(pubs, {}, addresses, stats_interval_s=0.05, breaker_failures=2,
                                      balance_abs_threshold=20.0) as router:
                    r = router.router
                    await until(lambda: r.nodes["e0"].queue.value == 8 and r.nodes["e1"].queue.value == 9,
                                "both engines' load")
                    await until(lambda: r.nodes["e3"].breaker.state == "open", "the unreachable engine's breaker")
                    await asyncio.sleep(0.2)
                    for n in ("e2", "e4"):  # they answered: not the engine's failure, its load just unknown
                        assert r.nodes[n].breaker.state == "closed" and r.nodes[n].queue.value == 0, n
                    views = {v.name: v for v in r.views()}
                    assert (views["e0"].queue_depth, views["e1"].queue_depth) == (8, 9)
                    await e0.subscribed()
                    toks = tokens(50, 4)
                    await e0.publish(batch(stored(toks)[0]))
                    await until(lambda: prefix(r, toks)["e0"] == (4, 0), "e0's blocks")
                    d = r.route(toks.astype("<u4").tobytes(), peek=True)
                    assert d.node == "e0"  # 8 open requests do not outweigh a whole cached prompt...
                    busy.body = VLLM_METRICS.replace(" 5.0", " 50.0")
                    await until(lambda: r.nodes["e0"].queue.value == 53, "e0 busier")
                    d = r.route(toks.astype("<u4").tobytes(), peek=True)
                    assert d.node in ("e2", "e4"), d  # ... 53 do: an idle engine costs less
        finally:
            for page in pages:
                page.close()

    asyncio.run(main())
