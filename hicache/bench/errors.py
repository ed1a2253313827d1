"""The one error type of the bench: bad input a user can fix (exit code 2, one line on stderr)."""

from __future__ import annotations


class BenchInputError(ValueError):
    """Bad input: missing trace, malformed line, unknown workload, bad size. The message says what and where."""
