"""Shared fixtures: small caches that run in milliseconds on CPU (helpers live in ``kvhelpers``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import settings

from hicache.cache import HiCache
from kvhelpers import small_config

# scripts/test.sh runs the property tests on a fixed seed (a run fails only on a change of code); a plain
# ``pytest`` draws new examples each time.
settings.register_profile("repeatable", derandomize=True, database=None, print_blob=True)


@pytest.fixture
def make_cache() -> Iterator[Callable[..., HiCache]]:
    caches: list[HiCache] = []

    def make(**sections: dict[str, Any]) -> HiCache:
        c = HiCache(small_config(**sections))
        caches.append(c)
        return c

    yield make
    for c in caches:
        c.close()
