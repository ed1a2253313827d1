"""Deleting a damaged L3 page never deletes a good copy written since the read.

Several nodes share one store. A node that reads a damaged page (a flipped byte, the wrong size, a value
of another type) deletes it -- but between its read and its delete another node may have written a good
copy of that page under the same key. These tests put exactly that write there: a second backend (the
other node) stores the page right after the reader's read of the store returned and before the reader
acts on what it found. The good copy must survive and read back; a damaged value still in place must
still be deleted; a value damaged differently since the read is not the one read, and is left for the
next read to find. ``corrupt_pages`` counts every damaged page read, ``extra["corrupt_deleted"]`` only
those actually deleted.

The hook wraps the reader's batch-level store call (``_run`` for Redis, ``_map`` for files): its first
call is the read, the delete of damaged pages comes after it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from hicache.storage import StorageContext, file_local_io, redis_damaged
from hicache.storage.base import StorageBackend
from hicache.storage.file_backend import FileBackend
from hicache.storage.frame import HEADER_BYTES
from hicache.storage.redis_backend import RedisBackend
from storage.conftest import LAYOUT, NS, make_pool, needs_redis, page_keys, pages_equal

FRAME = HEADER_BYTES + LAYOUT.bytes_per_page
N = 8
DAMAGED = [2, 3, 5, 6, 7]  # pages damaged before the read
REWRITTEN_GOOD = [3, 6]  # written good by the other node between the read and the delete
REDAMAGED = [7]  # damaged differently by then: not the value read
STILL_DAMAGED = [2, 5]  # untouched since the read: deleted


def after_read(monkeypatch: pytest.MonkeyPatch, b: StorageBackend, name: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` once, right after the first call of ``b.<name>`` (the read of the store) returns."""
    orig = getattr(b, name)
    done = False

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal done
        out = orig(*args, **kwargs)
        if not done:
            done = True
            fn()
        return out

    monkeypatch.setattr(b, name, wrapped)


# ---------------------------------------------------------------------------------------------- redis
REDIS_TARGETS = [pytest.param("redis_single", id="redis"), pytest.param("redis_cluster", id="cluster")]


def _client(b: RedisBackend) -> Any:
    return b._nodes.cluster() if b._nodes.client is None else b._nodes.client


def _damage_redis(b: RedisBackend, key: bytes, kind: str, variant: int = 0) -> None:
    """Damage ``key``'s value in the store (``variant`` 1: damaged another way than variant 0)."""
    c, rk = _client(b), b.redis_key(key)
    frame = c.get(rk) if kind != "type" else None
    if kind == "checksum":  # right size, a flipped payload byte
        blob = bytearray(frame)
        blob[HEADER_BYTES + 10 + variant] ^= 0xFF
        c.set(rk, bytes(blob))
    elif kind == "size":
        c.set(rk, frame[: -(7 + variant)])
    elif variant:  # "type", damaged again: now a string of the wrong size
        c.set(rk, b"not a page either")
    else:
        c.delete(rk)
        c.rpush(rk, b"not a page")


def without_scripts(admin: RedisBackend, url: str) -> str:
    """``url`` as a user whom every master refuses Lua scripts (an ACL without ``@scripting``)."""
    user, password = "noscripts", "pw-noscripts"
    for c in admin._nodes.masters():
        c.acl_setuser(user, enabled=True, nopass=False, passwords=[f"+{password}"], keys=["*"], channels=["*"],
                      commands=["+@all", "-@scripting"])
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest}"


