#!/usr/bin/env bash
# Tools the tests use beyond Python: Debian's docker-compose (validates docker-compose.yml without a
# Docker engine) and the pinned helm binary (scripts/ensure_helm.sh, for
# tests/test_helm.py). Installed when missing; says so and carries on when it cannot.
set -uo pipefail
if ! command -v docker-compose >/dev/null 2>&1; then
  echo "tools: docker-compose is missing; installing Debian's package with apt-get"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose; } >/dev/null 2>&1; then
    echo "tools: could not install docker-compose; tests/test_compose.py will say so" >&2
  fi
fi
if ! bash "$(dirname "$0")/ensure_helm.sh"; then
  echo "tools: could not install helm; tests/test_helm.py will say so" >&2
fi
exit 0
