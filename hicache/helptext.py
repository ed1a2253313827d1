"""``--help`` as a terminal shows it: the commands' descriptions are their module docstrings, written in
reStructuredText for the API docs; :class:`HelpFormatter` prints them without the markup (````x```` as
``x``, ``:mod:`~hicache.x``` as ``hicache.x``), keeping the docstrings' own line breaks."""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`~?\.?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """``text`` without reStructuredText inline markup (roles and literals)."""
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks (a docstring's examples stay aligned); drops inline markup."""

    def format_help(self) -> str:
        return plain(super().format_help())
