"""One code path: the serving node through the node service (gRPC + the shared L1 pool) is exact too."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hicache.engine import Decoder, GenRequest, ServingNode, preset

from .helpers import SEED, assert_matches_recompute

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
from service_harness import ServerProc, start_server

pytest.importorskip("grpc_health", reason="the node service needs grpcio-health-checking")

try:  # the generated gRPC code refuses to load with an older grpcio (RuntimeError, not ImportError)
    from hicache.client import HiCacheClient
    from hicache.engine.grpc_port import GrpcCachePort
except (ImportError, RuntimeError) as e:
    pytest.skip(f"node-service client unavailable: {e}", allow_module_level=True)


@pytest.fixture(scope="module")
def tiny() -> Decoder:
    return Decoder.random(preset("tiny"), SEED)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny: Decoder) -> Iterator[ServerProc]:
    lay = tiny.shape.kv_layout(4, "float32")
    s = start_server(tmp_path_factory.mktemp("engine-serve"),
                     layout={"num_layers": lay.num_layers, "num_kv_heads": lay.num_kv_heads,
                             "head_dim": lay.head_dim, "dtype": "float32", "page_size": 4},
                     cache={"l1_tokens": 4096, "l2_tokens": 4096, "write_policy": "write_through"})
    yield s
    s.terminate(15)


def test_node_through_grpc_reuses_pages_exactly(server: ServerProc, tiny: Decoder) -> None:
    rng = np.random.default_rng(9)
    doc = rng.integers(0, tiny.shape.vocab_size, 45).tolist()
    prompts = [doc + rng.integers(0, tiny.shape.vocab_size, 6).tolist() for _ in range(4)]
    with HiCacheClient(server.target, timeout_s=20) as client:
        port = GrpcCachePort(client)
        try:
            node = ServingNode(tiny, port, collect_logits=True)
            res = node.generate([GenRequest(p, 3) for p in prompts])
            assert [r.computed_tokens for r in res] == [51] + [7] * 3  # doc 44 tokens reused (11 pages)
            assert all(r.hit_tokens["l1"] == 44 for r in res[1:])
            for p, r in zip(prompts, res, strict=True):
                assert_matches_recompute(tiny, p, r)
            again = node.generate([GenRequest(prompts[0], 3)])[0]
            assert again.output == res[0].output and again.computed_tokens == 3
        finally:
            port.close()
