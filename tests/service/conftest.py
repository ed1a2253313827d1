"""Node-service fixtures: ``hicache serve`` in a subprocess, one per configuration, per test module."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .service_harness import ServerProc, start_server


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProc]]:
    started: list[ServerProc] = []
    tmp = tmp_path_factory.mktemp("serve")

    def make(**sections: dict[str, Any]) -> ServerProc:
        s = start_server(tmp, **sections)
        started.append(s)
        return s

    yield make
    for s in started:
        try:
            s.terminate(15)
        except subprocess.TimeoutExpired:
            s.proc.kill()


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., ServerProc]) -> ServerProc:
    """One shared-pool CPU server for the module (tests use distinct prompts)."""
    return server_factory()
