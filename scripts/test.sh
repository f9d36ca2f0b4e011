#!/usr/bin/env bash
# Install everything into .venv, check format, lint and types (scripts/lint.sh), make sure Redis
# answers, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/lint.sh
bash scripts/ensure_redis.sh
bash scripts/ensure_tools.sh
exec .venv/bin/python -m pytest -q "$@"
