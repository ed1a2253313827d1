"""The command line's start, the router and the client load no torch: ``hicache status`` and ``route`` start in
a fraction of a second, and a router or an engine's client process does not pay torch's import (about a
second, hundreds of MB). torch comes in with the cache, the pools and ``attach``."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = r"""
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
import numpy as np
from hicache.cli import build_parser
from hicache.config import config_from_dict
from hicache.router.config import RouterConfig
from hicache.router.core import NoNodeError, Router
import hicache.router.server, hicache.router.cli, hicache.client, hicache.client.status_cli

for cmd in ("bench", "doctor", "serve", "route", "status"):
    build_parser(cmd)
cfg = config_from_dict({"layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "page_size": 4}})
r = Router(cfg, RouterConfig(nodes=["a=127.0.0.1:1"]))
try:
    r.route(np.arange(16, dtype="<u4").tobytes())
except NoNodeError:
    pass  # not in sync with any node yet: what matters is that routing ran
import hicache
assert hicache.__version__ and "torch" not in dir(sys.modules["hicache"])
print("ok")
"""


def test_cli_router_and_client_need_no_torch() -> None:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_package_names_still_resolve_on_first_use() -> None:
    import hicache
    from hicache.cache import HiCache

    assert hicache.HiCache is HiCache and "HiCache" in dir(hicache)
    with pytest.raises(AttributeError):
        _ = hicache.NoSuchThing  # type: ignore[attr-defined]
