#!/usr/bin/env bash
# Install hicache and what it needs. Usage: scripts/install.sh [--dev]
#   --dev  also the test tools (pytest, hypothesis, ruff, mypy) and Debian's redis-server and prometheus.
# On a machine without an NVIDIA GPU this installs the CPU build of torch first, so pip does not pull a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PY -m pip install -q "torch>=2.11,<2.15"
  else
    # the CPU index first (PyPI's default Linux build pulls the CUDA libraries), else whatever pip finds
    $PY -m pip install -q --retries 1 --timeout 20 "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
      || $PY -m pip install -q "torch==2.13.0"
  fi
fi
if [[ "${1:-}" == "--dev" ]]; then
  $PY -m pip install -q -e ".[dev]"
  # Debian packages the tests run for real: redis-server (L3), prometheus (promtool and the server, for
  # the alert rules and the dashboard)
  MISSING=()
  command -v redis-server >/dev/null 2>&1 || MISSING+=(redis-server)
  { command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; } || MISSING+=(prometheus)
  if (( ${#MISSING[@]} )); then
    if command -v apt-get >/dev/null 2>&1; then
      SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
      $SUDO apt-get update -qq
      $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${MISSING[@]}" >/dev/null
    else
      echo "install.sh: ${MISSING[*]} not found and no apt-get; install Redis >= 6 and Prometheus >= 2.40 yourself" >&2
      exit 1
    fi
  fi
else
  $PY -m pip install -q -e .
fi
