"""The approximate index (``router.index: approximate``): routes teach the router where prefixes are,
predictions expire, stay within capacity, stay prefix-closed, and die with the node's breaker; with real
node services the router's prediction equals what the node then matches, and no stream is ever opened."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from router_helpers import PS, Clock, event, node_config, router_config, tokens
from test_router_integration import serve_on, start_nodes

from hicache.cli import main as cli_main
from hicache.config import ConfigError
from hicache.keys import page_keys
from hicache.router import Router
from hicache.router.approx import ApproxIndex
from hicache.router.client import AsyncRouterClient
from hicache.router.config import NodeSpec, RouterConfig, load_router_config
from hicache.router.index import KVIndex
from hicache.router.server import RouterServer

DOC = 6  # pages of a document


def approx_router(nodes: list[str], clock: Clock | None = None, **kw: object) -> Router:
    r = Router(node_config(), router_config(nodes, index="approximate", **kw))  # type: ignore[arg-type]
    assert r.approx is not None
    if clock is not None:
        r.approx.clock = clock
    return r


def ask(doc: int, q: int, q_pages: int = 2) -> bytes:
    return np.concatenate([tokens(doc, DOC), tokens(10_000 + q, q_pages)]).astype("<u4").tobytes()


def test_a_route_teaches_the_router_where_the_prefix_is() -> None:
    r = approx_router(["a", "b", "c"])
    first = r.route(ask(1, 0))
    assert (first.reason, first.l1_pages) == ("balance", 0)
    r.complete(first.route_id)
    again = r.route(ask(1, 1))
    assert (again.node, again.reason, again.l1_pages) == (first.node, "prefix", DOC)
    r.complete(again.route_id)
    # another document goes elsewhere while the first node is no emptier than the rest
    other = r.route(ask(2, 0))
    assert other.l1_pages == 0
    assert r.approx is not None
    r.approx.check()
    assert r.views()[["a", "b", "c"].index(first.node)].l1_pages == DOC + 2 + 2  # doc + both questions


def test_a_peek_predicts_nothing() -> None:
    r = approx_router(["a", "b"])
    d = r.route(ask(1, 0), peek=True)
    assert d.route_id == "" and len(r.index) == 0
    assert r.route(ask(1, 1), peek=True).l1_pages == 0


def test_predictions_expire_after_the_ttl() -> None:
    clock = Clock()
    r = approx_router(["a", "b"], clock, approx_ttl_s=30.0)
    d = r.route(ask(1, 0))
    clock.t += 20
    assert r.route(ask(1, 1), peek=True).l1_pages == DOC  # still predicted
    r.route(ask(1, 2))  # touches the document again: its TTL restarts, the first question's does not
    clock.t += 20
    assert r.route(ask(1, 3), peek=True).l1_pages == DOC
    assert r.route(ask(1, 0), peek=True).l1_pages == DOC  # the first question's own pages are gone
    clock.t += 31
    assert r.route(ask(1, 4), peek=True).l1_pages == 0
    assert len(r.index) == 0
    assert r.approx is not None and r.approx.expired == DOC + 2 + 2
    r.complete(d.route_id)


def test_capacity_cuts_the_least_recently_routed_tails_first() -> None:
    r = approx_router(["a"], approx_capacity_tokens=(DOC + 4) * PS)
    r.route(ask(1, 0))  # 8 pages
    r.route(ask(1, 1))  # 10: the doc and two questions
    assert r.approx is not None and r.approx.pages("a") == DOC + 4
    r.route(ask(2, 0))  # 8 new pages: the oldest tails go, then the first document from its end
    r.approx.check()
    assert r.approx.pages("a") == DOC + 4
    assert r.route(ask(2, 5), peek=True).l1_pages == DOC
    assert r.route(ask(1, 5), peek=True).l1_pages == 2  # what is left of document 1 is its first pages


def test_an_open_breaker_forgets_the_node() -> None:
    r = approx_router(["a", "b"], breaker_failures=2)
    d = r.route(ask(1, 0))
    r.complete(d.route_id, grpc.StatusCode.OK)
    for q in (1, 2):
        e = r.route(ask(1, q))
        assert e.node == d.node
        r.complete(e.route_id, grpc.StatusCode.UNAVAILABLE)
    assert r.approx is not None and r.approx.pages(d.node) == 0
    assert r.approx.dropped > 0
    peek = r.route(ask(1, 3), peek=True)
    assert peek.node != d.node and peek.l1_pages == 0
    # a client error is not the node's failure: nothing is forgotten
    ok = r.route(ask(3, 0))
    r.complete(ok.route_id, grpc.StatusCode.INVALID_ARGUMENT)
    r.record(ok.node, grpc.StatusCode.INVALID_ARGUMENT)
    assert r.route(ask(3, 1), peek=True).l1_pages == DOC


def test_events_are_refused_with_the_approximate_index() -> None:
    r = approx_router(["a"])
    with pytest.raises(RuntimeError, match="approximate"):
        r.apply_event("a", event(1, "snapshot", []))


def test_config_refuses_bad_approximate_settings(tmp_path: object) -> None:
    with pytest.raises(ConfigError, match=r"router\.index"):
        RouterConfig(index="guess")
    with pytest.raises(ConfigError, match=r"router\.approx_ttl_s"):
        RouterConfig(approx_ttl_s=0.0)
    with pytest.raises(ConfigError, match=r"router\.approx_ttl_s"):
        RouterConfig(approx_ttl_s=float("inf"))
    with pytest.raises(ConfigError, match=r"router\.approx_capacity_tokens"):
        RouterConfig(approx_capacity_tokens=0)
    with pytest.raises(ConfigError, match="holds no page"):
        load_router_config(None, env={}, overrides={"router": {"index": "approximate",
                                                               "approx_capacity_tokens": 63}})
    # with the event index the field is not used, so any positive value passes
    load_router_config(None, env={}, overrides={"router": {"approx_capacity_tokens": 63}})


def test_cli_refuses_a_capacity_below_one_page(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in __import__("os").environ if v.startswith("HICACHE_")]:
        monkeypatch.delenv(var)
    code = cli_main(["route", "--port", "0", "--node", "a=127.0.0.1:1", "--index", "approximate",
                     "--approx-capacity-tokens", "8"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "router.approx_capacity_tokens" in err[0] and "page_size" in err[0]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["route", "tick", "drop"]), st.integers(0, 5), st.integers(0, 3),
                          st.integers(0, 4)), max_size=40),
       st.integers(1, 30), st.sampled_from([1.0, 5.0, 50.0]))
def test_predictions_stay_prefix_closed(ops: list[tuple[str, int, int, int]], cap: int, ttl: float) -> None:
    """Whatever the order of routes, expiries, evictions and drops, every predicted page's parent is
    predicted on the same node (a prediction is always a prefix), and the index mirrors the prediction."""
    clock = Clock()
    index = KVIndex(PS)
    ax = ApproxIndex(index, ttl, cap, clock)
    ns = node_config().namespace()
    parent: dict[bytes, bytes | None] = {}
    docs = [tokens(d, 4) for d in range(3)]
    for op, a, b, c in ops:
        node = "ab"[a % 2]
        if op == "route":
            toks = np.concatenate([docs[a % 3], tokens(100 + b, c)])
            keys = page_keys(ns, toks)
            for i, k in enumerate(keys):
                parent[k] = keys[i - 1] if i else None
            ax.record(node, keys)
        elif op == "tick":
            clock.t += b * ttl / 2
            ax.expire()
        else:
            ax.drop(node)
        ax.check()
        for n in "ab":
            held = index.feed(n).pages
            for k in held:
                p = parent[k]
                assert p is None or p in held, "a predicted page whose parent is not predicted"


def test_approximate_router_over_real_nodes() -> None:
    """Two real nodes, no event stream: the router's predicted prefix is what the node then matches, the
    nodes see no subscriber, and a node address where nothing listens still takes routes."""

    async def main() -> None:
        nodes = await start_nodes(2)
        from hicache.client import AsyncHiCacheClient
        clients = {f"n{i}": AsyncHiCacheClient(f"127.0.0.1:{n.port}") for i, n in enumerate(nodes)}
        specs = [NodeSpec(f"n{i}", f"127.0.0.1:{n.port}") for i, n in enumerate(nodes)]
        rc_cfg = RouterConfig(port=0, nodes=specs, index="approximate", metrics_port=0)
        router = RouterServer(node_config(), rc_cfg)
        await router.start()
        await router.wait_synced(0.1)  # returns at once: nothing to sync
        rc = AsyncRouterClient(f"127.0.0.1:{router.port}")
        try:
            assert router.feeds == []
            docs = [tokens(40 + i, DOC) for i in range(4)]
            home: dict[int, str] = {}
            for k in range(16):
                i = k % 4
                q = np.concatenate([docs[i], tokens(600 + k, 2)])
                d = await rc.route(q)
                hit = await serve_on(clients[d.node], q, f"r{k}")
                assert hit == d.l1_pages, (k, d.node, d.l1_pages, hit)  # the prediction was right
                assert d.l1_pages == (DOC if i in home else 0)
                if i in home:
                    assert d.node == home[i]
                home.setdefault(i, d.node)
                await rc.complete(d.route_id)
            assert sorted(set(home.values())) == ["n0", "n1"]
            listed = await rc.list_nodes()
            assert listed.index == "approximate"
            assert all(not n.connected and n.l1_pages >= DOC for n in listed.nodes)
            for node in nodes:  # no router ever subscribed to the node's events
                assert node.hub is not None and node.hub.subscribers == 0
            text = generate_latest(router.registry).decode()
            assert "hicache_router_node_connected{" not in text  # no stream, so nothing to alert on
            assert 'hicache_router_breaker_open{node="n0"} 0.0' in text
            assert "hicache_router_index_keys " in text
            for reason in ("ttl", "capacity", "node_down", "withdrawn"):  # every series there from the start
                assert f'hicache_router_approx_forgotten_pages_total{{reason="{reason}"}} 0.0' in text
        finally:
            await rc.close()
            await router.stop()
            for c in clients.values():
                await c.close()
            for n in nodes:
                await n.stop(0.1)

    asyncio.run(main())


def test_a_node_nobody_listens_on_still_takes_routes() -> None:
    """The approximate router never dials its nodes: one that is down costs nothing until a client reports
    the failure (Complete with UNAVAILABLE opens its breaker, and its predicted pages go)."""

    async def main() -> None:
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
        s.close()
        rc_cfg = RouterConfig(port=0, nodes=[NodeSpec("gone", f"127.0.0.1:{dead}")], index="approximate",
                              breaker_failures=1)
        router = RouterServer(node_config(), rc_cfg)
        await router.start()
        rc = AsyncRouterClient(f"127.0.0.1:{router.port}")
        try:
            d = await rc.route(tokens(1, 4))
            assert d.node == "gone"
            assert (await rc.route(tokens(1, 4), peek=True)).l1_pages == 4
            await asyncio.sleep(0.3)
            n = (await rc.list_nodes()).nodes[0]
            assert n.breaker == "closed" and n.last_error == ""  # nothing was dialled
            await rc.complete(d.route_id, grpc.StatusCode.UNAVAILABLE)
            n = (await rc.list_nodes()).nodes[0]
            assert n.breaker == "open" and n.l1_pages == 0
        finally:
            await rc.close()
            await router.stop()

    asyncio.run(main())


def test_list_nodes_drops_predictions_past_the_ttl_on_an_idle_router() -> None:
    """ListNodes (Router.views) answers with what is predicted now: pages past the TTL are gone from its
    figures even when no route came since to sweep them."""
    clock = Clock()
    r = approx_router(["a", "b"], clock, approx_ttl_s=30.0)
    d = r.route(ask(1, 0))
    assert {v.name: v.l1_pages for v in r.views()}[d.node] == DOC + 2
    clock.t += 30.0  # exactly the TTL: the pages are as old as it, so they go
    assert {v.name: v.l1_pages for v in r.views()} == {"a": 0, "b": 0}
    assert len(r.index) == 0
    assert r.approx is not None and r.approx.expired == DOC + 2


def test_a_withdrawn_route_leaves_no_prediction() -> None:
    """A route taken back (its answer never reached the client) never reached the node either: the pages it
    newly predicted are forgotten, the pages earlier routes predicted stay, and the count says why."""
    r = approx_router(["a", "b"])
    first = r.route(ask(1, 0))
    r.complete(first.route_id)
    late = r.route(ask(1, 1, q_pages=3))  # the document is predicted already: only the question is new
    assert late.node == first.node and late.l1_pages == DOC
    assert r.withdraw(late.route_id)
    assert r.approx is not None
    r.approx.check()
    assert r.approx.pages(first.node) == DOC + 2  # the first route's pages, not the withdrawn question's
    assert r.route(ask(1, 1, q_pages=3), peek=True).l1_pages == DOC
    assert r.approx.withdrawn == 3
    # a prompt nobody predicted: everything it predicted goes, the index included
    lone = r.route(ask(7, 0))
    r.withdraw(lone.route_id)
    assert r.route(ask(7, 0), peek=True).l1_pages == 0
    assert r.approx.pages(lone.node) == (DOC + 2 if lone.node == first.node else 0)
    r.approx.check()


def test_an_earlier_route_withdrawn_keeps_its_pages() -> None:
    """Only the latest route's pages can be taken back: a later route may have built on an earlier one's."""
    r = approx_router(["a"])
    early = r.route(ask(1, 0))
    r.route(ask(1, 0, q_pages=4))  # extends the early route's question pages
    assert r.withdraw(early.route_id)
    assert r.approx is not None and r.approx.withdrawn == 0
    assert r.route(ask(1, 0, q_pages=4), peek=True).l1_pages == DOC + 4
    r.approx.check()


def test_the_node_is_forgotten_whenever_its_breaker_opens() -> None:
    """Predictions go when the breaker opens, however short its cooldown: a breaker already past it when the
    router looks (half-open again, routable) still opened, and the node may have restarted empty."""
    r = approx_router(["a"], breaker_failures=1, breaker_cooldown_s=0.5)
    t = [0.0]

    def ticking() -> float:  # each look at the breaker's clock takes a second: longer than its cooldown
        t[0] += 1.0
        return t[0]

    r.nodes["a"].breaker._clock = ticking
    d = r.route(ask(1, 0))
    r.complete(d.route_id, grpc.StatusCode.UNAVAILABLE)
    assert r.nodes["a"].breaker.trips == 1
    assert r.approx is not None and r.approx.pages("a") == 0
    assert r.route(ask(1, 1), peek=True).l1_pages == 0
    e = r.route(ask(2, 0))  # half-open: routable on probation; its failure reopens the breaker
    r.record("a", grpc.StatusCode.DEADLINE_EXCEEDED)
    assert r.nodes["a"].breaker.trips == 2
    assert r.approx.pages("a") == 0
    r.complete(e.route_id)


def test_a_prompt_longer_than_the_capacity_keeps_its_first_pages() -> None:
    """A prompt of more pages than a node may hold predicts its first pages (what the next request sharing
    it reuses), not its last; other prompts' pages go first, one page of capacity still predicts a root."""
    r = approx_router(["a"], approx_capacity_tokens=3 * PS)
    r.route(ask(2, 0))
    r.route(ask(1, 0))  # DOC + 2 = 8 pages into 3
    assert r.approx is not None and r.approx.pages("a") == 3
    assert r.route(ask(1, 1), peek=True).l1_pages == 3
    assert r.route(ask(2, 0), peek=True).l1_pages == 0
    r.approx.check()
    one = approx_router(["a"], approx_capacity_tokens=PS)
    one.route(ask(1, 0))
    assert one.route(ask(1, 5), peek=True).l1_pages == 1
