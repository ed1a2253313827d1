"""File store: atomic writes survive a writer killed mid-way; oldest-first size cap; stale temp files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hicache.storage.file_backend import FileBackend
from hicache.storage.frame import HEADER_BYTES, encode_header, header_of, payload_hasher
from hicache.storage.pageio import PageBuffers, page_buffers
from storage.conftest import LAYOUT, NS, make_pool, page_keys, pages_equal

FRAME = HEADER_BYTES + LAYOUT.bytes_per_page

# A writer that stores pages 0-3, then dies by SIGKILL at ``where`` while storing page 4.
WRITER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from storage.conftest import LAYOUT, NS, make_pool, page_keys
    from hicache.storage import StorageContext, create_backend

    class Dying:
        def __init__(self, fs, where):
            self._fs, self._where = fs, where
        def __getattr__(self, name):
            return getattr(self._fs, name)
        def move(self, src, dst):
            if self._where == "before_rename":
                os.kill(os.getpid(), signal.SIGKILL)
            return self._fs.move(src, dst)
        def open_output_stream(self, path):
            out = self._fs.open_output_stream(path)
            if self._where != "mid_write":
                return out
            class Half:
                def __enter__(s): return s
                def __exit__(s, *a): return False
                def write(s, data):
                    out.write(data)
                    out.flush()
                    if len(data) > 100:  # the payload: half of it is on disk, then the process dies
                        os.kill(os.getpid(), signal.SIGKILL)
            return Half()

    b = create_backend({root!r}, StorageContext(NS, LAYOUT), io_threads=1)
    keys, pool = page_keys(5, "crash"), make_pool(5, seed=9)
    assert b.batch_set(keys[:4], pool, [0, 1, 2, 3]) == 4
    if {io!r} == "pyarrow":
        b.fs = Dying(b.fs, {where!r})
    elif {where!r} == "before_rename":  # the local fast path: os.writev, then os.rename
        os.rename = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    else:
        real_writev = os.writev
        def half_writev(fd, bufs):
            real_writev(fd, [bufs[0], memoryview(bufs[1])[: len(bufs[1]) // 2]])
            os.fsync(fd)
            os.kill(os.getpid(), signal.SIGKILL)
        os.writev = half_writev
    b.batch_set(keys[4:], pool, [4])
    print("survived", flush=True)
""")


@pytest.mark.parametrize("io", ["os", "pyarrow"])
@pytest.mark.parametrize("where", ["before_rename", "mid_write"])
def test_writer_killed_before_rename_never_exposes_a_partial_page(tmp_path: Path, where: str, io: str) -> None:
    root = tmp_path / "store"
    script = WRITER.format(tests=str(Path(__file__).parents[1]), root=str(root), where=where, io=io)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, (proc.returncode, proc.stdout, proc.stderr)  # SIGKILL, not an exit
    assert "survived" not in proc.stdout
    temps = list(root.rglob("*.tmp"))
    assert len(temps) == 1  # the dead writer's temporary file is all that is left of page 4

    keys, src = page_keys(5, "crash"), make_pool(5, seed=9)
    b = FileBackend(str(root), _ctx())
    dst = make_pool(5, seed=None)
    assert b.batch_exists(keys) == 4
    assert b.batch_get(keys, dst, [0, 1, 2, 3, 4]) == 4
    assert pages_equal(src, dst, [0, 1, 2, 3], [0, 1, 2, 3])
    assert b.stats().corrupt_pages == 0  # the half-written page was never visible, not even as damage
    assert temps[0].exists()  # younger than tmp_max_age_s: maybe a live writer's, left alone
    b.close()
    FileBackend(str(root), _ctx(), tmp_max_age_s=0).close()  # opening sweeps stale temporaries
    assert list(root.rglob("*.tmp")) == []
    b = FileBackend(str(root), _ctx())
    assert b.batch_set(keys[4:], src, [4]) == 1 and b.batch_exists(keys) == 5
    b.close()


def _ctx():  # type: ignore[no-untyped-def]
    from hicache.storage import StorageContext
    return StorageContext(NS, LAYOUT)


def test_truncated_page_file_is_a_counted_miss(tmp_path: Path) -> None:
    b = FileBackend(str(tmp_path), _ctx())
    keys = page_keys(2, "trunc")
    assert b.batch_set(keys, make_pool(2), [0, 1]) == 2
    with open(b.path(keys[1]), "r+b") as f:
        f.truncate(FRAME - 7)
    assert b.batch_get(keys, make_pool(2, seed=None), [0, 1]) == 1
    assert b.stats().corrupt_pages == 1
    assert b.batch_exists(keys) == 1  # the damaged file was dropped
    b.close()


