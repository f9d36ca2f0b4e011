#!/usr/bin/env bash
# Tools the tests use beyond Python: Debian's docker-compose (validates docker-compose.yml without a
# Docker engine), the pinned helm binary (scripts/ensure_helm.sh, for tests/test_helm.py) and
# LiteLLM's SDK (tests/test_client_litellm.py) in a virtualenv of its own, .venv-litellm, the one
# bench/gateway.py runs LiteLLM from: litellm needs huggingface-hub<2 and kvgate's pinned
# transformers >=2.4, so it cannot join .venv. Installed when missing; says so and carries on when it cannot.
set -uo pipefail
LITELLM_VERSION=1.108.7
if ! command -v docker-compose >/dev/null 2>&1; then
  echo "tools: docker-compose is missing; installing Debian's package with apt-get"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose; } >/dev/null 2>&1; then
    echo "tools: could not install docker-compose; tests/test_compose.py will say so" >&2
  fi
fi
if ! bash "$(dirname "$0")/ensure_helm.sh"; then
  echo "tools: could not install helm; tests/test_helm.py will say so" >&2
fi
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LITELLM_VENV="$ROOT/.venv-litellm"
# its dependencies pinned as the tests last passed with (scripts/lock.sh), unless KVGATE_UNPINNED is set
LITELLM_PIN=()
[ -z "${KVGATE_UNPINNED:-}" ] && [ -f "$ROOT/constraints-litellm.txt" ] && LITELLM_PIN=(-c "$ROOT/constraints-litellm.txt")
if ! "$LITELLM_VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('litellm') != '$LITELLM_VERSION')" >/dev/null 2>&1; then
  echo "tools: installing litellm $LITELLM_VERSION into .venv-litellm"
  PY=${PYTHON:-python3.11}
  command -v "$PY" >/dev/null 2>&1 || PY=python3
  if ! out=$({ [ -x "$LITELLM_VENV/bin/python" ] || "$PY" -m venv "$LITELLM_VENV"; } 2>&1 \
    && "$LITELLM_VENV/bin/python" -m pip install --disable-pip-version-check -q "${LITELLM_PIN[@]}" "litellm==$LITELLM_VERSION" 2>&1); then
    echo "tools: could not install litellm $LITELLM_VERSION; tests/test_client_litellm.py will say so:" >&2
    echo "$out" | tail -n 20 >&2
  fi
fi
exit 0
