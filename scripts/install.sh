#!/usr/bin/env bash
# Installs pdcompile with its test tools and the optional real-model libraries (.[models]:
# torchvision, timm, transformers), then checks that every one of them imports
# (scripts/check_install.py; it fails loudly naming the library that does not). Keeps an existing
# torch (CUDA or CPU) as it is; on a machine without torch it installs the CPU build 2.13.0, so no
# multi-GB CUDA build is pulled. $PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
# the installed torch is a constraint: nothing the extras pull may replace it
TORCH_PIN="torch==$("$PY" -W ignore -c 'import torch; print(torch.__version__.split("+")[0])')"
"$PY" -m pip install --quiet -c <(echo "$TORCH_PIN") -e ".[test,models]"
if ! "$PY" -c "import torchvision" >/dev/null 2>&1; then
    # The registry's torchvision wheels link against CUDA torch: beside a CPU torch their
    # compiled ops do not load and `import torchvision` fails (torchvision::nms). torchvision
    # 0.16.2 imports without its compiled ops (they stay unloaded; its models do not use them).
    echo "install.sh: torchvision does not import beside $TORCH_PIN; using torchvision 0.16.2" \
         "(models only, no compiled ops; pip will say it asks for torch 2.1.2: expected)" >&2
    # --no-deps: its metadata pins torch 2.1.2, which must not replace the installed torch; its
    # other dependencies (numpy, requests, pillow), read from that metadata, are installed next
    "$PY" -m pip install --quiet --no-deps --force-reinstall "torchvision==0.16.2"
    mapfile -t TORCHVISION_DEPS < <("$PY" - <<'PYEOF'
import importlib.metadata
import re

for requirement in importlib.metadata.requires("torchvision") or []:
    if "extra ==" in requirement:
        continue
    requirement = requirement.replace("(", "").replace(")", "").replace(" ", "")
    if re.split(r"[;<>=!~\[]", requirement, maxsplit=1)[0].lower() != "torch":
        print(requirement)
PYEOF
)
    if ((${#TORCHVISION_DEPS[@]})); then
        "$PY" -m pip install --quiet -c <(echo "$TORCH_PIN") "${TORCHVISION_DEPS[@]}"
    fi
fi
# pyenv's shims learn of new console scripts (`pdcompile`, `torchrun`) only when rehashed
if command -v pyenv >/dev/null 2>&1; then
    pyenv rehash || true
fi
"$PY" scripts/check_install.py
