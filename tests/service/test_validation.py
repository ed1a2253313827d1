"""Bad inputs get the right status codes, with messages, and leave the cache exactly as it was."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from hicache.client import CallError, HiCacheClient
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb

from .service_harness import ServerProc

PS = 16  # page size of the test server
MAX_TOKENS = 64 * PS
C = grpc.StatusCode


@pytest.fixture(scope="module")
def srv(server_factory: Callable[..., ServerProc]) -> ServerProc:
    return server_factory(serve={"max_request_tokens": MAX_TOKENS})


@pytest.fixture
def client(srv: ServerProc) -> Iterator[HiCacheClient]:
    with HiCacheClient(srv.target, timeout_s=10) as c:
        yield c


def tokens(seed: int, n: int = 4 * PS) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(np.uint32)


def state(c: HiCacheClient) -> tuple[Any, ...]:
    """Everything observable about the cache: stats and the full tree (via a fresh event snapshot)."""
    st = c.stats()
    snap = next(iter(c.watch_events()))
    runs = sorted((r.page_keys[0], len(r.page_keys), r.tiers) for r in snap.runs)
    return st, snap.sequence, tuple(runs)


def expect(code: grpc.StatusCode, fn: Callable[[], Any], words: str) -> None:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    assert ei.value.code() == code, ei.value
    assert words in ei.value.details(), ei.value.details()


def test_bad_match_inputs(client: HiCacheClient) -> None:
    before = state(client)
    stub = client.stub
    ok = tokens(1).tobytes()
    cases: list[tuple[grpc.StatusCode, pb.MatchRequest, str]] = [
        (C.INVALID_ARGUMENT, pb.MatchRequest(tokens=ok, token_ids=[1, 2]), "not both"),
        (C.INVALID_ARGUMENT, pb.MatchRequest(tokens=b"\x01\x02\x03"), "multiple of 4"),
        (C.INVALID_ARGUMENT, pb.MatchRequest(token_ids=[5, -1, 7]), "token id -1"),
        (C.INVALID_ARGUMENT, pb.MatchRequest(token_ids=[5, 2**32]), f"token id {2**32}"),
        (C.INVALID_ARGUMENT, pb.MatchRequest(), "empty"),
        (C.INVALID_ARGUMENT, pb.MatchRequest(tokens=np.zeros(MAX_TOKENS + 1, np.uint32).tobytes()), "exceed"),
        (C.FAILED_PRECONDITION, pb.MatchRequest(tokens=ok, namespace=pb.NamespaceRef(model="other")), "model"),
        (C.FAILED_PRECONDITION, pb.MatchRequest(tokens=ok, namespace=pb.NamespaceRef(revision="v2")), "revision"),
        (C.FAILED_PRECONDITION,
         pb.MatchRequest(tokens=ok, namespace=pb.NamespaceRef(layout="mha:L2:H2:D8:bfloat16:P16")), "layout"),
        (C.INVALID_ARGUMENT, pb.MatchRequest(tokens=ok, peek=True, request_id="x"), "peek"),
    ]
    for code, req, words in cases:
        expect(code, lambda req=req: stub.Match(req, timeout=5), words)  # type: ignore[misc]
    # the same refusals inside a MatchStream come back in-band, and the stream goes on
    reqs = [req for _, req, _ in cases] + [pb.MatchRequest(tokens=ok, peek=True)]
    replies = list(stub.MatchStream(iter(reqs), timeout=10))
    assert [r.error.code for r in replies[:-1]] == [code.value[0] for code, _, _ in cases]
    assert all(words in r.error.message for r, (_, _, words) in zip(replies, cases, strict=False))
    assert not replies[-1].HasField("error") and replies[-1].num_pages == 4
    with client.match_stream() as s:
        with pytest.raises(CallError) as ei:
            s.match(ok, request_id="x", peek=True)
        assert ei.value.code() == C.INVALID_ARGUMENT
        assert s.match(ok, peek=True).l1_pages == 0
    assert state(client)[1:] == before[1:]
    # a tenant is a namespace of its own: allowed
    assert client.match(tokens(1), tenant="acme", peek=True).l1_pages == 0


def commit_prompt(c: HiCacheClient, toks: np.ndarray, rid: str) -> np.ndarray:
    m = c.match(toks, rid)
    new = c.allocate(rid, m.num_pages - m.l1_pages)
    res = c.commit(rid, toks, np.concatenate([m.device_indices, new]))
    c.release(rid)
    return res.device_indices


def test_bad_request_lifecycle_calls(client: HiCacheClient) -> None:
    cached = commit_prompt(client, tokens(2), "seed")
    toks = tokens(3)
    client.match(toks, "a")
    pages_a = client.allocate("a", 4)
    client.match(tokens(4), "b")
    pages_b = client.allocate("b", 4)
    before = state(client)
    expect(C.ALREADY_EXISTS, lambda: client.match(toks, "a"), "already open")
    expect(C.NOT_FOUND, lambda: client.allocate("nobody", 1), "no open request")
    assert len(client.allocate("a", 0)) == 0  # a whole-prompt hit: nothing new to compute
    expect(C.INVALID_ARGUMENT, lambda: client.allocate("a", 10_000), "exceed")
    n_pages = 4096 * 16 // PS
    expect(C.INVALID_ARGUMENT, lambda: client.commit("a", toks, [0, 1, 2, n_pages]), "outside")
    expect(C.INVALID_ARGUMENT, lambda: client.commit("a", toks, [-1, 1, 2, 3]), "outside")
    expect(C.INVALID_ARGUMENT, lambda: client.commit("a", toks, [pages_a[0]] * 4), "twice")
    expect(C.INVALID_ARGUMENT, lambda: client.commit("a", toks, pages_a[:3]), "4 full pages")
    expect(C.FAILED_PRECONDITION, lambda: client.commit("a", toks, pages_b), "not owned")
    expect(C.FAILED_PRECONDITION, lambda: client.commit("a", toks, cached), "not owned")
    expect(C.FAILED_PRECONDITION, lambda: client.commit("a", tokens(9), pages_a), "do not extend")
    expect(C.NOT_FOUND, lambda: client.commit("zzz", toks, pages_a), "no open request")
    after = state(client)
    assert after[1:] == before[1:] and after[0] == before[0]
    # the right call still works after all that, and release frees b's pages
    assert client.commit("a", toks, pages_a).new_pages == 4
    client.release("a")
    client.release("b")
    expect(C.NOT_FOUND, lambda: client.release("b"), "already released")
    assert client.stats().open_requests == 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_match_stream_sessions_answer_concurrent_calls_in_order(srv: ServerProc, pipelined: bool) -> None:
    import asyncio

    from hicache.client import AsyncHiCacheClient

    prompts = [tokens(100 + i, (1 + i % 7) * PS) for i in range(24)]

    async def main() -> list[int]:
        async with AsyncHiCacheClient(srv.target) as c:
            s = c.match_stream(pipelined=pipelined)
            results = await asyncio.gather(*(s.match(p, peek=True) for p in prompts))
            with pytest.raises(CallError):
                await s.match(prompts[0], request_id="r", peek=True)
            again = await s.match(prompts[3], peek=True)  # the session survives a refusal
            await s.close()
            return [r.num_pages for r in results] + [again.num_pages]

    got = asyncio.run(main())
    assert got == [len(p) // PS for p in prompts] + [len(prompts[3]) // PS]


def test_allocate_beyond_what_can_be_freed_is_refused_without_evicting(
        server_factory: Callable[..., ServerProc]) -> None:
    srv = server_factory(cache={"l1_tokens": 8 * PS, "l2_tokens": 0})
    with HiCacheClient(srv.target) as c:
        commit_prompt(c, tokens(50), "cached")  # 4 pages cached, unlocked (evictable)
        c.match(tokens(51), "x")
        before = state(c)
        expect(C.RESOURCE_EXHAUSTED, lambda: c.allocate("x", 9), "evictable")
        assert state(c) == before  # nothing was evicted for a call that could not succeed
        assert len(c.allocate("x", 8)) == 8  # all 8: the cached prompt is evicted to make room
        c.release("x")


def test_undecodable_messages_are_invalid_argument(client: HiCacheClient) -> None:
    """Bytes that are not a valid message (truncated, or a string field that is not UTF-8) get
    INVALID_ARGUMENT naming the decode failure, on unary and streaming calls; the stream goes on."""
    before = state(client)
    truncated = b"\x0a\x05ab"  # field 1, length 5, but 2 bytes follow
    bad_utf8 = pb.MatchRequest(request_id="x").SerializeToString().replace(b"x", b"\xff")
    for method in ("Match", "Release", "Stats"):
        call = client.channel.unary_unary(f"/hicache.v1.HiCache/{method}", request_serializer=None,
                                          response_deserializer=None)
        for raw in (truncated, bad_utf8) if method != "Stats" else (truncated,):  # Stats has no string field
            with pytest.raises(grpc.RpcError) as ei:
                call(raw, timeout=5)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, ei.value.code())
            assert "could not be decoded" in ei.value.details()
    assert state(client) == before  # nothing changed, nothing counted
    stream = client.channel.stream_stream("/hicache.v1.HiCache/MatchStream", request_serializer=None,
                                          response_deserializer=pb.MatchResponse.FromString)
    good = pb.MatchRequest(token_ids=list(range(1, PS + 1)), peek=True).SerializeToString()
    replies = list(stream(iter([truncated, good]), timeout=5))
    assert replies[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not replies[1].HasField("error") and replies[1].num_pages == 1
