"""EngineStore: an engine's pages (lists of byte pieces in the engine's memory, named by the engine's own
keys) stored through hicache's backends, namespaced, framed and verified."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache.config import ConfigError
from hicache.integrations.store import EnginePages, EngineStore, counters, model_revision, parse_config
from hicache.layout import KVLayout
from storage.conftest import needs_redis

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)  # 768 B pages
PIECE = LAYOUT.bytes_per_page // 2


class Pool:
    """An engine-like host pool: K and V apart, so each page is two pieces."""

    def __init__(self, pages: int, seed: int | None = 0) -> None:
        rng = np.random.default_rng(seed)
        self.k = rng.integers(0, 256, (pages, PIECE), dtype=np.uint8) if seed is not None else \
            np.zeros((pages, PIECE), np.uint8)
        self.v = rng.integers(0, 256, (pages, PIECE), dtype=np.uint8) if seed is not None else \
            np.zeros((pages, PIECE), np.uint8)

    def pages(self, idx: list[int]) -> list[list[memoryview]]:
        return [[self.k[i].data, self.v[i].data] for i in idx]

    def page(self, i: int) -> bytes:
        return self.k[i].tobytes() + self.v[i].tobytes()


def keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


def engine_pages(model: str = "org/model", fmt: str = "page_first", tp: tuple[int, int] = (0, 1)) -> EnginePages:
    return EnginePages("test", model, LAYOUT, fmt, tp[0], tp[1])


@pytest.fixture(params=["file", pytest.param("redis", marks=[pytest.mark.redis, needs_redis]),
                        pytest.param("cluster", marks=[pytest.mark.redis, needs_redis])])
def url(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> dict[str, Any]:
    if request.param == "file":
        return {"url": f"file://{tmp_path / 'store'}"}
    if request.param == "redis":
        return {"url": request.getfixturevalue("redis_single").url, "options": {"prefix": prefix}}
    return {"url": request.getfixturevalue("redis_cluster").url, "options": {"prefix": prefix}}


@pytest.fixture
def open_store() -> Iterator[Callable[..., EngineStore]]:
    made: list[EngineStore] = []

    def make(cfg: dict[str, Any], pages: EnginePages | None = None) -> EngineStore:
        s = EngineStore(cfg, pages or engine_pages(), where="test")
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_round_trip_is_byte_exact_in_pieces_and_skips_what_is_stored(url: dict[str, Any], open_store: Any) -> None:
    a, b = open_store(url), open_store(url)  # two processes' stores of the same model and layout
    src, dst = Pool(6), Pool(6, seed=None)
    k = keys(6)
    assert a.exists(k) == 0
    assert a.set(k[:4], src.pages([0, 1, 2, 3])) == 4
    assert b.exists(k) == 4  # the other process sees them
    assert b.get(k[:4], dst.pages([0, 1, 2, 3])) == 4
    assert all(dst.page(i) == src.page(i) for i in range(4))
    written = b.stats()["sets"]
    assert b.set(k, src.pages(list(range(6)))) == 6  # the first 4 are there: only 2 are written
    assert b.stats()["sets"] - written == 2 and b.stats()["skipped_writes"] == 4
    assert a.get(k, dst.pages(list(range(6)))) == 6 and dst.page(5) == src.page(5)


def test_namespaces_never_cross(url: dict[str, Any], open_store: Any) -> None:
    k = keys(3)
    base = open_store(url)
    others = [open_store(url, engine_pages(model="org/other")),
              open_store(url, engine_pages(fmt="layer_first")),
              open_store(url, engine_pages(tp=(1, 2))),
              open_store({**url, "tenant": "acme"}),
              open_store({**url, "revision": "v2"})]
    assert base.set(k, Pool(3).pages([0, 1, 2])) == 3
    for o in others:
        assert o.exists(k) == 0
        assert o.get(k, Pool(3, seed=None).pages([0, 1, 2])) == 0
    assert len({o.ns.digest for o in [base, *others]}) == 6


def test_a_damaged_page_is_a_miss_counted(tmp_path: Path, open_store: Any) -> None:
    s = open_store({"url": f"file://{tmp_path}"})
    k = keys(3)
    s.set(k, Pool(3).pages([0, 1, 2]))
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 3
    victim = next(f for f in files if f.name.startswith(s.storage_keys(k[1:2])[0].hex()))
    blob = bytearray(victim.read_bytes())
    blob[-5] ^= 0xFF
    victim.write_bytes(bytes(blob))
    dst = Pool(3, seed=None)
    assert s.get(k, dst.pages([0, 1, 2])) == 1  # page 0 only: page 1 is damaged, so 2 is not usable
    assert s.stats()["corrupt_pages"] == 1


@needs_redis
@pytest.mark.redis
def test_redis_down_is_a_miss_and_the_next_batch_after_a_restart_succeeds(open_store: Any) -> None:
    from hicache.storage.redis_local import LocalRedis

    with LocalRedis() as r:
        s = open_store({"url": r.url, "options": {"timeout_s": 1.0, "breaker_base_s": 0.05}})
        k = keys(4)
        assert s.set(k[:2], Pool(2).pages([0, 1])) == 2
        r.kill()
        assert s.set(k[2:], Pool(2).pages([0, 1])) == 0
        assert s.get(k[:2], Pool(2, seed=None).pages([0, 1])) == 0
        assert s.stats()["errors"] >= 1
        r.start()
        time.sleep(0.2)  # (the backend's breaker holds a store that failed for breaker_base_s, doubling)
        assert s.set(k, Pool(4).pages([0, 1, 2, 3])) == 4


def test_config_errors_are_one_line_naming_the_field(tmp_path: Path) -> None:
    cases = {
        "test: url: required": {},
        "test: colour: unknown field": {"url": "file:///x", "colour": 1},
        "test: compression: must be one of": {"url": "file:///x", "compression": "gzip9"},
        "test: io_batch_pages: must be": {"url": "file:///x", "io_batch_pages": 0},
        "test: metrics: must be HOST:PORT": {"url": "file:///x", "metrics": "9410"},
        "test: options: must be a JSON object": {"url": "file:///x", "options": []},
    }
    for msg, raw in cases.items():
        with pytest.raises(ConfigError) as e:
            parse_config(raw, "test")
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=r"^test: url / options: .*scheme"):
        EngineStore({"url": "ftp://host/x"}, engine_pages(), where="test")
    with pytest.raises(ConfigError, match=r"^test: url / options: .*unknown option"):
        EngineStore({"url": f"file://{tmp_path}", "options": {"bogus": 1}}, engine_pages(), where="test")


def test_a_local_model_directory_gets_a_revision_from_its_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    r1 = model_revision(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)  # other weights in the same folder
    assert model_revision(str(tmp_path)) != r1 and r1.startswith("local-")
    assert model_revision("org/model-on-a-hub") == "main"


def test_counters_reach_the_process_registry(tmp_path: Path, open_store: Any) -> None:
    reg = counters().registry
    before = reg.get_sample_value("hicache_storage_pages_written_total") or 0.0
    s = open_store({"url": f"file://{tmp_path}"})
    s.set(keys(2), Pool(2).pages([0, 1]))
    assert reg.get_sample_value("hicache_storage_pages_written_total") == before + 2


def test_pieces_must_add_up_to_a_page(tmp_path: Path, open_store: Any) -> None:
    s = open_store({"url": f"file://{tmp_path}"})
    with pytest.raises(ValueError, match="pieces hold"):
        s.set(keys(1), [[memoryview(bytearray(10))]])
    assert os.listdir(tmp_path) == [] or not any(p.is_file() for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="2 keys but 1 pages"):
        s.get(keys(2), [[memoryview(bytearray(LAYOUT.bytes_per_page))]])
