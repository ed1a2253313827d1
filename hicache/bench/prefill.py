"""Measure the prefill rate (tokens/s) of the model a KV layout stands for, with the reference decoder.

``hicache bench --prefill-rate measure`` builds :class:`hicache.engine.Decoder` with random weights in the
shape of ``--model-layout`` (bf16 on CUDA, fp32 on CPU), runs one warm-up and then timed dense forward
passes over a prompt of ``tokens`` tokens (2048 on CUDA, 512 on CPU), and returns tokens per second.
Eager PyTorch, no fused kernels: the figure is what *this* machine recomputes per second, the baseline
every hit is measured against.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from hicache.bench.errors import BenchInputError

# --model-layout name -> reference decoder preset of the same shape
ENGINE_PRESETS = {"llama-3.1-8b": "llama3-8b", "small": "small", "tiny": "tiny"}
CPU_MAX_PARAM_BYTES = 8 << 30


class PrefillRate(NamedTuple):
    tokens_per_s: float
    device: str
    preset: str
    tokens: int


def measure_prefill_rate(model_layout: str, tokens: int | None = None, repeats: int = 2,
                         device: str | None = None) -> PrefillRate:
    """Time dense prefill of the decoder shaped like ``model_layout``; :class:`BenchInputError` when there is
    no such decoder shape or it does not fit this machine."""
    from hicache.engine import Decoder, preset

    name = ENGINE_PRESETS.get(model_layout)
    if name is None:
        raise BenchInputError(f"--prefill-rate measure: no reference decoder for --model-layout {model_layout} "
                              f"(measurable: {', '.join(ENGINE_PRESETS)}); give a rate in tokens/s instead")
    shape = preset(name)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokens = tokens or (2048 if dev.startswith("cuda") else 512)
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    nbytes = shape.num_params() * (2 if dtype == torch.bfloat16 else 4)
    if dev == "cpu" and nbytes > CPU_MAX_PARAM_BYTES:
        raise BenchInputError(f"--prefill-rate measure: {model_layout} needs {nbytes / 2**30:.0f} GiB of weights, "
                              "too large for a CPU run; give a rate in tokens/s or use --model-layout small")
    model = Decoder.random(shape, seed=0, dtype=dtype, device=dev)
    ids = torch.randint(0, shape.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))

    def sync() -> None:
        if dev.startswith("cuda"):
            torch.cuda.synchronize()

    model.forward_dense(ids[: min(tokens, 256)])  # warm-up
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        model.forward_dense(ids)
    sync()
    return PrefillRate(tokens * repeats / (time.perf_counter() - t0), dev, name, tokens)
