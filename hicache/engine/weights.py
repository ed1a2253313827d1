"""Decoder weights: random by seed, or read from safetensors files (Hugging Face Llama names).

Weight names follow Hugging Face's Llama checkpoints (``model.layers.{i}.self_attn.q_proj.weight`` ...;
``lm_head.weight`` falls back to the tied embedding). The MLA variant uses DeepSeek-V2-style names
(``self_attn.kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` split into ``w_uk``/``w_uv``).
Every linear weight is ``[out_features, in_features]``. ``safetensors`` is optional: without it,
loading and saving raise a clear ``RuntimeError``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from hicache.engine.shape import ModelShape

Weights = dict[str, torch.Tensor]


def weight_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Name -> tensor shape of every weight the decoder uses."""
    h, f = shape.hidden, shape.ffn
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h),
                                       "model.norm.weight": (h,), "lm_head.weight": (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (f, h)
        out[p + "mlp.up_proj.weight"] = (f, h)
        out[p + "mlp.down_proj.weight"] = (h, f)
        hq = shape.num_q_heads
        if shape.attention == "mla":
            out[p + "self_attn.q_proj.weight"] = (hq * shape.qk_dim, h)
            out[p + "self_attn.kv_a_proj_with_mqa.weight"] = (shape.kv_lora_rank + shape.rope_dim, h)
            out[p + "self_attn.kv_a_layernorm.weight"] = (shape.kv_lora_rank,)
            out[p + "self_attn.w_uk"] = (hq * shape.head_dim, shape.kv_lora_rank)
            out[p + "self_attn.w_uv"] = (hq * shape.head_dim, shape.kv_lora_rank)
            out[p + "self_attn.o_proj.weight"] = (h, hq * shape.head_dim)
        else:
            d, hk = shape.head_dim, shape.num_kv_heads
            out[p + "self_attn.q_proj.weight"] = (hq * d, h)
            out[p + "self_attn.k_proj.weight"] = (hk * d, h)
            out[p + "self_attn.v_proj.weight"] = (hk * d, h)
            out[p + "self_attn.o_proj.weight"] = (h, hq * d)
    return out


def random_weights(shape: ModelShape, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> Weights:
    """Gaussian weights scaled by 1/sqrt(fan_in) (embeddings std 1, norm weights 1): activations stay O(1) at any depth
    of a tiny model, so attention over the cached prefix visibly shapes the logits."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out: Weights = {}
    for name, shp in weight_shapes(shape).items():
        if len(shp) == 1:
            out[name] = torch.ones(shp, dtype=dtype, device=device)
        else:
            std = 1.0 if name.endswith("embed_tokens.weight") else 1.0 / math.sqrt(shp[-1])
            t = torch.randn(shp, generator=gen, dtype=torch.float32 if device == "cpu" else dtype, device=device)
            out[name] = t.mul_(std).to(dtype)
    return out


def _safetensors():  # type: ignore[no-untyped-def]
    try:
        import safetensors.torch as st
    except ImportError as e:
        raise RuntimeError("loading or saving weights needs the 'safetensors' package (pip install safetensors)") from e
    return st


def load_safetensors(paths: str | Path | list[str | Path], shape: ModelShape, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> Weights:
    """Read the decoder's weights from one file, a list of files, or a directory of ``*.safetensors``.

    Raises ``ValueError`` naming the first missing or misshapen tensor.
    """
    st = _safetensors()
    if isinstance(paths, str | Path):
        p = Path(paths)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    else:
        files = [Path(x) for x in paths]
    if not files:
        raise ValueError(f"no .safetensors files at {paths}")
    raw: Weights = {}
    for f in files:
        raw.update(st.load_file(str(f), device="cpu"))
    if "lm_head.weight" not in raw and "model.embed_tokens.weight" in raw:
        raw["lm_head.weight"] = raw["model.embed_tokens.weight"]  # tied embeddings
    out: Weights = {}
    for name, shp in weight_shapes(shape).items():
        if name not in raw:
            raise ValueError(f"weights: tensor {name!r} missing from {[str(f) for f in files]}")
        if tuple(raw[name].shape) != shp:
            raise ValueError(f"weights: {name!r} has shape {tuple(raw[name].shape)}, the model needs {shp}")
        out[name] = raw[name].to(device=device, dtype=dtype)
    return out


def save_safetensors(weights: Weights, path: str | Path) -> None:
    st = _safetensors()
    st.save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(path))
