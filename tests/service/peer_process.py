"""A serving process on the same host as the node service (run by the tests as a separate process).

    python peer_process.py write TARGET SEED N_TOKENS   -> writes KV into its own pages, commits; prints JSON
    python peer_process.py read  TARGET SEED N_TOKENS   -> matches the same prompt, reads the pages; prints JSON

Both print the sha256 of the KV bytes of every full page in sequence order (read from the mapped pool)
and the size of the Match reply, so the test can check the bytes are identical and never crossed gRPC.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
import torch

from hicache.client import AttachedPool, HiCacheClient, MatchResult
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.uint32)


def page_digest(shared: AttachedPool, pages: np.ndarray) -> str:
    h = hashlib.sha256()
    for p in pages.tolist():
        for layer in shared.pool.kv:
            for t in layer:
                h.update(t[p].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    role, target, seed, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    tokens = prompt(seed, n)
    with HiCacheClient(target, timeout_s=20) as c, c.attach() as shared:
        rid = f"{role}-{seed}"
        raw = c.stub.Match(pb.MatchRequest(request_id=rid, tokens=tokens.tobytes()), timeout=20)
        m = MatchResult.from_pb(raw)
        out: dict[str, object] = {"l1_pages": m.l1_pages, "num_pages": m.num_pages,
                                  "match_reply_bytes": raw.ByteSize(), "page_bytes": shared.layout.bytes_per_page}
        if role == "write":
            new = c.allocate(rid, m.num_pages - m.l1_pages)
            g = torch.Generator().manual_seed(seed)
            for layer in shared.pool.kv:
                for t in layer:  # the "forward pass": KV written straight into the shared L1 pages
                    idx = torch.from_numpy(new).to(t.device)
                    t[idx] = torch.randn((len(new), *t.shape[1:]), generator=g).to(t.device, t.dtype)
            if shared.pool.device.type == "cuda":
                torch.cuda.synchronize()
            res = c.commit(rid, tokens, np.concatenate([m.device_indices, new]))
            pages = res.device_indices
            out["new_pages"] = res.new_pages
        else:
            pages = m.device_indices
        c.release(rid)
        out["digest"] = page_digest(shared, pages)
        out["pages"] = pages.tolist()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
