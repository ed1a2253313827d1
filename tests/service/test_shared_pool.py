"""Zero copies on one host: KV written by one process is read by another through the shared L1 pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .service_harness import REPO, ServerProc

PEER = Path(__file__).with_name("peer_process.py")


def run_peer(role: str, target: str, seed: int, n: int) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, str(PEER), role, target, str(seed), str(n)], capture_output=True,
                         text=True, timeout=120, env=env, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_writer_and_reader_share_pages(server: ServerProc) -> None:
    n = 16 * 20 + 5  # 20 full pages and a partial one
    w = run_peer("write", server.target, 7, n)
    assert w["l1_pages"] == 0 and w["num_pages"] == 20 and w["new_pages"] == 20
    r = run_peer("read", server.target, 7, n)
    assert r["l1_pages"] == 20
    assert r["pages"] == w["pages"]
    assert r["digest"] == w["digest"]  # identical KV bytes, read in place from the shared pool
    # the Match reply carried 20 page indices, not 20 pages of KV
    assert int(r["match_reply_bytes"]) < int(r["page_bytes"])


def test_other_prompt_misses(server: ServerProc) -> None:
    r = run_peer("read", server.target, 8, 16 * 4)
    assert r["l1_pages"] == 0 and r["pages"] == []


def test_attach_tells_machines_apart_by_boot_id_not_hostname() -> None:
    """Pods of one machine have hostnames of their own: the kernel's boot id decides whether the pool is
    here. A pool on another machine is refused before any mapping is tried."""
    import pytest

    from hicache.client.attach import attach_pool
    from hicache.client.types import PoolInfo
    from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
    from hicache.service.hostid import host_id

    here = host_id()
    if not here:
        pytest.skip("no kernel boot id on this system")
    layout = pb.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", page_size=4, attention="mha")

    def info(hostname: str, hid: str) -> PoolInfo:
        return PoolInfo.from_pb(pb.PoolInfo(layout=layout, num_pages=2, device="cpu", hostname=hostname,
                                            host_id=hid, shm=pb.SharedMemoryHandle(name="hicache-none-here")))

    with pytest.raises(ValueError, match="segment 'hicache-none-here' not found"):  # host check passed
        attach_pool(info("another-pod", here))
    with pytest.raises(ValueError, match="another machine"):
        attach_pool(info("another-pod", "0" * 8 + here[8:]))
