#!/usr/bin/env bash
# Refresh constraints.txt, the exact versions of every dependency the tests last passed with
# (torch excepted: scripts/torch_choice.sh picks its build). Rebuilds .venv from pyproject.toml's
# ranges alone (the newest releases they admit), runs every test on it, and writes the lock only
# when they pass; commit constraints.txt with what the run printed. scripts/bootstrap.sh, the
# images (docker/) and CI install with `-c constraints.txt`, so a new release upstream changes
# nothing until this script has been run and its result committed.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv
KVGATE_UNPINNED=1 bash scripts/test.sh
{
  echo "# The exact versions the tests last passed with (scripts/lock.sh writes this file; torch excepted:"
  echo "# scripts/torch_choice.sh picks its build). Installed with pip's -c by scripts/bootstrap.sh and docker/*."
  .venv/bin/python -m pip freeze --exclude-editable --disable-pip-version-check | grep -v -E '^(torch|kvgate)=='
} >constraints.txt
echo "kvgate: constraints.txt written ($(grep -vc '^#' constraints.txt) pins); commit it"
