#!/usr/bin/env bash
# Format, lint and type checks on the five packages (rules and settings in pyproject.toml:
# [tool.ruff], [tool.ruff.lint], [tool.mypy]). Exits non-zero, naming the check, on any finding.
# scripts/test.sh runs it before the tests; run it alone with `bash scripts/lint.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
PKGS=(config tokenizer gateway verifier gpu_backend)
fail() {
  echo "kvgate: $1 failed; $2" >&2
  exit 1
}
.venv/bin/ruff format --check --quiet "${PKGS[@]}" || fail "ruff format --check" "run: .venv/bin/ruff format ${PKGS[*]}"
.venv/bin/ruff check --quiet "${PKGS[@]}" || fail "ruff check" "fix the findings above (many: .venv/bin/ruff check --fix)"
.venv/bin/mypy || fail "mypy" "fix the type errors above"
