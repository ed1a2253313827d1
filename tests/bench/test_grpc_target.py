"""``hicache bench --target grpc://...`` against a real ``hicache serve`` node gives the in-process hit rate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = {"layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8", "page_size": PAGE},
           "cache": {"l1_tokens": L1, "l2_tokens": L2, "eviction_policy": "lru"},
           "serve": {"port": 0, "metrics_port": 0, "shutdown_grace_s": 2.0, "shared_pool": False}}
    path = tmp_path_factory.mktemp("node") / "serve.yaml"
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
