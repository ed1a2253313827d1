from __future__ import annotations

import pytest

from hicache.bench.errors import BenchInputError
from hicache.bench.units import Size, parse_size


@pytest.mark.parametrize(("text", "size"), [
    ("65536", Size(tokens=65536)), ("64k", Size(tokens=65536)), ("1m", Size(tokens=1 << 20)),
    ("2GiB", Size(nbytes=2 << 30)), ("512MB", Size(nbytes=512 * 10**6)), ("10%", Size(fraction=0.1)),
])
def test_parse(text: str, size: Size) -> None:
    assert parse_size(text) == size


def test_to_tokens() -> None:
    assert parse_size("1GiB").to_tokens(128 << 10) == 8192  # Llama-3.1-8B: 128 KiB per token
    assert parse_size("25%").to_tokens(1, 1000) == 250
    with pytest.raises(BenchInputError):
        parse_size("25%").to_tokens(1, None)


@pytest.mark.parametrize("bad", ["", "lots", "12 parsecs", "-5", "0%"])
def test_bad(bad: str) -> None:
    with pytest.raises(BenchInputError, match="--l1"):
        parse_size(bad, "--l1")
