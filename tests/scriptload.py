"""Load a script that is not part of the package (a benchmark, the chart's schema generator) as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str, name: str) -> ModuleType:
    """``relpath`` (from the repository root) imported as module ``name``, registered in ``sys.modules`` (a
    script's dataclasses look their module up while the class is built)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
