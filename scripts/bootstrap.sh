#!/usr/bin/env bash
# Create .venv and install kvgate with every extra. Installs torch==2.13.0 first when the venv
# has no torch (the `backend` extra's range admits it, so pip then adds nothing): the CPU build
# unless KVGATE_TORCH=cuda, chosen and announced by scripts/torch_choice.sh (docs/demo.md). pip's output goes
# to .venv/install.log and is shown only when a step fails. Every package is held to the version in
# constraints.txt (the set the tests last passed with; scripts/lock.sh refreshes it), so a release
# upstream cannot change a fresh install; KVGATE_UNPINNED=1 installs the newest that pyproject.toml's
# ranges admit instead. A second run with pyproject.toml and constraints.txt unchanged skips the
# install (stamp: .venv/.kvgate-installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
LOG=.venv/install.log

step() {  # step "what" cmd...: run quietly, show the log on failure
  local what=$1; shift
  if ! "$@" >>"$LOG" 2>&1; then
    echo "kvgate: $what failed; pip's output:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}

if [ ! -x .venv/bin/python ]; then
  echo "kvgate: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
PIN=(-c constraints.txt)
[ "${KVGATE_UNPINNED:-}" = 1 ] && PIN=()
STAMP=.venv/.kvgate-installed
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt constraints.txt ] && .venv/bin/python -c "import torch, gateway" >/dev/null 2>&1; then
  exit 0
fi
: >"$LOG"
step "upgrading pip" .venv/bin/python -m pip install --disable-pip-version-check --upgrade pip
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # shellcheck source=scripts/torch_choice.sh
  . scripts/torch_choice.sh
  choose_torch .venv/bin/python || exit 1
  step "installing torch" .venv/bin/python -m pip install --disable-pip-version-check "${PIN[@]}" "${TORCH_PIP_ARGS[@]}"
fi
echo "kvgate: installing kvgate[backend,hf,dev] (editable) into .venv${PIN[*]:+, versions from constraints.txt} (a first run: 1-2 min, quiet until done)"
step "installing kvgate" .venv/bin/python -m pip install --disable-pip-version-check "${PIN[@]}" -e ".[backend,hf,dev]"
touch "$STAMP"
