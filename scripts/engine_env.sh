#!/usr/bin/env bash
# The engines' test environment: a venv (.venv-engines) that sees the main environment's packages (torch,
# hicache and its dependencies) and adds the released SGLang and vLLM wheels, --no-deps and pinned, with
# the pure-Python modules their storage, KV-connector and scheduler code imports on CPU. Idempotent;
# prints the venv's python. Usage: scripts/engine_env.sh   (then .venv-engines/bin/python -m pytest tests/integrations)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-engines
ENGINES=(sglang==0.5.23 vllm==0.34.0)
# what their imports need on CPU, nothing more (each --no-deps: the main environment keeps its versions)
DEPS=(
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 anyio==4.16.0 apache-tvm-ffi==0.1.15.post2
  cachetools==8.0.3 cbor2==6.3.0 compressed-tensors==0.20.1 dill==0.4.1 einops==0.8.2 frozenlist==1.8.0
  gguf==0.19.0 h11==0.16.0 httpcore2==2.17.0 httpx2==2.17.0 huggingface_hub==2.4.0 llguidance==1.9.1
  loguru==0.7.3 msgspec==0.23.0 multidict==7.2.1 propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1
  sentencepiece==0.2.3 starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.25.0
  triton==3.9.0 truststore==0.10.5 xgrammar==0.2.9 yarl==1.25.1
)
STAMP="$VENV/.hicache-engines-$(echo "${ENGINES[*]} ${DEPS[*]}" | sha256sum | cut -c1-12)"
if [[ ! -f "$STAMP" ]]; then
  rm -rf "$VENV"
  $PY -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install -q --no-deps --disable-pip-version-check "${ENGINES[@]}" "${DEPS[@]}"
  touch "$STAMP"
fi
echo "$VENV/bin/python"
