"""Lossless page compression for L3 (``storage.compression``): fewer bytes stored and sent, bit-exact pages.

A KV page of bf16 / fp16 / fp32 values compresses poorly as it lies: the low (mantissa) bytes are noise.
Their high bytes (sign and exponent) are not: values of one page sit in a narrow range of magnitudes, so
the exponents repeat. Each codec first *shuffles* the page by byte plane (all first bytes of the
elements, then all second bytes, ..., as HDF5's and Blosc's shuffle filters do), then compresses the
planes with a general-purpose codec (pyarrow's zstd or lz4, which release the GIL). Decoding inverts
both steps exactly: a compressed page decodes to the same bits, so a hit from it computes the same
thing as a hit from an uncompressed page.

Registry: ``@register_codec("name", codec_id)`` on a :class:`PageCodec` subclass; ``make_codec(name,
level)``; ``codec_for_id`` for readers (a frame names its codec by id, so any node reads any frame,
whatever its own ``storage.compression``). ``none`` (id 0) stores pages as they are.

Contract of a codec: ``compress(page, elem)`` returns the stored bytes, or ``None`` when compressing does
not save at least :data:`MIN_SAVING` of the page (the page is then stored uncompressed, so incompressible
data, e.g. fp8 noise, costs one trial compression per write and nothing per read);
``decompress_into(stored, elem, dst)`` fills ``dst`` (exactly one page) or raises ``ValueError`` on
anything that does not decode to exactly ``len(dst)`` bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import numpy as np

from hicache.registry import Registry

MIN_SAVING = 1 / 32  # store compressed only when it saves at least this share of the page
LEVELS = (-7, 22)  # the compression levels accepted (0: the codec's default)
SHUFFLE_SIZES = (1, 2, 4, 8)  # element sizes the byte shuffle knows (1: no shuffle)


class PageCodec:
    """A lossless page codec (see the module docstring). Instances are thread-safe."""

    name = "none"
    codec_id = 0
    default_level = 0

    def __init__(self, level: int = 0) -> None:
        if not LEVELS[0] <= level <= LEVELS[1]:
            raise ValueError(f"storage.compression_level: must be in [{LEVELS[0]}, {LEVELS[1]}] (0: the codec's "
                             f"default), got {level}")
        self.level = level or self.default_level

    def compress(self, page: memoryview, elem: int) -> bytes | None:
        return None

    def decompress_into(self, stored: memoryview, elem: int, dst: memoryview) -> None:
        if len(stored) != len(dst):
            raise ValueError(f"stored page is {len(stored)} bytes, expected {len(dst)}")
        dst[:] = stored


CODECS: Registry[type[PageCodec]] = Registry("storage.compression", "codec")
_BY_ID: dict[int, type[PageCodec]] = {}


def register_codec(name: str, codec_id: int) -> Callable[[type[PageCodec]], type[PageCodec]]:
    """Decorator: make a :class:`PageCodec` subclass selectable as ``storage.compression: <name>``.
    ``codec_id`` (1..255) is what frames record; it must never be reused for another format."""
    if not 0 <= codec_id <= 255:
        raise ValueError(f"codec id must be in [0, 255], got {codec_id}")

    def deco(cls: type[PageCodec]) -> type[PageCodec]:
        if _BY_ID.get(codec_id, cls) is not cls:
            raise ValueError(f"codec id {codec_id} is taken by {_BY_ID[codec_id].name!r}")
        cls.name, cls.codec_id = name, codec_id
        CODECS.add(name, cls)
        _BY_ID[codec_id] = cls
        return cls

    return deco


register_codec("none", 0)(PageCodec)


def codec_names() -> list[str]:
    return CODECS.names()


def codec_ids() -> list[int]:
    """The ids frames may name that this release decodes."""
    return sorted(_BY_ID)


def make_codec(name: str, level: int = 0) -> PageCodec:
    """The codec ``name`` at ``level`` (0: the codec's default); ``ValueError`` names the known ones."""
    cls = CODECS.get(name)
    return cls(level)


_DECODERS: dict[int, PageCodec] = {}


def codec_for_id(codec_id: int) -> PageCodec:
    """A codec that decodes frames written with ``codec_id`` (the level does not matter for decoding)."""
    c = _DECODERS.get(codec_id)
    if c is None:
        cls = _BY_ID.get(codec_id)
        if cls is None:
            raise ValueError(f"unknown codec id {codec_id}")
        c = _DECODERS[codec_id] = cls()
    return c


def shuffle(page: memoryview, elem: int) -> np.ndarray:
    """``page``'s bytes by plane: byte 0 of every element, then byte 1, ... (a copy)."""
    b = np.frombuffer(page, np.uint8)
    if elem == 1:
        return b
    return np.ascontiguousarray(b.reshape(-1, elem).T)


_WORD = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def unshuffle_into(planes: np.ndarray | Sequence[np.ndarray], elem: int, dst: memoryview) -> None:
    """Invert :func:`shuffle`: write the interleaved bytes into ``dst`` from the planes (one array of
    them end to end, or one array per plane; little-endian words: byte k of an element is bits 8k..8k+7
    of the word, assembled by shifts, which is faster than a strided copy)."""
    out = np.frombuffer(dst, np.uint8)
    rows = planes.reshape(elem, -1) if isinstance(planes, np.ndarray) else planes
    if elem == 1:
        out[:] = rows[0]
        return
    word = _WORD[elem]
    words = out.view(word)
    words[:] = rows[0]
    tmp = np.empty(len(words), word)
    for k in range(1, elem):
        tmp[:] = rows[k]
        np.left_shift(tmp, 8 * k, out=tmp)
        np.bitwise_or(words, tmp, out=words)


_RAW = 1 << 31  # in a plane's stored length: the plane is stored as it is


class _ArrowCodec(PageCodec):
    """Byte shuffle, then one of pyarrow's codecs on each byte plane apart.

    Stored form: one u32 (little-endian) per plane, its stored length (``| _RAW`` when the plane is
    stored as it is), then the planes. Planes apart, not the shuffled page as one stream: the low bytes
    of bf16 values are noise, and coded in one block with the exponents they cost entropy-decoding time
    for nothing (a 64 KiB page decoded 2.8x faster per plane, and came out smaller: 1.45x against
    1.28x); a plane of noise is kept raw, and copied back at memory speed. A plane kept raw
    ``SKIP_AFTER`` pages in a row is kept raw without a trial, but on every ``PROBE_EVERY``-th page (pages
    of noise were written at 0.4x of the uncompressed rate with a trial per plane, 0.7x without).
    """

    arrow_name = ""
    SKIP_AFTER = 8  # a plane stored raw this many pages in a row is not tried again ...
    PROBE_EVERY = 64  # ... but on every 64th page (its values may have changed)

    def __init__(self, level: int = 0) -> None:
        import pyarrow as pa  # here: reading the config (which lists the codecs) should not load pyarrow

        super().__init__(level)
        # (element size, plane) -> pages in a row whose plane did not shrink: the low bytes of bf16, or
        # pages of noise, then cost no trial compression. Shared by threads: a lost update only moves a
        # trial one page earlier or later, never changes what is stored for a page.
        self._raw_runs: dict[tuple[int, int], int] = {}
        self._pages = 0
        self._errors = (pa.ArrowException, OSError)
        try:
            self._codec = pa.Codec(self.arrow_name, compression_level=self.level) if self.level else \
                pa.Codec(self.arrow_name)
        except (pa.ArrowException, ValueError) as e:
            raise ValueError(f"storage.compression: {self.name} level {self.level}: {e}") from None

    def compress(self, page: memoryview, elem: int) -> bytes | None:
        if len(page) % elem:
            raise ValueError(f"page of {len(page)} bytes is not whole {elem}-byte elements")
        self._pages += 1
        probe = self._pages % self.PROBE_EVERY == 0
        runs = [self._raw_runs.get((elem, k), 0) for k in range(elem)]
        skip = [not probe and n >= self.SKIP_AFTER for n in runs]  # noise, lately: no trial
        if all(skip):  # every plane noise lately: stored as it is, without even a shuffle
            for k in range(elem):
                self._raw_runs[(elem, k)] = runs[k] + 1
            return None
        table: list[int] = []
        parts: list[bytes | memoryview] = []
        for k, plane in enumerate(shuffle(page, elem).reshape(elem, -1)):
            packed = None if skip[k] else self._codec.compress(plane, asbytes=True)
            if isinstance(packed, bytes) and len(packed) < len(plane):
                self._raw_runs[(elem, k)] = 0
                table.append(len(packed))
                parts.append(packed)
            else:
                self._raw_runs[(elem, k)] = runs[k] + 1
                table.append(len(plane) | _RAW)
                parts.append(plane.data)
        size = 4 * elem + sum(n & ~_RAW for n in table)
        if size > len(page) * (1 - MIN_SAVING):
            return None
        return struct.pack(f"<{elem}I", *table) + b"".join(parts)

    def decompress_into(self, stored: memoryview, elem: int, dst: memoryview) -> None:
        if elem not in SHUFFLE_SIZES or len(dst) % elem:
            raise ValueError(f"bad shuffle element size {elem} for a page of {len(dst)} bytes")
        plane_bytes = len(dst) // elem
        if len(stored) < 4 * elem:
            raise ValueError(f"{self.name}: {len(stored)} bytes hold no plane table")
        table = struct.unpack_from(f"<{elem}I", stored)
        if 4 * elem + sum(n & ~_RAW for n in table) != len(stored):
            raise ValueError(f"{self.name}: plane lengths do not add up to the {len(stored)} bytes stored")
        planes: list[np.ndarray] = []
        at = 4 * elem
        for n in table:
            size = n & ~_RAW
            part = stored[at: at + size]
            at += size
            if n & _RAW:
                if size != plane_bytes:
                    raise ValueError(f"{self.name}: a raw plane of {size} bytes, expected {plane_bytes}")
                planes.append(np.frombuffer(part, np.uint8))
                continue
            try:
                raw = self._codec.decompress(part, decompressed_size=plane_bytes)
            except self._errors as e:  # damaged stream (the checksum passed: a codec bug or forgery)
                raise ValueError(f"{self.name}: {e}") from None
            if raw.size != plane_bytes:
                raise ValueError(f"{self.name}: decoded {raw.size} bytes, expected {plane_bytes}")
            planes.append(np.frombuffer(raw, np.uint8))
        unshuffle_into(planes, elem, dst)


@register_codec("zstd", 1)
class ZstdCodec(_ArrowCodec):
    """zstd at level 1 by default: on shuffled bf16 KV pages about 1.4x, compressing at 0.4-0.7 GB/s and
    decompressing at 1.4-2.2 GB/s per core (higher levels were slower and no smaller on such pages)."""

    arrow_name = "zstd"
    default_level = 1


@register_codec("lz4", 2)
class Lz4Codec(_ArrowCodec):
    """LZ4 (frame format): a little faster than zstd on such pages (decompressing most), compresses less
    (1.1-1.2x)."""

    arrow_name = "lz4"
