"""Tenants as a security boundary: ``serve.auth_tokens_file`` maps each token to the tenants it may act for.

On an in-process node with four tokens (acme's, beta's, one for every tenant as a router's, an admin's):
a token cannot read (ReadPages, Match), write (WritePages), pin, or open requests in another tenant's
namespace (PERMISSION_DENIED); request ids and pins are per token; WatchEvents sends a tenant's token only
its tenants' runs, numbered gap-free for it, while the every-tenant token sees everything; Flush and a Clear
of every tenant need the admin token (a tenant's token clears its own tenants' pages), Attach a token for
every tenant. The tokens file itself is checked at start, and its errors never quote a token.
``serve.auth_token`` alone stays the one-tenant mode: one token that does all.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hicache.client import AsyncHiCacheClient, CallError
from hicache.client.types import Event
from hicache.config import ConfigError, config_from_dict
from hicache.service.auth import load_tokens_file
from hicache.service.server import NodeServer

C = grpc.StatusCode
PS = 4
TOKENS = {"acme": "tok-acme", "beta": "tok-beta", "router": "tok-router", "ops": "tok-ops"}
TOKENS_FILE = f"""tokens:
  - {{name: acme-app, token: {TOKENS["acme"]}, tenants: [acme]}}
  - {{name: beta-app, token: {TOKENS["beta"]}, tenants: [beta, ""]}}
  - {{name: router, token: {TOKENS["router"]}, tenants: ["*"]}}
  - {{name: ops, token: {TOKENS["ops"]}, admin: true}}
