# Which torch build scripts/bootstrap.sh installs (sourced; bash). `choose_torch PY` sets
# TORCH_PIP_ARGS (the arguments of `PY -m pip install` for it) and prints which build and why; it
# returns 1 with a message saying how to choose when no CPU build can be found. The CPU build is
# the default on every machine; the CUDA build only when asked:
#   KVGATE_TORCH=cpu|cuda        cuda: the CUDA build, as pip's index serves torch on Linux (several GB)
#   KVGATE_TORCH_INDEX_URL=URL   take torch from this index (a mirror), whatever its build
#   KVGATE_TORCH_CPU_INDEX=URL   the CPU wheel index tried when pip's own configuration offers no
#                                CPU build (default: PyTorch's, https://download.pytorch.org/whl/cpu)
#   KVGATE_TORCH_VERSION         default 2.13.0
# Every look-up is pip's own `install --dry-run --no-deps --report`: nothing is installed by it.

KVGATE_TORCH_VERSION=${KVGATE_TORCH_VERSION:-2.13.0}
KVGATE_TORCH_CPU_INDEX=${KVGATE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

_torch_probe() {  # _torch_probe PY [pip args...]: the torch version pip would install, or nothing
  local py=$1 report
  shift
  report=$(mktemp)
  if "$py" -m pip install --disable-pip-version-check --dry-run --no-deps --ignore-installed --quiet \
    --retries 0 --timeout 20 --report "$report" "$@" "torch==$KVGATE_TORCH_VERSION" >/dev/null 2>&1; then
    "$py" -c 'import json, sys; i = json.load(open(sys.argv[1]))["install"]; print(i[0]["metadata"]["version"] if i else "")' "$report"
  fi
  rm -f "$report"
}

_is_cpu_build() { [[ "$1" == *+cpu* ]]; }

choose_torch() {
  local py=$1 v w gpu=""
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && gpu=1
  case "${KVGATE_TORCH:-cpu}" in
    cuda)
      TORCH_PIP_ARGS=("torch==$KVGATE_TORCH_VERSION")
      echo "kvgate: torch $KVGATE_TORCH_VERSION: the CUDA build from pip's configured index (asked with KVGATE_TORCH=cuda)"
      return 0 ;;
    cpu) ;;
    *) echo "kvgate: KVGATE_TORCH must be 'cpu' or 'cuda' (got '$KVGATE_TORCH')" >&2; return 1 ;;
  esac
  if [ -n "${KVGATE_TORCH_INDEX_URL:-}" ]; then
    v=$(_torch_probe "$py" --index-url "$KVGATE_TORCH_INDEX_URL")
    if [ -z "$v" ]; then
      echo "kvgate: no torch==$KVGATE_TORCH_VERSION at KVGATE_TORCH_INDEX_URL=$KVGATE_TORCH_INDEX_URL" >&2
      return 1
    fi
    TORCH_PIP_ARGS=(--index-url "$KVGATE_TORCH_INDEX_URL" "torch==$v")
    echo "kvgate: torch $v from KVGATE_TORCH_INDEX_URL ($KVGATE_TORCH_INDEX_URL), as asked"
    return 0
  fi
  v=$(_torch_probe "$py")
  if _is_cpu_build "$v"; then
    TORCH_PIP_ARGS=("torch==$v")
    echo "kvgate: torch $v: the CPU build that pip's configuration offers (a local wheel or index)"
  else
    w=$(_torch_probe "$py" --index-url "$KVGATE_TORCH_CPU_INDEX")
    if ! _is_cpu_build "$w"; then
      echo "kvgate: no CPU build of torch==$KVGATE_TORCH_VERSION found: pip's configuration offers" \
        "${v:-no torch} (not a CPU build, so not taken) and $KVGATE_TORCH_CPU_INDEX could not be reached" \
        "or holds none. Choose one: KVGATE_TORCH_INDEX_URL=<an index with the CPU build> (a mirror of" \
        "the CPU wheel index), or KVGATE_TORCH=cuda for the CUDA build (several GB of nvidia-* wheels)." >&2
      return 1
    fi
    TORCH_PIP_ARGS=(--index-url "$KVGATE_TORCH_CPU_INDEX" "torch==$w")
    echo "kvgate: torch $w: the CPU build from PyTorch's CPU wheel index ($KVGATE_TORCH_CPU_INDEX);" \
      "pip's configuration offers ${v:-no torch}, not a CPU build"
  fi
  [ -z "$gpu" ] || echo "kvgate: a GPU is present (nvidia-smi); KVGATE_TORCH=cuda installs the CUDA build instead"
  return 0
}
