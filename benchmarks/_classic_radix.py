"""A classic Python radix tree, as mature serving engines write it, used as the in-run baseline.

Keys are lists of token ids; children are found by the first page of tokens (a tuple); a match walks
the key page by page in Python; values are torch index tensors concatenated on match. This is the shape
of SGLang's ``RadixCache`` (paged key match, ``torch.cat`` of values); it is written here from that
description so ``radix_ops.py`` can report hicache's tree as a ratio against it on the same machine.
"""

from __future__ import annotations

import time

import torch


class _Node:
    __slots__ = ("children", "key", "last_access", "lock_ref", "parent", "value")

    def __init__(self) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent: _Node | None = None
        self.key: list[int] = []
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access = time.monotonic()


class ClassicRadixTree:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = _Node()
        self.root.lock_ref = 1

    def _child_key(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _key_match(self, a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        i = 0
        ps = self.page_size
        while i < n:
            if a[i : i + ps] != b[i : i + ps]:
                break
            i += ps
        return i

    def _split(self, child: _Node, split_len: int) -> _Node:
        new = _Node()
        new.children = {self._child_key(child.key[split_len:]): child}
        new.parent = child.parent
        new.lock_ref = child.lock_ref
        new.key = child.key[:split_len]
        assert child.value is not None
        new.value = child.value[:split_len]
        child.parent = new
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        assert new.parent is not None
        new.parent.children[self._child_key(new.key)] = new
        return new

    def match_prefix(self, key: list[int]) -> torch.Tensor:
        key = key[: len(key) // self.page_size * self.page_size]
        node, values = self.root, []
        now = time.monotonic()
        while key:
            ck = self._child_key(key)
            if ck not in node.children:
                break
            child = node.children[ck]
            child.last_access = now
            n = self._key_match(child.key, key)
            if n < len(child.key):
                new = self._split(child, n)
                values.append(new.value)
                node = new
                break
            values.append(child.value)
            node = child
            key = key[n:]
        if values:
            return torch.cat(values)  # type: ignore[arg-type]
        return torch.empty(0, dtype=torch.int64)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        key = key[: len(key) // self.page_size * self.page_size]
        value = value[: len(key)]
        node, total = self.root, 0
        now = time.monotonic()
        while key:
            ck = self._child_key(key)
            if ck not in node.children:
                break
            child = node.children[ck]
            child.last_access = now
            n = self._key_match(child.key, key)
            total += n
            key, value = key[n:], value[n:]
            if n < len(child.key):
                node = self._split(child, n)
                break
            node = child
        if key:
            new = _Node()
            new.parent, new.key, new.value = node, key, value.clone()
            node.children[self._child_key(key)] = new
        return total