"""


def node_config(**serve: Any) -> Any:
    return config_from_dict({
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": PS},
        "cache": {"l1_tokens": 512, "l2_tokens": 512},
        "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0, **serve},
    })


@asynccontextmanager
async def node(tmp_path: Path) -> AsyncIterator[tuple[NodeServer, dict[str, AsyncHiCacheClient]]]:
    f = tmp_path / "tokens.yaml"
    f.write_text(TOKENS_FILE)
    server = NodeServer(node_config(auth_tokens_file=str(f)))
    await server.start()
    clients = {who: AsyncHiCacheClient(f"127.0.0.1:{server.port}", token=t, timeout_s=5) for who, t in TOKENS.items()}
    try:
        yield server, clients
    finally:
        for c in clients.values():
            await c.close()
        await server.stop(0.1)


async def code_of(aw: Any) -> C:
    try:
        await aw
    except (grpc.aio.AioRpcError, CallError) as e:
        return e.code()
    return C.OK


def toks(seed: int, pages: int = 3) -> np.ndarray:
    return (np.arange(pages * PS, dtype=np.uint32) + 1000 * seed).astype(np.uint32)


def test_a_token_cannot_read_write_pin_or_match_another_tenants_pages(tmp_path: Path) -> None:
    async def main() -> None:
        async with node(tmp_path) as (n, c):
            acme, beta = c["acme"], c["beta"]
            assert n.cache is not None
            bpp = n.cache.layout.bytes_per_page
            t = toks(1)
            data = bytes(range(256)) * (3 * bpp // 256)
            assert (await acme.write_pages(t, data, tenant="acme")).new_pages == 3
            keys, got = await acme.read_pages(t, tenant="acme")
            assert got == data and len(keys) == 3
            # beta: not with acme's name, nor any spelling of it beta is not listed for
            for tenant in ("acme", "Acme", "acme ", "acme\x00"):
                assert await code_of(beta.read_pages(t, tenant=tenant)) == C.PERMISSION_DENIED, tenant
                assert await code_of(beta.match(t, tenant=tenant)) == C.PERMISSION_DENIED, tenant
                assert await code_of(beta.match(t, tenant=tenant, peek=True)) == C.PERMISSION_DENIED, tenant
                assert await code_of(beta.pin(t, tenant=tenant)) == C.PERMISSION_DENIED, tenant
                assert await code_of(beta.write_pages(t, data, tenant=tenant)) == C.PERMISSION_DENIED, tenant
            async with beta.match_stream() as s:  # in band, and the stream goes on
                assert await code_of(s.match(t, tenant="acme")) == C.PERMISSION_DENIED
                assert (await s.match(t, tenant="beta", peek=True)).l1_pages == 0  # its own: isolated, a miss
            # acme may not act for the node's default tenant, nor for beta
            assert await code_of(acme.match(t, peek=True)) == C.PERMISSION_DENIED
            assert await code_of(acme.read_pages(t, tenant="beta")) == C.PERMISSION_DENIED
            assert (await beta.match(t, peek=True)).l1_pages == 0  # "" is listed for beta
            # the every-tenant token reads acme's pages as they are
            assert (await c["router"].read_pages(t, tenant="acme"))[1] == data
            assert (await acme.match(t, tenant="acme", peek=True)).l1_pages == 3
            n.cache.check_integrity()

    asyncio.run(main())


def test_request_ids_and_pins_are_per_token(tmp_path: Path) -> None:
    async def main() -> None:
        async with node(tmp_path) as (n, c):
            acme, beta = c["acme"], c["beta"]
            t = toks(2)
            m = await acme.match(t, "r1", tenant="acme")
            dev = np.concatenate([m.device_indices, await acme.allocate("r1", m.num_pages)])
            # beta cannot reach acme's request: as if there were none
            assert await code_of(beta.allocate("r1", 1)) == C.NOT_FOUND
            assert await code_of(beta.commit("r1", t, dev)) == C.NOT_FOUND
            assert await code_of(beta.release("r1")) == C.NOT_FOUND
            assert await code_of(anext(aiter(beta.prefetch("r1")))) == C.NOT_FOUND
            # and the same id is beta's own to open
            mb = await beta.match(toks(3), "r1", tenant="beta")
            assert n.servicer.open_requests == 2
            await acme.commit("r1", t, dev)
            await acme.release("r1")
            await beta.release(mb.request_id)
            assert n.servicer.open_requests == 0
            # pins: acme's pin is neither listed for beta nor beta's to end
            pin = await acme.pin(t, tenant="acme")
            assert [p.pin_id for p in await beta.pins()] == []
            assert await code_of(beta.unpin(pin.pin_id)) == C.NOT_FOUND
            assert [p.pin_id for p in await acme.pins()] == [pin.pin_id]
            assert [p.pin_id for p in await c["ops"].pins()] == [pin.pin_id]
            assert (await acme.unpin(pin.pin_id)).pin_id == pin.pin_id
            assert n.cache is not None
            n.cache.check_integrity()

    asyncio.run(main())


def test_node_wide_calls_need_an_admin_token_and_attach_one_for_every_tenant(tmp_path: Path) -> None:
    async def main() -> None:
        async with node(tmp_path) as (n, c):
            t = toks(4)
            await c["acme"].write_pages(t, bytes(3 * n.cache.layout.bytes_per_page), tenant="acme")  # type: ignore[union-attr]
            for who in ("acme", "beta", "router"):
                assert await code_of(c[who].flush()) == C.PERMISSION_DENIED, who
            # a Clear of every tenant's pages is node-wide; a tenant's token clears its own tenants' alone
            # (tests/service/test_tenant_clear.py)
            assert await code_of(c["router"].clear()) == C.PERMISSION_DENIED
            assert (await c["beta"].clear()).l1_pages == 0
            assert (await c["acme"].match(t, tenant="acme", peek=True)).l1_pages == 3  # nothing cleared
            for who in ("acme", "beta"):
                assert await code_of(c[who].attach()) == C.PERMISSION_DENIED, who
            # the every-tenant token gets past the check (this node's pool is not shared: refused for that)
            assert await code_of(c["router"].attach()) == C.FAILED_PRECONDITION
            assert (await c["ops"].flush()).complete
            assert (await c["ops"].clear()).l1_pages == 3
            for who in c:  # node-wide figures any token reads
                assert (await c[who].stats()).l1_pages_total == n.servicer.num_pages

    asyncio.run(main())


def test_watch_events_sends_a_tenant_only_its_own_runs_numbered_for_it(tmp_path: Path) -> None:
    async def main() -> None:
        async with node(tmp_path) as (n, c):
            assert n.cache is not None
            bpp = n.cache.layout.bytes_per_page
            digest = {tenant: n.cache.ns.with_tenant(tenant).digest for tenant in ("acme", "beta")}
            await c["acme"].write_pages(toks(5), bytes(3 * bpp), tenant="acme")  # before: in the snapshot
            seen: dict[str, list[Event]] = {"beta": [], "router": []}

            async def watch(who: str) -> None:
                async for ev in c[who].watch_events():
                    seen[who].append(ev)

            tasks = [asyncio.create_task(watch(who)) for who in seen]
            await wait_for(lambda: all(seen.values()))  # both snapshots
            for i in range(3):
                await c["acme"].write_pages(toks(10 + i), bytes(3 * bpp), tenant="acme")
                await c["beta"].write_pages(toks(20 + i), bytes(3 * bpp), tenant="beta")
            await c["ops"].flush()  # the backups to L2 are done: every event is out

            def live(who: str, tenant: str) -> list[Event]:
                return [e for e in seen[who] if e.kind != "snapshot" and e.runs[0].namespace_digest == digest[tenant]]

            # each write stores its run (and backs it up to L2: a tier change); both get the same ones of beta
            await wait_for(lambda: len(live("router", "beta")) >= 3 and len(live("router", "acme")) >= 3
                           and len(live("beta", "beta")) == len(live("router", "beta")))
            await asyncio.sleep(0.1)
            for t in tasks:
                t.cancel()
            beta = seen["beta"]
            assert beta[0].kind == "snapshot" and beta[0].sequence == 0 and beta[0].runs == []
            mine = [e for e in beta if e.kind != "snapshot"]
            assert mine == live("beta", "beta") and len(mine) == len(live("router", "beta"))
            assert [e.sequence for e in mine] == list(range(1, len(mine) + 1))  # gap-free, for this subscriber
            def shown(evs: list[Event]) -> list[Any]:
                return [(e.kind, [(r.page_keys, r.tiers, r.tokens.tolist()) for r in e.runs]) for e in evs]

            assert shown(mine) == shown(live("router", "beta"))
            assert {r.namespace_digest for e in beta for r in e.runs} == {digest["beta"]}
            router = seen["router"]  # every tenant's runs, the hub's numbers
            assert {r.namespace_digest for e in router for r in e.runs} == set(digest.values())
            live = [e for e in router if e.kind != "snapshot"]
            assert [e.sequence for e in live] == list(range(live[0].sequence, live[0].sequence + len(live)))
            assert router[0].sequence >= 1  # the snapshot reflects acme's first write

    asyncio.run(main())


async def wait_for(cond: Any, timeout_s: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


def test_single_token_mode_is_one_principal_for_everything() -> None:
    async def main() -> None:
        server = NodeServer(node_config(auth_token="only"))
        await server.start()
        try:
            async with AsyncHiCacheClient(f"127.0.0.1:{server.port}", token="only", timeout_s=5) as a:
                assert server.servicer.auth is None  # nobody is limited: nothing to look up per call
                assert (await a.match(toks(6), tenant="acme", peek=True)).num_pages == 3
                assert (await a.clear()).l1_pages == 0
        finally:
            await server.stop(0.1)

    asyncio.run(main())


@pytest.mark.parametrize(("text", "problem"), [
    ("tokens: []\n", "non-empty list"),
    ("[a, b]\n", "one key, tokens"),
    ("tokens:\n  - {token: tok-secret-1}\n", "tenants: required"),
    ("tokens:\n  - {token: tok-secret-1, tenants: acme}\n", "list of tenant names"),
    ("tokens:\n  - {token: 'tok secret', tenants: [a]}\n", "visible ASCII"),
    ("tokens:\n  - {token: tok-secret-1, tenants: [a]}\n  - {token: tok-secret-1, tenants: [b]}\n",
     "the same as tokens[0]"),
    ("tokens:\n  - {token: tok-secret-1, tenants: [a], role: x}\n", "unknown keys ['role']"),
    ("tokens:\n  - {token: tok-secret-1, admin: 'yes'}\n", "admin: must be true or false"),
    ("tokens: [\n", "not valid YAML"),
])
def test_a_bad_tokens_file_is_refused_without_quoting_its_tokens(tmp_path: Path, text: str, problem: str) -> None:
    f = tmp_path / "tokens.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_tokens_file(str(f))
    msg = str(ei.value)
    assert ei.value.field == "serve.auth_tokens_file" and problem in msg, msg
    assert "tok-secret" not in msg and "tok secret" not in msg


def test_a_missing_tokens_file_stops_the_node_at_start(tmp_path: Path) -> None:
    async def main() -> None:
        server = NodeServer(node_config(auth_tokens_file=str(tmp_path / "none.yaml")))
        with pytest.raises(ConfigError, match=r"serve\.auth_tokens_file"):
            await server.start()

    asyncio.run(main())
