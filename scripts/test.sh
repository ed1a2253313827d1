#!/usr/bin/env bash
# The whole test run: install, lint, type-check, tests (CUDA tests skip without a GPU), then the engine
# adapters against the released SGLang and vLLM in their own venv (scripts/engine_env.sh).
# Arguments go to the first pytest run only (and skip the engines' run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --dev
python3 -m ruff check hicache tests benchmarks
python3 -m mypy
python3 -m pytest -q -p no:cacheprovider --hypothesis-profile=repeatable "$@"
if (( $# == 0 )); then
  ENGINE_PY=$(scripts/engine_env.sh)
  "$ENGINE_PY" -m pytest -q -p no:cacheprovider tests/integrations
fi
