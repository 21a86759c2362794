#!/usr/bin/env bash
# Installs pdcompile with its test tools. Keeps an existing torch (CUDA or CPU) as it is; on a
# machine without torch it installs the CPU build 2.13.0, so no multi-GB CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[test]"
