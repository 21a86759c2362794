#!/usr/bin/env bash
# Installs pdcompile with its test tools and the optional real-model libraries (.[models]:
# torchvision, timm, transformers). Keeps an existing torch (CUDA or CPU) as it is; on a machine
# without torch it installs the CPU build 2.13.0, so no multi-GB CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
# the installed torch is a constraint: nothing the extras pull may replace it
TORCH_PIN="torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
"$PY" -m pip install --quiet -c <(echo "$TORCH_PIN") -e ".[test,models]"
if ! "$PY" -c "import torchvision" >/dev/null 2>&1; then
    # The registry's torchvision wheels link against CUDA torch: beside a CPU torch their
    # compiled ops do not load and `import torchvision` fails (torchvision::nms). torchvision
    # 0.16.2 imports without its compiled ops (they stay unloaded; its models do not use them).
    echo "install.sh: torchvision does not import beside $TORCH_PIN; using torchvision 0.16.2" \
         "(models only, no compiled ops)" >&2
    "$PY" -m pip install --quiet --no-deps --force-reinstall "torchvision==0.16.2"
fi