@needs_redis
@pytest.mark.redis
@pytest.mark.parametrize("scripts", ["allowed", "refused"])
@pytest.mark.parametrize("kind", ["checksum", "size", "type"])
@pytest.mark.parametrize("server", REDIS_TARGETS)
def test_redis_good_rewrite_between_read_and_delete_survives(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, open_backend: Callable[..., StorageBackend],
        prefix: str, server: str, kind: str, scripts: str) -> None:
    """With scripts refused, the same conditional delete runs as WATCH / MULTI transactions."""
    url = request.getfixturevalue(server).url
    other = open_backend(url, prefix=prefix)
    assert isinstance(other, RedisBackend)
    reader = open_backend(url if scripts == "allowed" else without_scripts(other, url), prefix=prefix)
    assert isinstance(reader, RedisBackend)
    src, keys, idx = make_pool(N, seed=21), page_keys(N, f"race-{kind}"), list(range(N))
    assert other.batch_set(keys, src, idx) == N
    for i in DAMAGED:
        _damage_redis(other, keys[i], kind)
    for c in other._nodes.masters():  # the first delete on each node finds no script cached: EVAL
        c.script_flush()

    def other_node_writes() -> None:
        assert other.batch_set([keys[i] for i in REWRITTEN_GOOD], src, REWRITTEN_GOOD) == len(REWRITTEN_GOOD)
        for i in REDAMAGED:
            _damage_redis(other, keys[i], kind, variant=1)

    after_read(monkeypatch, reader, "_run", other_node_writes)
    got = make_pool(N, seed=None)
    assert reader.batch_get(keys, got, idx) == DAMAGED[0]
    st = reader.stats()
    assert st.corrupt_pages == len(DAMAGED) and st.errors == 0

    for i in REWRITTEN_GOOD:  # the good copies survived and read back as the pages written
        one = make_pool(1, seed=None)
        assert reader.batch_get([keys[i]], one, [0]) == 1, f"page {i}: the good rewrite was deleted"
        assert pages_equal(src, one, [i], [0])
    c = _client(reader)
    assert [c.exists(reader.redis_key(keys[i])) for i in REDAMAGED] == [1] * len(REDAMAGED)  # not what was read
    assert [c.exists(reader.redis_key(keys[i])) for i in STILL_DAMAGED] == [0] * len(STILL_DAMAGED)
    assert reader.stats().extra.get("corrupt_deleted") == len(STILL_DAMAGED)
    assert reader.batch_get([keys[i] for i in REDAMAGED], got, REDAMAGED) == 0  # found now, and deleted
    st = reader.stats()
    assert st.corrupt_pages == len(DAMAGED) + len(REDAMAGED)
    assert st.extra["corrupt_deleted"] == len(STILL_DAMAGED) + len(REDAMAGED)
    assert reader.batch_exists([keys[i] for i in REDAMAGED]) == 0
    assert reader.stats().errors == 0
    assert other.batch_set(keys, src, idx) == N and reader.batch_get(keys, got, idx) == N
    assert pages_equal(src, got, idx, idx)
    assert reader._damaged.no_scripts == (scripts == "refused")


@needs_redis
@pytest.mark.redis
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])  # read into the page, or a bounce buffer
def test_redis_damaged_page_left_alone_is_deleted(redis_single: Any, open_backend: Callable[..., StorageBackend],
                                                  prefix: str, host_layout: str) -> None:
    """No race: every damaged value read is deleted, the first time through ``EVAL`` (no script cached),
    then through ``EVALSHA``; with ``delete_corrupt`` off nothing is deleted."""
    b = open_backend(redis_single.url, prefix=prefix, host_layout=host_layout)
    assert isinstance(b, RedisBackend)
    src, keys, idx = make_pool(4, host_layout, seed=22), page_keys(4, "plain"), [0, 1, 2, 3]
    for c in b._nodes.masters():
        c.script_flush()
    for round_, kind in enumerate(["checksum", "size", "type"]):
        assert b.batch_set(keys, src, idx) == 4
        _damage_redis(b, keys[1], kind)
        _damage_redis(b, keys[3], kind)
        assert b.batch_get(keys, make_pool(4, host_layout, seed=None), idx) == 1
        assert b.batch_exists(keys[1:2]) == 0 and b.batch_exists(keys[3:]) == 0
        assert b.stats().extra.get("corrupt_deleted") == 2 * (round_ + 1), kind
    assert b.stats().corrupt_pages == 6 and b.stats().errors == 0

    keeps = open_backend(redis_single.url, prefix=prefix, delete_corrupt=False)
    assert keeps.batch_set(keys, src, idx) == 4
    _damage_redis(keeps, keys[2], "size")
    assert keeps.batch_get(keys, make_pool(4, seed=None), idx) == 2
    assert keeps.stats().corrupt_pages == 1 and keeps.batch_exists(keys) == 4