def test_size_cap_sweeps_oldest_first(tmp_path: Path) -> None:
    b = FileBackend(f"file://{tmp_path}", _ctx(), max_bytes=10 * FRAME, sweep_to=0.9, io_threads=1)
    pool = make_pool(15, seed=10)
    a, bb, c = page_keys(5, "A"), page_keys(5, "B"), page_keys(5, "C")
    assert b.batch_set(a, pool, range(5)) == 5  # type: ignore[arg-type]
    assert b.batch_set(bb, pool, range(5, 10)) == 5  # type: ignore[arg-type]
    assert b.stored_bytes == 10 * FRAME  # at the cap, not over it
    assert b.batch_get(a, make_pool(5, seed=None), range(5)) == 5  # type: ignore[arg-type]  # A is fresh again
    assert b.batch_set(c, pool, range(10, 15)) == 5  # type: ignore[arg-type]
    assert b.stored_bytes <= 9 * FRAME
    assert sum(os.path.exists(b.path(k)) for k in bb) == 0  # the oldest went first
    assert all(os.path.exists(b.path(k)) for k in c)
    assert sum(os.path.exists(b.path(k)) for k in a) == 4
    assert b.stats().extra["swept_pages"] == 6
    b.close()
    again = FileBackend(str(tmp_path), _ctx(), max_bytes=10 * FRAME)  # a reopened store knows its size
    assert again.stored_bytes == 9 * FRAME
    again.close()


def test_unwritable_store_counts_errors_and_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_bytes(b"x")
    b = FileBackend(str(blocker / "store"), _ctx())  # cannot create a directory under a file
    keys = page_keys(3, "ro")
    assert b.batch_set(keys, make_pool(3), [0, 1, 2]) == 0
    assert b.batch_get(keys, make_pool(3, seed=None), [0, 1, 2]) == 0
    assert b.batch_exists(keys) == 0
    assert b.stats().errors >= 3
    b.close()


def test_any_pyarrow_filesystem_through_the_same_code() -> None:
    """Not only the local disk: pyarrow's in-memory mock filesystem stands in for s3:// / hdfs:// here."""
    from pyarrow._fs import _MockFileSystem

    fs = _MockFileSystem()
    b = FileBackend("mock:///kv/store", _ctx(), filesystem=fs, max_bytes=6 * FRAME)
    keys, src, dst = page_keys(8, "mock"), make_pool(8, seed=17), make_pool(8, seed=None)
    assert b.batch_set(keys[:4], src, [0, 1, 2, 3]) == 4
    assert b.batch_get(keys[:4], dst, [0, 1, 2, 3]) == 4
    assert pages_equal(src, dst, [0, 1, 2, 3], [0, 1, 2, 3])
    h = keys[0].hex()
    assert fs.get_file_info(f"/kv/store/{h[:2]}/{h[2:4]}/{h}.page").size == FRAME
    assert b.batch_set(keys[4:], src, [4, 5, 6, 7]) == 4  # 8 pages > cap of 6: the oldest go
    assert b.batch_exists(keys[4:]) == 4 and sum(b.batch_exists([k]) for k in keys[:4]) == 1
    assert b.stored_bytes <= 6 * FRAME
    b.close()


