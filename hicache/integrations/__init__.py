"""Adapters that let unmodified inference engines use hicache's L3 store.

* :mod:`hicache.integrations.sglang`: a HiCache storage backend for SGLang
  (``--hicache-storage-backend dynamic``).
* :mod:`hicache.integrations.vllm`: a KV connector for vLLM (``--kv-transfer-config``).
* :mod:`hicache.integrations.store`: what both share: namespacing, framing, metrics.

The engines are not dependencies of hicache: each adapter imports its engine when the engine loads it.
"""