@needs_redis
@pytest.mark.redis
def test_redis_without_eval_a_write_after_the_check_survives(monkeypatch: pytest.MonkeyPatch,
                                                             open_backend: Callable[..., StorageBackend],
                                                             prefix: str) -> None:
    """A server with EVAL / EVALSHA renamed away: the conditional delete is a WATCH / MULTI transaction, and
    a good page written after its check and before its ``EXEC`` survives (the server refuses the ``EXEC``);
    a damaged value nobody touches is deleted."""
    from hicache.storage.redis_local import LocalRedis

    with LocalRedis(extra=("--rename-command", "EVAL", "", "--rename-command", "EVALSHA", "")) as server:
        reader = open_backend(server.url, prefix=prefix)
        other = open_backend(server.url, prefix=prefix)
        assert isinstance(reader, RedisBackend) and isinstance(other, RedisBackend)
        src, keys, idx = make_pool(4, seed=23), page_keys(4, "watch"), [0, 1, 2, 3]
        assert other.batch_set(keys, src, idx) == 4
        _damage_redis(other, keys[1], "checksum")
        _damage_redis(other, keys[3], "checksum")
        fingerprint = redis_damaged.fingerprint
        checks = 0

        def fingerprint_then_rewrite(*parts: Any) -> Any:  # (installed once the read is done: the delete's)
            nonlocal checks
            out = fingerprint(*parts)
            checks += 1
            if checks == 1:  # the other node writes the good page right after the first check
                assert other.batch_set(keys[1:2], src, [1]) == 1
            return out

        after_read(monkeypatch, reader, "_run",
                   lambda: monkeypatch.setattr(redis_damaged, "fingerprint", fingerprint_then_rewrite))
        got = make_pool(4, seed=None)
        assert reader.batch_get(keys, got, idx) == 1
        assert reader._damaged.no_scripts and checks == 2
        assert reader.stats().extra.get("corrupt_deleted") == 1  # page 3 only
        assert reader.batch_exists(keys[3:]) == 0
        one = make_pool(1, seed=None)
        assert reader.batch_get(keys[1:2], one, [0]) == 1 and pages_equal(src, one, [1], [0])  # the good rewrite


@needs_redis
@pytest.mark.redis
def test_redis_evalsha_without_eval_falls_back_for_the_pages_it_left(redis_single: Any,
                                                                     open_backend: Callable[..., StorageBackend],
                                                                     prefix: str) -> None:
    """A user who may run EVALSHA but not EVAL: while the script is cached, EVALSHA deletes; once the server
    has forgotten it, the pages EVALSHA left go through transactions, and each damaged page goes once."""
    other = open_backend(redis_single.url, prefix=prefix)
    assert isinstance(other, RedisBackend)
    user, password = "evalsha-only", "pw-evalsha"
    admin = _client(other)
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"],
                      commands=["+@all", "-eval"])
    url = redis_single.url.replace("redis://", f"redis://{user}:{password}@", 1)
    reader = open_backend(url, prefix=prefix)
    assert isinstance(reader, RedisBackend)
    src, keys, idx = make_pool(4, seed=24), page_keys(4, "evalsha"), [0, 1, 2, 3]
    admin.script_load(redis_damaged.DELETE_DAMAGED)
    for round_ in range(2):  # the script cached, then flushed
        assert other.batch_set(keys, src, idx) == 4
        _damage_redis(other, keys[2], "checksum")
        assert reader.batch_get(keys, make_pool(4, seed=None), idx) == 2
        assert reader.batch_exists(keys[2:3]) == 0
        assert reader.stats().extra.get("corrupt_deleted") == round_ + 1
        assert reader._damaged.no_scripts == (round_ == 1)
        admin.script_flush()


# ---------------------------------------------------------------------------------------------- files
def _damage_file(b: FileBackend, key: bytes, kind: str, variant: int = 0) -> None:
    """Damage ``key``'s file in place (as a fault would: no rename)."""
    with open(b.path(key), "r+b") as f:
        if kind == "checksum":
            f.seek(HEADER_BYTES + 10 + variant)
            v = f.read(1)
            f.seek(HEADER_BYTES + 10 + variant)
            f.write(bytes([v[0] ^ 0xFF]))
        else:
            f.truncate(FRAME - 7 - variant)