def test_writes_run_on_their_own_lower_priority_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Background writes must not take the CPU from a request's path: they run on a separate, small pool
    whose threads lower their own priority; reads keep the read threads at normal priority."""
    import threading

    from hicache.storage import file_backend

    monkeypatch.setattr(file_backend, "INLINE_PAGE_BYTES", 0)  # every batch goes to the thread pools
    b = FileBackend(f"file://{tmp_path}", _ctx(), io_threads=4, write_nice=5)
    assert b._write_threads == 2
    ran: list[str] = []
    real_writev, real_readv = os.writev, os.readv

    def writev(fd: int, bufs: list[bytes]) -> int:
        ran.append("w:" + threading.current_thread().name)
        return real_writev(fd, bufs)

    def readv(fd: int, bufs: list[bytearray]) -> int:
        ran.append("r:" + threading.current_thread().name)
        return real_readv(fd, bufs)

    monkeypatch.setattr(os, "writev", writev)
    monkeypatch.setattr(os, "readv", readv)
    keys, src, dst = page_keys(4, "prio"), make_pool(4, seed=3), make_pool(4, seed=None)
    assert b.batch_set(keys, src, [0, 1, 2, 3]) == 4
    assert b.batch_get(keys, dst, [0, 1, 2, 3]) == 4
    assert pages_equal(src, dst, [0, 1, 2, 3], [0, 1, 2, 3])
    writers = {n[2:] for n in ran if n.startswith("w:")}
    readers = {n[2:] for n in ran if n.startswith("r:")}
    assert writers and all(n.startswith("hicache-file-write") for n in writers)
    assert readers and not any(n.startswith("hicache-file-write") for n in readers)
    if sys.platform == "linux":
        by_name = {t.name: t.native_id for t in threading.enumerate()}
        me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert all(os.getpriority(os.PRIO_PROCESS, by_name[n]) == min(19, me + 5) for n in writers)
        assert all(os.getpriority(os.PRIO_PROCESS, by_name[n]) == me for n in readers)
    b.close()


@pytest.mark.parametrize("bad", [{"write_threads": -1}, {"write_nice": 20}, {"write_nice": -1}])
def test_bad_write_options_are_clear_errors(tmp_path: Path, bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        FileBackend(f"file://{tmp_path}", _ctx(), **bad)


class _TwoPieces(PageBuffers):
    """Pages of a host pool handed out as two pieces each (as an engine's K and V apart)."""

    def __init__(self, pool: Any) -> None:
        self.inner = page_buffers(pool)
        self.page_bytes, self.zero_copy = self.inner.page_bytes, True

    def target(self, page: int) -> list[memoryview]:
        whole = self.inner.target(page)
        cut = 200  # not a multiple of the read pieces either
        return [whole[:cut], whole[cut:]]

    def source(self, page: int) -> Any:
        return self.inner.source(page)

    def commit(self, page: int, received: Any) -> None:
        pass


@pytest.mark.parametrize("pieces", [1, 2])
def test_pages_read_in_pieces_are_verified_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  pieces: int) -> None:
    """A local page is read in READ_CHUNK pieces, each hashed as it lands: every page still comes back
    byte-exact and in order, and a byte flipped anywhere (header, first, middle or last piece) or a file cut
    short inside a piece is a counted miss."""
    from hicache.storage import file_backend, file_local_io

    monkeypatch.setattr(file_local_io, "READ_CHUNK", 96)  # 512 B pages: 6 pieces, the last one short
    monkeypatch.setattr(file_backend, "INLINE_PAGE_BYTES", 0)  # through the read threads
    b = FileBackend(f"file://{tmp_path}", _ctx(), io_threads=2)
    n = 12
    keys, src = page_keys(n, f"pieces{pieces}"), make_pool(n, seed=5)
    assert b.batch_set(keys, src, list(range(n))) == n

    def get(ks: list[bytes]) -> tuple[int, Any]:
        dst = make_pool(n, seed=None)
        return b.batch_get(ks, dst if pieces == 1 else _TwoPieces(dst), list(range(len(ks)))), dst

    got, dst = get(keys)
    assert got == n and pages_equal(src, dst, list(range(n)), list(range(n)))
    assert b.stats().corrupt_pages == 0
    # damage: in the header's checksum, the first piece, a middle one, the last byte; then a file cut short
    for k, at in zip(keys[1:5], [HEADER_BYTES - 40, HEADER_BYTES + 3, HEADER_BYTES + 250, FRAME - 1], strict=True):
        with open(b.path(k), "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))
    with open(b.path(keys[5]), "r+b") as f:
        f.truncate(HEADER_BYTES + 150)
    for bad in range(1, 6):
        got, _ = get([keys[0], keys[bad], *keys[6:]])
        assert got == 1  # the page before the damage only
    assert b.stats().corrupt_pages == 5
    assert b.batch_exists(keys[1:2]) == 0  # the damaged files were dropped
    got, dst = get(keys[6:])
    assert got == n - 6 and pages_equal(src, dst, list(range(6, n)), list(range(n - 6)))
    b.close()


def test_streamed_checksum_header_is_the_frame_header() -> None:
    """The header a reader builds from a checksum fed piece by piece is the header the writer wrote."""
    payload = bytes(range(256)) * 7
    h = payload_hasher(NS, b"k" * 32)
    for off in range(0, len(payload), 100):
        h.update(payload[off:off + 100])
    assert header_of(h, NS, b"k" * 32, len(payload)) == encode_header(payload, NS, b"k" * 32)
