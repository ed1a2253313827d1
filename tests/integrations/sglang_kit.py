"""SGLang's own classes for the adapter tests: its storage factory, config and host pools (CPU, or a CUDA
device pool with a pinned host pool).

SGLang's host-pool package imports ``sglang.srt.configs``, whose vision-model configs import torchvision at
module level; the CPU torch these tests run on has no torchvision build that loads beside it. On a CUDA
machine the pool modules import ``sgl_kernel`` (SGLang's compiled CUDA kernels, a separate wheel) at module
level. A finder placed first on ``sys.meta_path`` answers every ``torchvision*`` import, and every
``sgl_kernel*`` import where that wheel is not installed, with an empty module (any function of it raises
if called: these tests move pages between device and host with the pools' own torch methods, never with a
kernel), so the real storage and pool modules import unchanged.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from typing import Any


class _Interp(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _StubDistribution(importlib.metadata.Distribution):
    """torchvision's metadata as transformers reads it (it checks the version of what it can import)."""

    def read_text(self, filename: str) -> str | None:
        return "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.29.1\n" if filename == "METADATA" else None

    def locate_file(self, path: Any) -> Any:
        return None


# submodules of a stubbed package that SGLang imports inside ``try`` for a fallback of its own
_REAL_ONLY = ("sgl_kernel.scalar_type",)


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, stubbed: tuple[str, ...] = ("torchvision",)) -> None:
        self.stubbed = stubbed

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        return [_StubDistribution()] if name in (None, "torchvision") and name is not None else []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name in _REAL_ONLY:
            return None  # SGLang falls back to its own when this one is missing
        if name.split(".")[0] in self.stubbed:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        m = types.ModuleType(spec.name)
        m.__path__ = []

        def missing(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            if attr == "InterpolationMode":
                return _Interp

            def f(*a: Any, **k: Any) -> Any:
                raise RuntimeError(f"{spec.name}.{attr}: {spec.name.split('.')[0]} is stubbed in these tests")

            return f

        m.__getattr__ = missing  # type: ignore[method-assign]
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def sglang_keys(tokens: list[int], page: int = 4) -> list[str]:
    """SGLang's page keys: sha256 over the previous key's digest and the page's tokens (uint32 LE), hex."""
    import hashlib
    import struct

    out, prev = [], b""
    for i in range(0, len(tokens) - page + 1, page):
        prev = hashlib.sha256(prev + struct.pack(f"<{page}I", *tokens[i:i + page])).digest()
        out.append(prev.hex())
    return out


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def load_sglang() -> None:
    """Import SGLang's storage and host-pool modules (torchvision stubbed first)."""
    if not any(isinstance(f, _TorchvisionStub) for f in sys.meta_path):
        import torch

        cuda_only = torch.cuda.is_available() and importlib.util.find_spec("sgl_kernel") is None
        stubbed = ("torchvision", "sgl_kernel") if cuda_only else ("torchvision",)
        sys.meta_path.insert(0, _TorchvisionStub(stubbed))
    import sglang.srt.mem_cache.pool_host.mha
    import sglang.srt.mem_cache.pool_host.mla
    import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401


def ptrs(tensors: Any, device: str) -> Any:
    """A device pool's pointer table, as SGLang's own pools build it."""
    import torch

    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


def mha_pool(layout: str, layers: int = 3, heads: int = 2, dim: int = 8, page: int = 4, tokens: int = 64,
             device: str = "cpu", pin: bool = False, host_tokens: int | None = None) -> Any:
    """An ``MHATokenToKVPoolHost`` (bf16) over a device pool of ``tokens`` tokens on ``device``, 2x as many on
    host (or ``host_tokens``; pinned with ``pin``)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(tokens, heads, dim, dtype=torch.bfloat16, device=device) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, dim, dtype=torch.bfloat16, device=device) for _ in range(layers))
    bufs = KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k, device),
                     v_data_ptrs=ptrs(v, device), layout=KVBufferLayout.NHD)
    info = MHABufferInfo(buffers=bufs, page_size=page, head_num=heads, head_dim=dim, v_head_dim=dim,
                         dtype=torch.bfloat16, device=torch.device(device))
    return MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=pin, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
                                host_token_capacity=host_tokens)


def mla_pool(layout: str, layers: int = 3, dim: int = 12, page: int = 4, tokens: int = 64, device: str = "cpu",
             pin: bool = False) -> Any:
    """An ``MLATokenToKVPoolHost`` (bf16, latent of ``dim`` = kv_lora_rank 8 + rope ``dim - 8``) over a device
    pool on ``device``, the host pool pinned with ``pin``."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    bufs = tuple(torch.zeros(tokens, 1, dim, dtype=torch.bfloat16, device=device) for _ in range(layers))
    info = MLABufferInfo(buffers=bufs, data_ptrs=ptrs(bufs, device),
                         layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page,
                         kv_lora_rank=8, qk_rope_head_dim=dim - 8, kv_cache_dim=dim, dtype=torch.bfloat16,
                         device=torch.device(device))
    return MLATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=pin, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
                                target_layer_num=layers)


def storage_config(extra: dict[str, Any], model: str = "org/llama", tp: tuple[int, int] = (0, 1),
                   mla: bool = False, page_first: bool = True) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=page_first, model_name=model, extra_config=extra)


def create(extra: dict[str, Any], pool: Any, **kw: Any) -> Any:
    """The backend as SGLang builds it: the factory's dynamic loader, then the host pool registered."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = {"backend_name": "hicache", "module_path": "hicache.integrations.sglang", "class_name": "HiCacheStore",
           "interface_v1": 1, **extra}
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(cfg, mla=hasattr(pool, "kv_lora_rank"),
                                                                             **kw), pool)
    backend.register_mem_pool_host(pool)
    return backend
