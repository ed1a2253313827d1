"""Tokenizers for text traces and the built-in workloads.

:class:`WordTokenizer` is the built-in one: a regex splits text into words, punctuation and newlines; a
word's id is a pure function of the word (first 3 bytes of its sha256), so ids agree across processes
and runs. It remembers every word it encoded, which lets the doctor show diverging spans as text.
Ids from :data:`OPAQUE_BASE` up are never produced by it (workloads use them for document bodies).

:func:`load_tokenizer` returns a Hugging Face tokenizer when one is installed and named; that is optional.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from hicache.bench.errors import BenchInputError

OPAQUE_BASE = 1 << 24  # ids >= this are opaque content (no text)
_SPLIT = re.compile(r"\n|[A-Za-z]+|[0-9]+|[^\sA-Za-z0-9]")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class WordTokenizer:
    """Deterministic word-level tokenizer (see the module docstring)."""

    def __init__(self) -> None:
        self._words: dict[int, str] = {}
        self._ids: dict[str, int] = {}

    def word_id(self, word: str) -> int:
        i = self._ids.get(word)
        if i is None:
            i = 1 + int.from_bytes(hashlib.sha256(word.encode()).digest()[:3], "little") % (OPAQUE_BASE - 1)
            self._ids[word] = i
            self._words.setdefault(i, word)
        return i

    def encode(self, text: str) -> list[int]:
        return [self.word_id(w) for w in _SPLIT.findall(text)]

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)

    def token_text(self, i: int) -> str:
        w = self._words.get(int(i))
        return w if w is not None else f"<{int(i)}>"

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        for i in ids:
            w = self.token_text(int(i))
            if out and w != "\n" and out[-1] != "\n" and (w[0].isalnum() or w[0] == "<") and (
                    out[-1][-1].isalnum() or out[-1][-1] == ">"):
                out.append(" ")
            out.append(w)
        return "".join(out)


class _HFTokenizer:
    def __init__(self, tok: object) -> None:
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))  # type: ignore[attr-defined]


def load_tokenizer(name: str | None) -> Tokenizer:
    """``None`` or ``"word"``: the built-in :class:`WordTokenizer`; else a Hugging Face tokenizer by name/path
    (needs ``transformers``; :class:`BenchInputError` when it is not installed or the name is unknown)."""
    if name in (None, "", "word"):
        return WordTokenizer()
    try:
        from transformers import AutoTokenizer  # type: ignore[import-not-found]
    except ImportError:
        raise BenchInputError(f"--tokenizer {name}: the 'transformers' package is not installed "
                              "(use the built-in 'word' tokenizer)") from None
    try:
        return _HFTokenizer(AutoTokenizer.from_pretrained(name))
    except Exception as e:
        raise BenchInputError(f"--tokenizer {name}: cannot load ({e})") from None
