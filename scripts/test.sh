#!/usr/bin/env bash
# Install everything into .venv, check format, lint and types (scripts/lint.sh), make sure Redis
# answers, run the whole test suite. Arguments go to pytest; the default -q is left out when they
# set the verbosity themselves (a second -q would hide pytest's summary line).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/lint.sh
bash scripts/ensure_redis.sh
bash scripts/ensure_tools.sh
verbosity=-q
for arg in "$@"; do
    case "$arg" in
        -q | -qq | -v | -vv | --quiet | --verbose) verbosity= ;;
    esac
done
exec .venv/bin/python -m pytest $verbosity "$@"
