"""Fixtures of the serving-node tests."""

from __future__ import annotations

import pytest

from hicache.engine import Decoder, preset

from .helpers import SEED


@pytest.fixture(scope="module", params=["tiny", "tiny-mla"])
def model(request: pytest.FixtureRequest) -> Decoder:
    return Decoder.random(preset(request.param), seed=SEED)
