"""``hicache bench --target grpc://ROUTER`` replays through a router: each request is routed, served on the
chosen node and completed; with cache-aware routing the cluster's hit rate matches one node's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from cli_procs import ROUTE_READY, SERVE_READY, start_cli, stop

from hicache.bench.replay import replay
from hicache.bench.targets import RouterTarget, open_target
from hicache.bench.workloads import WorkloadSpec, generate
from hicache.config import config_from_dict
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc

REPO = Path(__file__).resolve().parents[2]
PAGE, L1 = 16, 16 * 400
CFG = {"layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8", "page_size": PAGE},
       "cache": {"l1_tokens": L1, "l2_tokens": 0, "eviction_policy": "lru"},
       "serve": {"port": 0, "metrics_port": 0, "shutdown_grace_s": 2.0, "shared_pool": False}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("cluster") / "node.yaml"
    path.write_text(yaml.safe_dump(CFG))
    procs = []
    try:
        ports = []
        for _ in range(2):
            p, port = start_cli(["serve", "--config", str(path)], SERVE_READY)
            procs.append(p)
            ports.append(port)
        nodes = [a for i, port in enumerate(ports) for a in ("--node", f"n{i}=127.0.0.1:{port}")]
        router, rport = start_cli(["route", "--config", str(path), "--port", "0", "--metrics-port", "0", *nodes],
                                  ROUTE_READY)
        procs.append(router)
        with grpc.insecure_channel(f"127.0.0.1:{rport}") as ch:  # wait until both event streams are in sync
            stub = rpb_grpc.RouterStub(ch)
            end = time.monotonic() + 20
            while not all(n.connected for n in stub.ListNodes(rpb.ListNodesRequest(), timeout=5).nodes):
                assert time.monotonic() < end, "router did not sync with the nodes"
                time.sleep(0.05)
        yield f"grpc://127.0.0.1:{rport}"
    finally:
        stop(procs)


def test_bench_through_the_router(cluster: str) -> None:
    reqs = generate(WorkloadSpec("rag", 60))
    with open_target(cluster, config_from_dict(CFG)) as target:
        assert isinstance(target, RouterTarget)
        assert target.page_size == PAGE
        res = replay(reqs, target)
        routed = target.stats()["routed"]
    assert sum(routed.values()) == len(reqs)
    assert res.hit_rate > 0.5  # questions follow their document to the node that holds it


def test_bench_cli_through_the_router(cluster: str, tmp_path: Path) -> None:
    import json

    from hicache.cli import main

    out = tmp_path / "r.json"
    assert main(["bench", "--target", cluster, "--workload", "fewshot", "--requests", "30", "--capacities", "",
                 "--quiet", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["page_size"] == PAGE and 0 < res["hit_rate"] <= res["infinite"]


def test_clear_through_the_router_empties_every_node(cluster: str) -> None:
    with open_target(cluster, config_from_dict(CFG)) as target:
        assert isinstance(target, RouterTarget)
        replay(generate(WorkloadSpec("rag", 20, seed=9)), target)
        assert sum(s["l1_pages_cached"] for s in target.stats()["nodes"].values()) > 0
        target.clear()
        nodes = target.stats()["nodes"]
        assert len(nodes) == 2 and all(s["l1_pages_cached"] == 0 for s in nodes.values())


def test_a_router_whose_node_is_down_is_named_with_that_node(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The router (approximate index: it dials no node) sends the bench to a node where nothing listens:
    one line naming the router target and that node's address, exit code 2."""
    import socket

    from hicache.cli import main

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(CFG))
    router, rport = start_cli(["route", "--config", str(path), "--port", "0", "--index", "approximate",
                               "--node", f"gone=127.0.0.1:{dead}"], ROUTE_READY)
    try:
        assert main(["bench", "--target", f"grpc://127.0.0.1:{rport}", "--requests", "5", "--capacities", "",
                     "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert f"grpc://127.0.0.1:{rport}" in err[0] and f"127.0.0.1:{dead}" in err[0], err
    finally:
        stop([router])
