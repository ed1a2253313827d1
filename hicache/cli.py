"""``hicache`` command line: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and ``run(args) -> int``;
they are imported lazily so ``hicache bench`` does not load gRPC and ``hicache serve`` does not load
matplotlib. Errors a user can fix end with exit code 2 and one line on stderr saying what and where.
Every subcommand's parser prints its help through :class:`HelpFormatter`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence

from hicache import __version__
from hicache.config import ConfigError

_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`~?\.?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """``text`` without reStructuredText inline markup (roles and literals)."""
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` as a terminal shows it, for every subcommand: the commands' descriptions are their module
    docstrings, written in reStructuredText for the API docs. Keeps the description's line breaks (a
    docstring's examples stay aligned); drops inline markup (````x```` as ``x``, ``:mod:`~hicache.x``` as
    ``hicache.x``)."""

    def format_help(self) -> str:
        return plain(super().format_help())


# subcommand -> module providing add_parser(subparsers) and run(args)
SUBCOMMANDS: dict[str, str] = {
    "bench": "hicache.bench.cli",
    "doctor": "hicache.bench.doctor_cli",
    "serve": "hicache.service.cli",
    "route": "hicache.router.cli",
    "status": "hicache.client.status_cli",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hicache",
        description="Three-tier KV cache for LLM serving: GPU radix cache (L1), pinned host memory (L2), "
        "a shared store (L3: Redis or files); a gRPC node service; a hit-rate benchmark.",
    )
    parser.add_argument("--version", action="version", version=f"hicache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=f"(run 'hicache {name} --help')", add_help=False)
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # pragma: no cover - a subcommand whose extra is not installed
            sub.add_parser(name, help=f"unavailable: {e}")
            continue
        mod.add_parser(sub)
    return parser


# Hardware work queues for this process's CUDA streams, unless the environment already says: the staged
# transfer path spreads its device-side copies over several streams only when there are enough of them
# that none shares a queue with compute (hicache.transfer.cuda_tuning.WIDE_QUEUES). It must be set before CUDA
# starts, which no subcommand does before ``main`` runs.
CUDA_QUEUES = "32"
# The driver's command buffers, four times their default size unless the environment already says: a
# staged transfer of small pieces is thousands of DMA copies, and a few of them queued behind compute fill
# the default buffers, which holds the submitting thread until the GPU drains them (measured on an H200:
# eight 256 MiB block-first loads queued behind a 400 ms wait held the host 355 ms in one batch call;
# with 4x, not at all).
CUDA_LAUNCH_QUEUES = "4x"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; its exit code. Ctrl-C at any point after this module loaded (while a subcommand's
    modules load too) ends with 130 and nothing on stderr."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130


def _main(argv: Sequence[str] | None) -> int:
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", CUDA_QUEUES)
    os.environ.setdefault("CUDA_SCALE_LAUNCH_QUEUES", CUDA_LAUNCH_QUEUES)
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(SUBCOMMANDS[args.command])
    try:
        return int(module.run(args) or 0)
    except ConfigError as e:
        print(f"hicache {args.command}: config: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"hicache {args.command}: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except Exception as e:  # what a subcommand did not turn into its own message: one line, not a traceback
        if os.environ.get("HICACHE_DEBUG"):
            raise
        code, msg = failure(e)
        print(f"hicache {args.command}: {msg} (HICACHE_DEBUG=1 shows the traceback)", file=sys.stderr)
        return code


# errors of what the user asked for (exit 2); anything else is exit 1
INPUT_ERRORS = (ValueError, OverflowError, OSError, MemoryError, LookupError, TypeError)


def failure(e: BaseException) -> tuple[int, str]:
    """Exit code and one line for an exception that reached the command line."""
    if type(e).__module__.startswith("grpc"):  # a call to a node or router failed (grpc not imported here)
        code = getattr(e, "code", None)
        details = getattr(e, "details", None)
        if callable(code) and callable(details):
            return 1, f"{code().name}: {details()}"
    if isinstance(e, OSError) and e.filename is not None:
        return 2, f"{e.filename}: {e.strerror or e}"
    if isinstance(e, MemoryError):
        return 2, f"not enough memory: {e or 'the sizes asked for are too large'}"
    text = (str(e).strip().splitlines() or [""])[0]
    name = type(e).__name__
    if isinstance(e, RuntimeError) and "bind" in text.lower():
        return 2, f"{name}: {text} (is the port in use, or the host not an address of this machine?)"
    return (2 if isinstance(e, INPUT_ERRORS) else 1), f"{name}: {text}" if text else name


if __name__ == "__main__":
    sys.exit(main())
