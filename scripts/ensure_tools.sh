#!/usr/bin/env bash
# Tools the tests use beyond Python: Debian's docker-compose (validates docker-compose.yml without a
# Docker engine). Installed with apt-get when missing; says so and carries on when it cannot.
set -uo pipefail
if ! command -v docker-compose >/dev/null 2>&1; then
  echo "tools: docker-compose is missing; installing Debian's package with apt-get"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose; } >/dev/null 2>&1; then
    echo "tools: could not install docker-compose; tests/test_compose.py will say so" >&2
  fi
fi
exit 0
