"""The engines' tests share one process: vLLM must pick its CPU platform before SGLang (which imports
vLLM's modules) makes it guess one."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