def _open_file(tmp_path: Path, io: str) -> FileBackend:
    root = str(tmp_path / "store")
    if io == "pyarrow":  # not a LocalFileSystem: reads and deletes go through pyarrow.fs
        return FileBackend(root, _ctx(), io_threads=2, filesystem=pafs.SubTreeFileSystem("/", pafs.LocalFileSystem()))
    return FileBackend(root, _ctx(), io_threads=2)


def _ctx() -> StorageContext:
    return StorageContext(NS, LAYOUT)


@pytest.mark.parametrize("kind", ["checksum", "size"])
@pytest.mark.parametrize("io", ["os", "pyarrow"])
def test_file_good_rewrite_between_read_and_delete_survives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io: str, kind: str) -> None:
    reader, other = _open_file(tmp_path, io), _open_file(tmp_path, io)
    try:
        src, keys, idx = make_pool(N, seed=23), page_keys(N, f"race-{kind}-{io}"), list(range(N))
        assert other.batch_set(keys, src, idx) == N
        for i in DAMAGED:
            _damage_file(other, keys[i], kind)

        def other_node_writes() -> None:
            assert other.batch_set([keys[i] for i in REWRITTEN_GOOD], src, REWRITTEN_GOOD) == len(REWRITTEN_GOOD)
            for i in REDAMAGED:
                _damage_file(other, keys[i], kind, variant=1)

        after_read(monkeypatch, reader, "_map", other_node_writes)
        got = make_pool(N, seed=None)
        assert reader.batch_get(keys, got, idx) == DAMAGED[0]
        st = reader.stats()
        assert st.corrupt_pages == len(DAMAGED) and st.errors == 0

        for i in REWRITTEN_GOOD:
            one = make_pool(1, seed=None)
            assert reader.batch_get([keys[i]], one, [0]) == 1, f"page {i}: the good rewrite was deleted"
            assert pages_equal(src, one, [i], [0])
        assert [Path(reader.path(keys[i])).exists() for i in REDAMAGED] == [True] * len(REDAMAGED)
        assert [Path(reader.path(keys[i])).exists() for i in STILL_DAMAGED] == [False] * len(STILL_DAMAGED)
        assert reader.stats().extra.get("corrupt_deleted") == len(STILL_DAMAGED)
        assert reader.batch_get([keys[i] for i in REDAMAGED], got, REDAMAGED) == 0
        st = reader.stats()
        assert st.corrupt_pages == len(DAMAGED) + len(REDAMAGED)
        assert st.extra["corrupt_deleted"] == len(STILL_DAMAGED) + len(REDAMAGED)
        assert reader.batch_exists([keys[i] for i in REDAMAGED]) == 0
        assert list((tmp_path / "store").rglob("*.tmp")) == []  # nothing left aside
        assert other.batch_set(keys, src, idx) == N and reader.batch_get(keys, got, idx) == N
        assert pages_equal(src, got, idx, idx)
    finally:
        reader.close()
        other.close()


def test_file_page_taken_aside_goes_back_without_replacing_a_newer_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local delete renames the file aside before comparing it. When what it took is not the file
    read (a good rewrite landed first) it goes back -- unless an even newer page took its place while it
    was aside: that one stays, and nothing is left aside."""
    reader, other = _open_file(tmp_path, "os"), _open_file(tmp_path, "os")
    try:
        src, keys = make_pool(2, seed=24), page_keys(1, "aside")
        assert other.batch_set(keys, src, [0]) == 1
        _damage_file(other, keys[0], "checksum")
        after_read(monkeypatch, reader, "_map", lambda: other.batch_set(keys, src, [0]))  # good, from page 0
        def open_then_rewrite(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path).endswith(".del.tmp"):  # while the file is aside, a newer page (page 1's bytes)
                assert other.batch_set(keys, src, [1]) == 1
            return open(path, *args, **kwargs)

        monkeypatch.setattr(file_local_io, "open", open_then_rewrite, raising=False)  # the local path's open only
        assert reader.batch_get(keys, make_pool(1, seed=None), [0]) == 0
        monkeypatch.delattr(file_local_io, "open")
        got = make_pool(1, seed=None)
        assert reader.batch_get(keys, got, [0]) == 1 and pages_equal(src, got, [1], [0])  # the newest stays
        assert reader.stats().extra.get("corrupt_deleted") == 0
        assert list((tmp_path / "store").rglob("*.tmp")) == []
    finally:
        reader.close()
        other.close()
