"""Model shapes for the reference decoder: from a tiny CPU configuration to an 8B-shaped one.

``ModelShape`` describes a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) or its
MLA variant (one latent per token, DeepSeek-V2 style, without query compression). ``kv_layout`` gives the
:class:`~hicache.layout.KVLayout` its L1 pool must have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hicache.layout import KVLayout


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the decoder. MHA/GQA: ``num_kv_heads`` K and V heads of ``head_dim``. MLA: the cache holds
    one latent of ``kv_lora_rank + rope_dim`` per token; ``head_dim`` is the per-head no-RoPE query/key width
    and the value width."""

    vocab_size: int
    hidden: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    attention: str = "mha"  # "mha" (covers GQA/MQA) | "mla"
    kv_lora_rank: int = 0  # MLA latent width (without the RoPE part)
    rope_dim: int = 0  # MLA: decoupled RoPE width shared by all heads

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "ffn"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{f}: must be an integer >= 1, got {v!r}")
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"model.attention: must be 'mha' or 'mla', got {self.attention!r}")
        if self.attention == "mha":
            if self.num_q_heads % self.num_kv_heads:
                raise ValueError(f"model.num_q_heads ({self.num_q_heads}) must be a multiple of "
                                 f"num_kv_heads ({self.num_kv_heads})")
            if self.head_dim % 2:
                raise ValueError(f"model.head_dim: RoPE needs an even width, got {self.head_dim}")
        else:
            if self.num_kv_heads != 1:
                raise ValueError("model.num_kv_heads: MLA caches one latent, so it must be 1")
            if self.kv_lora_rank < 1 or self.rope_dim < 2 or self.rope_dim % 2:
                raise ValueError("model.kv_lora_rank >= 1 and an even model.rope_dim >= 2 are required for MLA")

    @property
    def cache_head_dim(self) -> int:
        """Width of one cached vector per head (MLA: the latent)."""
        return self.kv_lora_rank + self.rope_dim if self.attention == "mla" else self.head_dim

    @property
    def qk_dim(self) -> int:
        """Query/key width per head that attention sees."""
        return self.head_dim + self.rope_dim if self.attention == "mla" else self.head_dim

    def kv_layout(self, page_size: int, dtype: str) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.cache_head_dim, dtype, page_size,
                        "mla" if self.attention == "mla" else "mha")

    def num_params(self) -> int:
        h, L = self.hidden, self.num_layers
        if self.attention == "mla":
            attn = (h * self.num_q_heads * self.qk_dim + h * (self.kv_lora_rank + self.rope_dim)
                    + self.kv_lora_rank * self.num_q_heads * 2 * self.head_dim + self.num_q_heads * self.head_dim * h)
        else:
            attn = h * self.head_dim * (2 * self.num_q_heads + 2 * self.num_kv_heads)
        return L * (attn + 3 * h * self.ffn + 2 * h) + 2 * self.vocab_size * h + h

    def with_(self, **kw: Any) -> ModelShape:
        return replace(self, **kw)


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(vocab_size=256, hidden=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                       ffn=128, rope_theta=10000.0),
    "tiny-mla": ModelShape(vocab_size=256, hidden=64, num_layers=2, num_q_heads=4, num_kv_heads=1, head_dim=16,
                           ffn=128, rope_theta=10000.0, attention="mla", kv_lora_rank=32, rope_dim=8),
    "small": ModelShape(vocab_size=32000, hidden=1024, num_layers=8, num_q_heads=16, num_kv_heads=4,
                        head_dim=64, ffn=2816),
    "llama-8b": ModelShape(vocab_size=32000, hidden=4096, num_layers=32, num_q_heads=32, num_kv_heads=8,
                           head_dim=128, ffn=14336),
    "llama3-8b": ModelShape(vocab_size=128256, hidden=4096, num_layers=32, num_q_heads=32, num_kv_heads=8,
                            head_dim=128, ffn=14336),
}


def preset(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"model preset: unknown {name!r}; known: {sorted(PRESETS)}") from None
