"""CUDA IPC: a second process maps the server's L1 pool from the Attach handle and reads/writes it in place."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.layout import KVLayout
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb

from .service_harness import ServerProc

pytestmark = pytest.mark.cuda

CHILD = r"""
import sys, torch
from hicache.client.attach import attach_pool
from hicache.client.types import PoolInfo
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
info = PoolInfo.from_pb(pb.PoolInfo.FromString(open(sys.argv[1], "rb").read()))
with attach_pool(info) as shared:
    k = shared.pool.kv[1][0]
    assert k.is_cuda, k.device
    assert torch.all(k[3] == 3.0).item(), "did not see the owner's page"
    shared.pool.kv[0][1][5].fill_(7.0)  # written in place for the owner to see
    torch.cuda.synchronize()
print("ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_second_process_maps_the_pool_over_cuda_ipc(tmp_path: Path) -> None:
    from hicache.service.shared_pool import SharedPool

    layout = KVLayout(2, 2, 16, "float16", 16)
    shared = SharedPool(layout, 8, "cuda")
    assert shared.kind == "cuda_ipc"
    shared.pool.kv[1][0][3].fill_(3.0)
    torch.cuda.synchronize()
    info = pb.PoolInfo(layout=pb.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=16,
                                          attention="mha"), num_pages=8, device="cuda:0",
                       hostname=socket.gethostname())
    shared.fill(info)
    assert info.WhichOneof("handle") == "cuda_ipc" and info.cuda_ipc.handle
    path = tmp_path / "info.bin"
    path.write_bytes(info.SerializeToString())
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
    assert torch.all(shared.pool.kv[0][1][5] == 7.0).item()
    assert torch.all(shared.pool.kv[0][1][4] == 0.0).item()
    shared.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_server_on_cuda_shares_pages_between_processes(server_factory: Callable[..., ServerProc]) -> None:
    """The shared-pool end-to-end test with the L1 pool on the GPU: KV written by one process through CUDA
    IPC is read back, identical, by another; gRPC carried only page indices."""
    from .test_shared_pool import run_peer

    srv = server_factory(cache={"device": "cuda"})
    n = 16 * 20 + 5
    w = run_peer("write", srv.target, 11, n)
    r = run_peer("read", srv.target, 11, n)
    assert w["new_pages"] == 20 and r["l1_pages"] == 20
    assert r["digest"] == w["digest"] and r["pages"] == w["pages"]
    assert int(r["match_reply_bytes"]) < int(r["page_bytes"])
