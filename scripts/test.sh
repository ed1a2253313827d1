#!/usr/bin/env bash
# The whole test run: install, lint, type-check, tests (CUDA tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --dev
python3 -m ruff check hicache tests benchmarks
python3 -m mypy
python3 -m pytest -q -p no:cacheprovider --hypothesis-profile=repeatable "$@"
