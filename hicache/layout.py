"""KV layout: the shape of one page of KV cache, shared by every tier.

A *page* holds the KV of ``page_size`` consecutive tokens for every layer. Two attention kinds:

* MHA / GQA: per layer a K and a V tensor of shape ``[page_size, num_kv_heads, head_dim]``.
* MLA: per layer one latent tensor of shape ``[page_size, 1, head_dim]`` (``head_dim`` is the
  latent width, e.g. 576 for DeepSeek-V3), so ``num_kv_heads`` must be 1.

``bytes_per_page`` is derived from the layout; it is what L2 and L3 move per page.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

# L2 (host pool) layouts; see hicache.pool
HOST_LAYOUTS: tuple[str, ...] = ("page_first", "layer_first", "block_first")

# KV element types by torch's name, with their size in bytes. Only the name is needed to size and key
# pages, so the router and the command line's start do without torch; ``torch_dtype`` imports it.
DTYPES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

Attention = Literal["mha", "mla"]


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache of one model shard.

    Raises ``ValueError`` naming the field when a value is out of range.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    page_size: int = 16
    attention: Attention = "mha"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"layout.{name}: must be an integer >= 1, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"layout.dtype: must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"layout.attention: must be 'mha' or 'mla', got {self.attention!r}")
        if self.attention == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"layout.num_kv_heads: MLA stores one latent, so it must be 1, got {self.num_kv_heads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def element_size(self) -> int:
        return DTYPES[self.dtype]

    @property
    def kv_count(self) -> int:
        """2 for MHA (K and V), 1 for MLA (one latent)."""
        return 1 if self.attention == "mla" else 2

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's K (or V, or latent) piece of one page: [page_size, heads, head_dim]."""
        return (self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_layer_piece(self) -> int:
        """Bytes of one page's K (or V, or latent) for one layer."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page across every layer, K and V (or the latent)."""
        return self.bytes_per_layer_piece * self.kv_count * self.num_layers

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_page // self.page_size

    def describe(self) -> str:
        """Canonical text form; it is hashed into every page key's namespace."""
        return (
            f"{self.attention}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":{self.dtype}:P{self.page_size}"
        )

    def digest(self) -> bytes:
        return hashlib.sha256(self.describe().encode()).digest()
