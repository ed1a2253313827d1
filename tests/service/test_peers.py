"""Page bytes for peers on other hosts (ReadPages / WritePages), and L3 -> L1 through Prefetch."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from hicache.client import AttachedPool, HiCacheClient

from .service_harness import ServerProc

PS = 16


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, pages * PS).astype(np.uint32)


def write_prompt(c: HiCacheClient, shared: AttachedPool, toks: np.ndarray, rid: str, seed: int) -> np.ndarray:
    """Match, allocate, fill the new pages with random KV through the mapped pool, commit, release."""
    m = c.match(toks, rid)
    new = c.allocate(rid, m.num_pages - m.l1_pages)
    g = torch.Generator().manual_seed(seed)
    idx = torch.from_numpy(new)
    for layer in shared.pool.kv:
        for t in layer:
            t[idx] = torch.randn((len(new), *t.shape[1:]), generator=g).to(t.dtype)
    res = c.commit(rid, toks, np.concatenate([m.device_indices, new]))
    c.release(rid)
    return res.device_indices


def canonical(shared: AttachedPool, pages: np.ndarray) -> bytes:
    """Pages as [n, L, C, S, H, D] bytes (the wire order of ReadPages / WritePages)."""
    idx = torch.from_numpy(np.asarray(pages, dtype=np.int64))
    t = torch.stack([torch.stack([kv[idx] for kv in layer], dim=1) for layer in shared.pool.kv], dim=1)
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_read_pages_from_one_node_write_them_to_another(server_factory: Callable[..., ServerProc]) -> None:
    a, b = server_factory(), server_factory(serve={"max_message_bytes": 1 << 20})
    toks = prompt(1, 12)
    with HiCacheClient(a.target) as ca, ca.attach() as sa, HiCacheClient(b.target) as cb, cb.attach() as sb:
        pages_a = write_prompt(ca, sa, toks, "w", seed=5)
        want = canonical(sa, pages_a)
        keys, data = ca.read_pages(toks)
        assert data == want and len(keys) == 12
        assert ca.match(toks, peek=True, return_keys=True).page_keys == keys
        # node b already has the first 4 pages (its own compute); the peer sends pages 4.. in small chunks
        write_prompt(cb, sb, toks[: 4 * PS], "own", seed=5)
        bpp = len(want) // 12
        res = cb.write_pages(toks, memoryview(want)[4 * bpp:], first_page=4, chunk_bytes=3000)
        assert res.new_pages == 8 and res.reused_pages == 0
        m = cb.match(toks, "check")
        assert m.l1_pages == 12
        assert canonical(sb, m.device_indices)[4 * bpp:] == want[4 * bpp:]
        cb.release("check")
        # a gap (pages before first_page missing here) is refused and changes nothing
        other = prompt(2, 6)
        import grpc
        import pytest

        with pytest.raises(grpc.RpcError) as ei:
            cb.write_pages(other, want[: 3 * bpp], first_page=3)
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as ei:
            cb.write_pages(other, want[: 2 * bpp], first_page=0)  # too few bytes for 6 pages
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert cb.match(other, peek=True).l1_pages == 0


def test_prefetch_brings_l3_pages_back_with_the_same_bytes(server_factory: Callable[..., ServerProc]) -> None:
    srv = server_factory(cache={"l1_tokens": 8 * PS, "l2_tokens": 12 * PS, "write_policy": "write_through"},
                         storage={"url": "memory://", "prefetch_threshold_tokens": 0,
                                  "prefetch_policy": "wait_complete"})
    first = prompt(10, 4)
    with HiCacheClient(srv.target) as c, c.attach() as shared:
        want = canonical(shared, write_prompt(c, shared, first, "p0", seed=1))
        for i in range(1, 5):  # push the first prompt out of L1 and L2 (it stays in L3)
            write_prompt(c, shared, prompt(10 + i, 4), f"p{i}", seed=1 + i)
        m = c.match(first, "again")
        assert (m.l1_pages, m.l2_pages, m.l3_pages) == (0, 0, 4)
        progress = list(c.prefetch("again", stream_progress=True, progress_interval_ms=1))
        last = progress[-1]
        assert last.done and last.loaded_l3_pages == 4 and len(last.device_indices) == 4
        assert all(not p.done for p in progress[:-1])
        assert canonical(shared, last.device_indices) == want
        c.release("again")
        st = c.stats()
        assert st.hit_tokens_l3 >= 4 * PS and st.storage_pages_read >= 4


def test_prefetch_progress_ends_with_a_slow_fetch_whatever_the_interval(
        server_factory: Callable[..., ServerProc]) -> None:
    """The stream checks for the fetch's end every few milliseconds, not once per progress interval."""
    import pytest
    import redis

    from hicache.storage.redis_local import LocalRedis, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    with LocalRedis() as r:
        srv = server_factory(cache={"l1_tokens": 8 * PS, "l2_tokens": 12 * PS, "write_policy": "write_through"},
                             storage={"url": r.url, "prefetch_threshold_tokens": 0, "prefetch_policy": "wait_complete",
                                      "options": {"timeout_s": 20}})
        first = prompt(50, 4)
        with HiCacheClient(srv.target) as c, c.attach() as shared:
            want = canonical(shared, write_prompt(c, shared, first, "s0", seed=50))
            for i in range(1, 6):  # push the prompt out of L1 and L2
                write_prompt(c, shared, prompt(50 + i, 4), f"s{i}", seed=50 + i)
            assert c.flush(timeout_s=30).complete
            m = c.match(first, "slow")
            assert (m.l1_pages, m.l2_pages, m.l3_pages) == (0, 0, 4)
            with redis.Redis.from_url(r.url) as admin:
                admin.execute_command("CLIENT", "PAUSE", "1500", "ALL")  # the store answers in 1.5 s
            t0 = time.monotonic()
            progress = list(c.prefetch("slow", stream_progress=True, progress_interval_ms=600_000, timeout_s=25))
            took = time.monotonic() - t0
            assert 1.0 <= took < 20.0, took  # a 10-minute interval does not hold the call past the fetch
            assert [p.done for p in progress] == [False, True]
            assert progress[-1].loaded_l3_pages == 4 and canonical(shared, progress[-1].device_indices) == want
            c.release("slow")
