"""One registry type for every pluggable part: storage backends, transfer engines, eviction policies, page
codecs and router scorers.

A :class:`Registry` maps names to entries (a class or a factory function). Modules register their entries
with the :meth:`Registry.register` decorator when they are imported; an entry whose module is costly or
optional to import is named in ``lazy`` (name -> module), and that module is imported on the first lookup
of the name. A lookup of an unknown name raises ``ValueError`` whose message starts with the registry's
``what`` (the configuration field the name came from) and lists the known names, so a config error reads
``storage.url: unknown scheme 'ftp'; known: [...]``.

Contract: registering a name again replaces its entry, unless the registry was made ``unique``: then it
raises ``ValueError``; :meth:`names` lists registered and lazy names, sorted.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> entries of one kind of pluggable part (see the module docstring)."""

    def __init__(self, what: str, noun: str = "", lazy: Mapping[str, str] | None = None,
                 unique: bool = False) -> None:
        self.what = what  # the config field a name comes from, first in error messages
        self.noun = noun  # "scheme", "policy", ...: "unknown <noun> 'x'"
        self._lazy = dict(lazy or {})
        self._entries: dict[str, T] = {}
        self._unique = unique

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator: make the decorated entry selectable under each of ``names``."""

        def deco(entry: T) -> T:
            for name in names:
                self.add(name, entry)
            return entry

        return deco

    def add(self, name: str, entry: T) -> None:
        if self._unique and name in self._entries:
            raise ValueError(f"{self.what}: {name!r} registered twice")
        self._entries[name] = entry

    def remove(self, name: str) -> None:
        self._entries.pop(name, None)

    def find(self, name: str) -> T | None:
        """The entry of ``name``, importing its module first when it is lazy and not yet loaded; None when
        it is unknown. An ``ImportError`` of a lazy module propagates (the caller says what is missing)."""
        if name not in self._entries and name in self._lazy:
            importlib.import_module(self._lazy[name])
        return self._entries.get(name)

    def get(self, name: str, known_extra: str = "") -> T:
        """The entry of ``name``; ``ValueError`` naming the known ones when there is none."""
        entry = self.find(name)
        if entry is None:
            noun = f"{self.noun} " if self.noun else ""
            raise ValueError(f"{self.what}: unknown {noun}{name!r}; known: {self.names()}{known_extra}")
        return entry

    def names(self) -> list[str]:
        return sorted(set(self._entries) | set(self._lazy))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's :pep:`562` ``__getattr__`` and ``__dir__``: each name of ``exports`` (name -> module) is
    imported on first use and then kept in ``namespace`` (the package's ``globals()``)."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted([*namespace, *exports])

    return getattr_, dir_
