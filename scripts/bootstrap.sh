#!/usr/bin/env bash
# Create .venv and install kvgate with every extra. Installs torch==2.13.0 first when the venv
# has no torch (the `backend` extra's range admits it, so pip then adds nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "kvgate: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "kvgate: installing torch==2.13.0 (CPU build)"
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
fi
echo "kvgate: installing kvgate[backend,hf,dev] (editable)"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[backend,hf,dev]"
