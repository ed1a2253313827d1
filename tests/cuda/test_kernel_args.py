"""The driver-API launch packs kernel arguments by struct formats: they must match the CUDA source's
parameter lists (pure Python, runs anywhere)."""

import re
import struct

import pytest

from hicache.transfer.cuda_driver import KernelLauncher
from hicache.transfer.cuda_kernels import (
    FETCH_ARGS,
    LOAD_LAYERS_ARGS,
    PAGE_COPY_ARGS,
    RESIDENT_ARGS,
    kernel_source_path,
)

# C parameter type -> struct code (pointers are 64-bit addresses)
_CODES = {"u64": "Q", "i64": "q", "int": "i", "unsigned int": "I"}


def _params(source: str, anchor: str) -> list[str]:
    """Struct codes of the parameters of the first kernel parameter list after ``anchor``."""
    start = source.index(anchor)
    m = re.compile(r"\(([^()]*)\)\s*\{", re.S).search(source, start)
    assert m, f"no parameter list after {anchor!r}"
    types = []
    for p in m.group(1).replace("\\", " ").split(","):
        p = " ".join(p.split())
        if "*" in p:
            types.append("Q")
            continue
        ctype = p.removeprefix("const ").rsplit(" ", 1)[0]
        assert ctype in _CODES, f"unexpected parameter type {ctype!r} after {anchor!r}"
        types.append(_CODES[ctype])
    return types


@pytest.mark.parametrize("anchor,fmt", [
    ("#define DEFINE_PAGE_COPY(", PAGE_COPY_ARGS),
    ("#define DEFINE_PAGE_LOAD_LAYERS(", LOAD_LAYERS_ARGS),
    ("void fetch_indices", FETCH_ARGS),
    ("#define DEFINE_STAGED_RESIDENT(", RESIDENT_ARGS),
])
def test_struct_formats_match_the_kernel_signatures(anchor: str, fmt: struct.Struct) -> None:
    source = kernel_source_path().read_text()
    assert "".join(_params(source, anchor)) == fmt.format.lstrip("@")


def test_field_offsets_follow_native_alignment() -> None:
    launcher = KernelLauncher.__new__(KernelLauncher)  # offsets need no driver
    launcher._offsets = {}
    assert launcher._field_offsets(PAGE_COPY_ARGS) == (0, 8, 16, 24, 32, 40, 48, 56, 60, 64, 72)
    assert launcher._field_offsets(LOAD_LAYERS_ARGS)[-3:] == (72, 80, 88)
    assert launcher._field_offsets(FETCH_ARGS) == (0, 8, 16)
    # an int after an int packs without padding; an int64 after an odd int is aligned to 8
    assert launcher._field_offsets(struct.Struct("@iiiq")) == (0, 4, 8, 16)
