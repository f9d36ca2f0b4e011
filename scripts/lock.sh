#!/usr/bin/env bash
# Refresh constraints.txt, the exact versions of every dependency the tests last passed with
# (torch excepted: scripts/torch_choice.sh picks its build), and constraints-litellm.txt, those of
# .venv-litellm (scripts/ensure_tools.sh). Rebuilds both from the newest releases their ranges admit,
# runs every test on them, and writes the locks only when they pass; commit both with what the
# run printed. scripts/bootstrap.sh, the
# images (docker/) and CI install with `-c constraints.txt`, so a new release upstream changes
# nothing until this script has been run and its result committed.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv .venv-litellm
KVGATE_UNPINNED=1 bash scripts/test.sh
{
  echo "# The exact versions of LiteLLM's dependencies in .venv-litellm that the tests last passed with"
  echo "# (scripts/lock.sh writes this file). Installed with pip's -c by scripts/ensure_tools.sh."
  .venv-litellm/bin/python -m pip freeze --disable-pip-version-check
} >constraints-litellm.txt
{
  echo "# The exact versions the tests last passed with (scripts/lock.sh writes this file; torch excepted:"
  echo "# scripts/torch_choice.sh picks its build). Installed with pip's -c by scripts/bootstrap.sh and docker/*."
  .venv/bin/python -m pip freeze --exclude-editable --disable-pip-version-check | grep -v -E '^(torch|kvgate)=='
} >constraints.txt
echo "kvgate: constraints.txt ($(grep -vc '^#' constraints.txt) pins) and constraints-litellm.txt ($(grep -vc '^#' constraints-litellm.txt)) written; commit them"
