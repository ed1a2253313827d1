"""``hicache status`` against a live node and a live router: what it prints equals what they report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from cli_procs import ROUTE_READY, free_port, start_cli, stop

from hicache.cli import main
from hicache.client import HiCacheClient
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc

from .service_harness import ServerProc, serve_prompt

TOKEN = "s3cret-status"


def traffic(target: str, seed: int = 7) -> None:
    """Two new requests sharing a 4-page prefix: the second hits it on L1."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 30_000, 64).astype(np.int64)
    with HiCacheClient(target) as c:
        for i in range(2):
            toks = np.concatenate([prefix, rng.integers(0, 30_000, 32)])
            serve_prompt(c, toks, f"st-{i}")


def status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["status", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def node(server_factory: Callable[..., ServerProc]) -> ServerProc:
    s = server_factory()
    traffic(s.target)
    return s


def test_node_status_equals_its_stats(node: ServerProc, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = status(capsys, f"grpc://{node.target}", "--json")
    assert rc == 0
    view = json.loads(out)
    with HiCacheClient(node.target) as c:
        st = c.stats()
    assert view["kind"] == "node"
    assert view["stats"]["lookup_tokens"] == st.lookup_tokens > 0
    assert view["stats"]["hit_tokens_l1"] == st.hit_tokens_l1 > 0
    assert view["hit_rate"] == pytest.approx(st.hit_rate)
    assert view["l1_used"] == pytest.approx(st.l1_pages_used / st.l1_pages_total)

    rc, out, _ = status(capsys, node.target)
    assert rc == 0
    assert out.startswith(f"node {node.target}") and f"hit rate {100 * st.hit_rate:.1f}%" in out
    assert "0 pins holding 0 L1 / 0 L2 pages" in out


def test_watch_gives_rates_over_the_interval(node: ServerProc) -> None:
    import contextlib
    import io
    import threading

    class Lines(io.StringIO):
        """stdout that says when the first reading is out."""

        def __init__(self) -> None:
            super().__init__()
            self.first = threading.Event()

        def write(self, s: str) -> int:
            n = super().write(s)
            if "\n" in s:
                self.first.set()
            return n

    out, rc = Lines(), []
    with contextlib.redirect_stdout(out):
        t = threading.Thread(target=lambda: rc.append(main(["status", node.target, "--json", "--watch", "3.0",
                                                            "--count", "2"])))
        t.start()
        assert out.first.wait(30)
        traffic(node.target, 8)  # two more requests between the readings
        t.join(60)
    assert rc == [0]
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert "interval" not in first
    iv = second["interval"]
    assert iv["seconds"] > 2.9
    d_lookups = second["stats"]["lookups"] - first["stats"]["lookups"]
    assert d_lookups == 2
    assert iv["lookups_per_s"] == pytest.approx(d_lookups / iv["seconds"])
    d_tokens = second["stats"]["lookup_tokens"] - first["stats"]["lookup_tokens"]
    d_hits = sum(second["stats"][f"hit_tokens_{t}"] - first["stats"][f"hit_tokens_{t}"] for t in ("l1", "l2", "l3"))
    assert iv["hit_rate"] == pytest.approx(d_hits / d_tokens) and 0 < iv["hit_rate"] < 1


def test_token_and_errors(server_factory: Callable[..., ServerProc], capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    s = server_factory(serve={"auth_token": TOKEN})
    monkeypatch.delenv("HICACHE_TOKEN", raising=False)
    rc, _, err = status(capsys, s.target)
    assert rc == 1 and "UNAUTHENTICATED" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("HICACHE_TOKEN", TOKEN)
    rc, out, _ = status(capsys, s.target)
    assert rc == 0 and out.startswith("node ")

    rc, _, err = status(capsys, f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert rc == 1 and "nothing answering there" in err
    assert status(capsys, "localhost")[0] == 2
    assert status(capsys, s.target, "--count", "3")[0] == 2
    assert status(capsys, s.target, "--watch", "0")[0] == 2
    for bad in ("127.0.0.1:abc", "127.0.0.1:99999", "http://h:p", ":50051"):  # malformed: no waiting, exit 2
        assert status(capsys, bad)[0] == 2
    assert status(capsys, s.target, "--timeout", "nan")[0] == 2
    assert status(capsys, s.target, "--watch", "nan")[0] == 2


@pytest.fixture(scope="module")
def router(node: ServerProc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = tmp_path_factory.mktemp("router") / "router.yaml"
    cfg.write_text(yaml.safe_dump({k: v for k, v in node.config.items() if k in ("layout", "model")}))
    proc, port = start_cli(["route", "--config", str(cfg), "--port", "0", "--node", f"n0={node.target}"],
                           ROUTE_READY)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop([proc])


def test_router_status_lists_its_nodes(router: str, node: ServerProc, capsys: pytest.CaptureFixture[str]) -> None:
    end = time.monotonic() + 20
    while True:
        rc, out, _ = status(capsys, router, "--json")
        assert rc == 0
        view = json.loads(out)
        if view["nodes"][0]["connected"] and view["nodes"][0]["l1_pages"] > 0:
            break
        assert time.monotonic() < end, view
        time.sleep(0.1)
    assert view["kind"] == "router"
    (n,) = view["nodes"]
    assert (n["name"], n["address"], n["breaker"], n["namespace_ok"]) == ("n0", node.target, "closed", True)
    rc, out, _ = status(capsys, router)
    assert rc == 0 and out.startswith(f"router {router}")
    assert any(line.startswith("n0 ") and " yes " in line for line in out.splitlines())


def test_status_of_an_approximate_router(node: ServerProc, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A router with the approximate index follows no stream: its nodes are not shown out of sync, and the
    pages it predicts after a route are listed."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump({k: v for k, v in node.config.items() if k in ("layout", "model")}))
    proc, port = start_cli(["route", "--config", str(cfg), "--port", "0", "--node", f"n0={node.target}",
                            "--index", "approximate"], ROUTE_READY)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            d = rpb_grpc.RouterStub(ch).Route(rpb.RouteRequest(token_ids=list(range(256))), timeout=10)
        rc, out, _ = status(capsys, f"127.0.0.1:{port}", "--json")
        view = json.loads(out)
        assert rc == 0 and view["index"] == "approximate"
        assert view["nodes"][0]["l1_pages"] == d.num_pages > 0
        rc, out, _ = status(capsys, f"127.0.0.1:{port}")
        assert rc == 0 and "approximate index" in out.splitlines()[0]
        assert any(line.startswith("n0 ") and " - " in line and " NO " not in line for line in out.splitlines())
    finally:
        stop([proc])


def test_help_lists_status(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    assert "ListNodes" in capsys.readouterr().out


def test_status_shows_how_a_compressing_node_stores_its_l3_pages(server_factory: Callable[..., ServerProc],
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """With ``storage.compression`` the node's Stats carry page bytes and stored bytes, and status shows the
    ratio; a node that stores pages as they are shows none."""
    url = f"file://{tmp_path / 'l3'}"
    for codec in ("zstd", "none"):
        srv = server_factory(cache={"write_policy": "write_through"}, storage={"url": url, "compression": codec})
        traffic(srv.target)
        with HiCacheClient(srv.target) as c:
            assert c.flush().complete
            st = c.stats()
        assert st.storage_pages_written > 0
        page_bytes = st.storage_bytes_written // st.storage_pages_written
        assert st.storage_bytes_written == st.storage_pages_written * page_bytes
        rc, out, _ = status(capsys, srv.target)
        assert rc == 0
        if codec == "zstd":
            assert 0 < st.storage_stored_bytes_written < st.storage_bytes_written
            assert st.storage_compression_ratio > 1
            assert f"L3 pages stored compressed {st.storage_compression_ratio:.2f}x" in out
        else:
            assert st.storage_stored_bytes_written == st.storage_bytes_written and st.storage_compression_ratio == 1
            assert "compressed" not in out
