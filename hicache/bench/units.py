"""Sizes on the command line: tokens (``65536``, ``64k``, ``1m``), bytes (``2GiB``, ``512MB``) or a share of
the working set (``10%``).

Token suffixes are binary (``k`` = 1024, ``m`` = 1024**2, ``g`` = 1024**3). Byte sizes need a ``B``:
decimal ``KB/MB/GB/TB`` or binary ``KiB/MiB/GiB/TiB``; they are converted to tokens with the KV bytes per
token of the model layout.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from hicache.bench.errors import BenchInputError

_TOKEN_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_BYTE_SUFFIX = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z%]*)\s*$")


class Size(NamedTuple):
    """A capacity as given: exactly one of the three is set."""

    tokens: int | None = None
    nbytes: int | None = None
    fraction: float | None = None  # of the working set

    def to_tokens(self, bytes_per_token: int, working_set_tokens: int | None = None) -> int:
        if self.tokens is not None:
            return self.tokens
        if self.nbytes is not None:
            return self.nbytes // bytes_per_token
        assert self.fraction is not None
        if working_set_tokens is None:
            raise BenchInputError("a capacity given as a percentage needs a known working set")
        return int(self.fraction * working_set_tokens)

    def describe(self) -> str:
        if self.tokens is not None:
            return f"{self.tokens} tokens"
        if self.nbytes is not None:
            return f"{self.nbytes} bytes"
        return f"{self.fraction:.0%} of working set"


def parse_size(text: str, what: str = "size") -> Size:
    """Parse ``text``; :class:`BenchInputError` naming ``what`` when it is not a size."""
    m = _RE.match(text)
    if not m:
        raise BenchInputError(f"{what}: not a size: {text!r} (e.g. 65536, 64k, 2GiB, 10%)")
    value, suffix = float(m.group(1)), m.group(2)
    low = suffix.lower()
    if suffix == "%":
        if not value > 0:
            raise BenchInputError(f"{what}: percentage must be > 0, got {text!r}")
        return Size(fraction=value / 100.0)
    if low in _TOKEN_SUFFIX and not low.endswith("b"):
        return Size(tokens=int(value * _TOKEN_SUFFIX[low]))
    if low in _BYTE_SUFFIX:
        return Size(nbytes=int(value * _BYTE_SUFFIX[low]))
    raise BenchInputError(f"{what}: unknown unit {suffix!r} in {text!r} (tokens: k, m, g; bytes: KB, MiB, GiB, ...)")


def human_tokens(n: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    for unit, div in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"
