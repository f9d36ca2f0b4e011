#!/usr/bin/env bash
# Install everything into .venv and run the main job: the embedded stack on real input.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/kvgate demo "$@"
