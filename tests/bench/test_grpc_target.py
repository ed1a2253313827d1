"""``hicache bench --target grpc://...`` against a real ``hicache serve`` node gives the in-process hit rate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.bench.errors import BenchInputError
from hicache.bench.replay import replay
from hicache.bench.run import replay_config
from hicache.bench.targets import GrpcTarget, InProcessTarget
from hicache.bench.workloads import WorkloadSpec, generate
from hicache.cli import main

REPO = Path(__file__).resolve().parents[2]
PAGE, L1, L2 = 16, 16 * 200, 0


def _start(tmp: Path, cfg: dict[str, Any]) -> Iterator[str]:
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve", "--config", str(path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    port = 0
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("hicache serve: listening on"):
            port = int(line.split()[4].rsplit(":", 1)[1])
            break
    if not port:
        proc.kill()
        pytest.fail("node did not start:\n" + "".join(lines))
    yield f"grpc://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8", "page_size": PAGE}
SERVE = {"port": 0, "metrics_port": 0, "shutdown_grace_s": 2.0, "shared_pool": False}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = {"layout": LAYOUT, "cache": {"l1_tokens": L1, "l2_tokens": L2, "eviction_policy": "lru"}, "serve": SERVE}
    yield from _start(tmp_path_factory.mktemp("node"), cfg)


TIERED = {"l1_tokens": 16 * 256, "l2_tokens": 16 * 512, "eviction_policy": "lru", "write_policy": "write_through"}


@pytest.fixture(scope="module")
def tiered_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A node with a small L1, an L2 and a file store, so replays move pages through all three tiers."""
    pytest.importorskip("hicache.storage.file_backend")
    tmp = tmp_path_factory.mktemp("tiered")
    cfg = {"layout": LAYOUT, "cache": TIERED, "serve": SERVE,
           "storage": {"url": f"file://{tmp / 'l3'}", "prefetch_policy": "wait_complete",
                       "prefetch_threshold_tokens": 0}}
    yield from _start(tmp, cfg)


def test_remote_hit_rate_equals_in_process(node: str) -> None:
    reqs = generate(WorkloadSpec("rag", 40))
    with GrpcTarget(node) as remote:
        assert (remote.page_size, remote.l1_tokens) == (PAGE, L1)
        got = replay(reqs, remote)
    with InProcessTarget(replay_config(PAGE, L1, L2, eviction_policy="lru")) as local:
        want = replay(reqs, local)
    assert got.hit_rate > 0.5
    assert got.l1.tolist() == want.l1.tolist()


def test_bench_cli_on_a_node(node: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main(["bench", "--target", node, "--workload", "fewshot", "--requests", "30", "--capacities", "",
                 "--quiet", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["page_size"] == PAGE and res["l1_tokens"] == L1 and 0 < res["hit_rate"] <= res["infinite"]
    assert main(["bench", "--target", node, "--page-size", "64", "--quiet"]) == 2
    assert "uses pages of 16 tokens" in capsys.readouterr().err


def test_no_node_there() -> None:
    with pytest.raises(BenchInputError, match=r"grpc://127\.0\.0\.1:9: no node answering"):
        GrpcTarget("grpc://127.0.0.1:9", connect_timeout_s=0.3)


def test_settled_remote_replay_equals_in_process_on_every_tier(tiered_node: str, tmp_path: Path) -> None:
    """With the node's Flush between requests, what each request finds on L1, L2 and L3 of a node is what
    an in-process cache of the same configuration finds, request by request."""
    reqs = generate(WorkloadSpec("rag", 60, seed=3))
    with GrpcTarget(tiered_node) as remote:
        got = replay(reqs, remote, settle=True)
    cfg = replay_config(PAGE, TIERED["l1_tokens"], TIERED["l2_tokens"], f"file://{tmp_path / 'l3'}",
                        write_policy="write_through", eviction_policy="lru")
    with InProcessTarget(cfg) as local:
        want = replay(reqs, local, settle=True)
    assert got.settled and want.settled
    for col in ("l1", "l2", "l3"):
        assert getattr(got, col).tolist() == getattr(want, col).tolist(), col
    assert got.l2.sum() > 0 and got.l3.sum() > 0


def test_clear_starts_a_warm_node_cold(node: str, tmp_path: Path) -> None:
    """A node keeps what earlier replays left; after Clear a replay finds what a fresh cache finds."""
    reqs = generate(WorkloadSpec("fewshot", 30, seed=5))
    with InProcessTarget(replay_config(PAGE, L1, L2, eviction_policy="lru")) as local:
        want = replay(reqs, local)
    with GrpcTarget(node) as remote:
        replay(reqs, remote)
        warm = replay(reqs, remote)
        assert warm.hit_rate > want.hit_rate  # the second pass finds the first one's pages
        remote.clear()
        cold = replay(reqs, remote)
    assert cold.l1.tolist() == want.l1.tolist()
    runs = []
    for k in range(2):  # the CLI's --clear: the same figures however warm the node was
        out = tmp_path / f"r{k}.json"
        assert main(["bench", "--target", node, "--clear", "--workload", "fewshot", "--requests", "30",
                     "--capacities", "", "--quiet", "--json", str(out)]) == 0
        runs.append(json.loads(out.read_text())["hit_rate"])
    assert runs[0] == runs[1]
