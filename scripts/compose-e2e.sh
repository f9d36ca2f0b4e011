#!/usr/bin/env bash
# docker-compose.yml under a real Docker engine, as a new user runs it: build both images, `up`, wait
# for every health check, read the generated key, check /v1/models, a prompt at the context limit (200)
# and one token over it (400 context_length_exceeded), a streamed chat, /metrics; a second gateway in
# a container of its own (another host on the compose network) sharing Redis and the state volume,
# and one tenant's RPM window enforced across both; restart the gateway and check the same key still
# works; `down -v`. Prints its total time; exits non-zero on any failure.
#
# Works on a fresh Debian machine with no image registry: installs docker.io, docker-compose and
# debootstrap when missing, starts its own dockerd (own data root, exec root, pidfile and socket; stopped
# on exit), and builds stand-ins for the base images the Dockerfiles and the compose file name from
# Debian's packages (docs/deployment.md, "Compose stack"). Cache (rootfs tarballs, the torch wheel):
# .compose-e2e/ (KVGATE_E2E_CACHE). KVGATE_E2E_DATA_ROOT keeps the engine's data root (images, build
# cache) in that folder across runs instead of a fresh one each run. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$(date +%s)
CACHE=${KVGATE_E2E_CACHE:-$ROOT/.compose-e2e}
SUITE=${KVGATE_E2E_SUITE:-bookworm}
MIRROR=${KVGATE_E2E_MIRROR:-}  # empty: debootstrap's default Debian mirror
ROOTFS_RECIPE=1  # bump when the stand-ins' recipe changes: cached tarballs are named after it
# the classic builder: `docker build --network host` reaches the package registries from a RUN step
export DOCKER_BUILDKIT=0

say() { printf 'compose-e2e: %s\n' "$*"; }
die() { say "FAILED: $*" >&2; exit 1; }
phase() { say "[$(($(date +%s) - T0))s] $*"; }

[ "$(id -u)" = 0 ] || die "needs root (it installs packages and starts dockerd)"

# The names the project uses: base image of both Dockerfiles, the Redis image, the two kvgate images.
base_of() { sed -n 's/^FROM[[:space:]]\+\([^[:space:]]\+\).*/\1/p' "$1" | head -n1; }
PY_IMAGE=$(base_of docker/backend.Dockerfile)
[ "$PY_IMAGE" = "$(base_of docker/gateway.Dockerfile)" ] || die "the Dockerfiles name different base images"
image_of() { sed -n "s/^[[:space:]]*image:[[:space:]]*\\($1[^[:space:]]*\\).*/\\1/p" docker-compose.yml | head -n1; }
REDIS_IMAGE=$(image_of redis)
BACKEND_IMAGE=$(image_of kvgate-backend)
GATEWAY_IMAGE=$(image_of kvgate-gateway)
TORCH_SPEC=$(sed -n 's/^ARG TORCH_SPEC="\(.*\)"/\1/p' docker/backend.Dockerfile)
[ -n "$PY_IMAGE" ] && [ -n "$REDIS_IMAGE" ] && [ -n "$BACKEND_IMAGE" ] && [ -n "$GATEWAY_IMAGE" ] \
  && [ -n "$TORCH_SPEC" ] || die "could not read the image names from docker/ and docker-compose.yml"

# --- tools --------------------------------------------------------------------------------------
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v python3 >/dev/null 2>&1 || need+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
if [ ${#need[@]} -gt 0 ]; then
  phase "installing ${need[*]} with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 "${need[@]}" >/dev/null
fi
PY=$(command -v python3) || die "python3 is missing"

# --- our own dockerd ----------------------------------------------------------------------------
RUN=$(mktemp -d /tmp/kvgate-e2e.XXXXXX)  # short: unix socket paths are limited to 108 bytes
export DOCKER_HOST="unix://$RUN/docker.sock"
INDEX_PID="" STACK_UP=0 GW2=kvgate-e2e-gateway-2
cleanup() {
  local rc=$?
  set +e
  if [ "$STACK_UP" = 1 ]; then
    if [ "$rc" != 0 ]; then
      docker-compose logs --no-color --tail=40 >&2
      docker-compose ps >&2
    fi
    docker rm -f "$GW2" >/dev/null 2>&1
    docker-compose down -v --remove-orphans >/dev/null 2>&1
  fi
  [ -n "$INDEX_PID" ] && kill "$INDEX_PID" 2>/dev/null
  if [ -f "$RUN/docker.pid" ]; then
    local pid
    pid=$(cat "$RUN/docker.pid")
    kill "$pid" 2>/dev/null
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null
  fi
  [ "$rc" = 0 ] || { say "dockerd's last lines:" >&2; tail -n 20 "$RUN/dockerd.log" >&2; }
  grep -o " $RUN/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
  rm -rf "$RUN"
  say "total $(($(date +%s) - T0))s ($([ "$rc" = 0 ] && echo passed || echo "FAILED, exit $rc"))"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

DATA_ROOT=${KVGATE_E2E_DATA_ROOT:-$RUN/data}
phase "starting dockerd (data root $DATA_ROOT)"
# --bridge none: no docker0 (compose makes its own network), so another engine on the host is untouched
dockerd --data-root "$DATA_ROOT" --exec-root "$RUN/exec" --pidfile "$RUN/docker.pid" \
  -H "$DOCKER_HOST" --bridge none >"$RUN/dockerd.log" 2>&1 &
for _ in $(seq 1 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
docker info >/dev/null 2>&1 || die "dockerd did not answer on $DOCKER_HOST"

# --- stand-in base images -----------------------------------------------------------------------
mkdir -p "$CACHE"
# rootfs NAME PACKAGES: a cached Debian minbase tarball with PACKAGES, built with debootstrap once
rootfs() {
  local tarball="$CACHE/$1-$SUITE-r$ROOTFS_RECIPE.tar" dir="$RUN/rootfs-$1"
  if [ ! -s "$tarball" ]; then
    phase "debootstrap $SUITE minbase + $2 (cached as $tarball)"
    debootstrap --variant=minbase --include="$2" "$SUITE" "$dir" ${MIRROR:+"$MIRROR"} >"$RUN/debootstrap-$1.log" 2>&1 \
      || { tail -n 20 "$RUN/debootstrap-$1.log" >&2; die "debootstrap $1 failed"; }
    rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
    if [ "$1" = python ]; then  # what the python image gives: `python` and `pip`, pip installs system-wide
      ln -sf /usr/bin/python3 "$dir/usr/local/bin/python"
      ln -sf /usr/bin/pip3 "$dir/usr/local/bin/pip"
      rm -f "$dir"/usr/lib/python3*/EXTERNALLY-MANAGED
    fi
    tar -C "$dir" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$dir"
  fi
}
# import NAME TAG CMD: the cached tarball, trusting this host's CA bundle (a TLS-inspecting proxy
# in front of the package registries then works), imported as TAG
import_standin() {
  local dir="$RUN/import-$1"
  docker image inspect "$2" >/dev/null 2>&1 && return 0  # a kept data root (KVGATE_E2E_DATA_ROOT) has it
  mkdir -p "$dir" && tar -C "$dir" -xf "$CACHE/$1-$SUITE-r$ROOTFS_RECIPE.tar"
  if [ -d "$dir/etc/ssl/certs" ] && [ -s /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$dir/etc/ssl/certs/"
  fi
  tar -C "$dir" -c . | docker import --change "ENV LANG=C.UTF-8" --change "CMD [\"$3\"]" - "$2" >/dev/null
  rm -rf "$dir"
  say "stand-in $2: Debian $SUITE $1 ($(docker image inspect -f '{{.Size}}' "$2" | awk '{printf "%d MB", $1/1e6}'))"
}
rootfs python python3,python3-pip,python3-venv,ca-certificates &
PY_JOB=$!
rootfs redis redis-server &
REDIS_JOB=$!
wait "$PY_JOB" || die "the python stand-in failed"
wait "$REDIS_JOB" || die "the redis stand-in failed"
phase "docker import the stand-ins"
import_standin python "$PY_IMAGE" python3
import_standin redis "$REDIS_IMAGE" redis-server

# --- torch: the local CPU wheel from a one-package index on 127.0.0.1 ---------------------------
# (KVGATE_E2E_TORCH_INDEX_URL, e.g. a CPU wheel index, is passed to the build instead)
torch_index() {
  local wheels="$CACHE/torch-index" wheel
  if ! ls "$wheels"/torch-*.whl >/dev/null 2>&1; then
    phase "pip download $TORCH_SPEC"
    mkdir -p "$wheels"
    "$PY" -m pip download -q "$TORCH_SPEC" --no-deps -d "$wheels" || die "pip download $TORCH_SPEC failed"
  fi
  wheel=$(basename "$(ls "$wheels"/torch-*.whl | head -n1)")
  mkdir -p "$wheels/simple/torch"
  printf '<!DOCTYPE html><html><body><a href="../../%s">%s</a></body></html>\n' \
    "${wheel//+/%2B}" "$wheel" >"$wheels/simple/torch/index.html"
  INDEX_PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$PY" -m http.server --bind 127.0.0.1 --directory "$wheels" "$INDEX_PORT" >"$RUN/index.log" 2>&1 &
  INDEX_PID=$!
  for _ in $(seq 1 50); do curl -fs "http://127.0.0.1:$INDEX_PORT/simple/torch/" >/dev/null && break; sleep 0.1; done
  say "torch index: $wheel on 127.0.0.1:$INDEX_PORT"
  TORCH_INDEX_URL="http://127.0.0.1:$INDEX_PORT/simple"
}
TORCH_INDEX_URL=${KVGATE_E2E_TORCH_INDEX_URL:-}
[ -n "$TORCH_INDEX_URL" ] || torch_index

# --- images and the stack -----------------------------------------------------------------------
# build NAME DOCKERFILE [ARGS...]: docker build --network host, its output shown only on failure
build() {
  phase "docker build $1"
  docker build --network host -f "$2" -t "$1" "${@:3}" . >"$RUN/build.log" 2>&1 \
    || { tail -n 40 "$RUN/build.log" >&2; die "docker build $1 failed"; }
}
build "$GATEWAY_IMAGE" docker/gateway.Dockerfile
build "$BACKEND_IMAGE" docker/backend.Dockerfile --build-arg "PIP_EXTRA_INDEX_URL=$TORCH_INDEX_URL"
[ -z "$INDEX_PID" ] || { kill "$INDEX_PID"; INDEX_PID=""; }
docker run --rm --entrypoint python "$BACKEND_IMAGE" -c 'import torch; print("torch", torch.__version__)'

PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export KVGATE_PUBLISH_PORT=$PORT
phase "docker-compose up -d (gateway on 127.0.0.1:$PORT)"
STACK_UP=1
docker-compose up -d --no-build

# healthy SECONDS: every container of the project healthy within SECONDS
healthy() {
  local deadline=$(($(date +%s) + $1)) ids states
  while :; do
    ids=$(docker-compose ps -q)
    states=$(for id in $ids; do docker inspect -f '{{.Name}} {{.State.Health.Status}}' "$id"; done)
    if ! grep -qv ' healthy$' <<<"$states"; then
      say "healthy: $(awk '{printf "%s ", substr($1, 2)}' <<<"$states")"
      return 0
    fi
    [ "$(date +%s)" -lt "$deadline" ] || { echo "$states" >&2; die "not every service turned healthy"; }
    sleep 2
  done
}
# published SECONDS: the gateway's /readyz answers through the published port within SECONDS
published() {
  local tries=0
  until curl -fs -m 5 -o /dev/null "http://127.0.0.1:$PORT/readyz"; do
    tries=$((tries + 1))
    [ "$tries" -lt "$1" ] || die "127.0.0.1:$PORT does not answer though the gateway is healthy"
    sleep 1
  done
  [ "$tries" = 0 ] || say "127.0.0.1:$PORT answered after $tries retries"
}
healthy 600
published 60
KEY=$(docker-compose exec -T gateway cat /var/lib/kvgate/state/default.key | tr -d '\r\n')
[[ "$KEY" == sk-kvg-* ]] || die "no generated key in the gateway's state volume"
phase "checks through 127.0.0.1:$PORT"
BASE="http://127.0.0.1:$PORT" KEY="$KEY" "$PY" scripts/compose_e2e_checks.py full

phase "a second gateway host: its own container and address, sharing Redis and the state volume"
RPM_KEY=$(docker-compose exec -T gateway kvgate tenant add e2e-replicas --rpm 4 | tr -d '\r\n')
[[ "$RPM_KEY" == sk-kvg-* ]] || die "kvgate tenant add printed no key"
docker-compose run -d --no-deps --name "$GW2" gateway >/dev/null
tries=0
until docker-compose exec -T gateway python -c \
  "import urllib.request; urllib.request.urlopen('http://$GW2:8080/readyz', timeout=2)" >/dev/null 2>&1; do
  tries=$((tries + 1))
  [ "$tries" -lt 120 ] || { docker logs --tail 40 "$GW2" >&2; die "$GW2 is not ready after 120 tries"; }
  sleep 1
done
say "$GW2 ready after $tries retries"
docker-compose exec -T -e BASE=http://127.0.0.1:8080 -e BASE2="http://$GW2:8080" -e KEY="$RPM_KEY" \
  gateway python - replicas <scripts/compose_e2e_checks.py
docker rm -f "$GW2" >/dev/null

phase "docker-compose restart gateway"
docker-compose restart gateway >/dev/null
healthy 300
published 60
AGAIN=$(docker-compose exec -T gateway cat /var/lib/kvgate/state/default.key | tr -d '\r\n')
[ "$AGAIN" = "$KEY" ] || die "the gateway's key changed across a restart"
BASE="http://127.0.0.1:$PORT" KEY="$KEY" "$PY" scripts/compose_e2e_checks.py key

phase "docker-compose down -v"
docker-compose down -v --remove-orphans >/dev/null 2>&1
STACK_UP=0
[ -z "$(docker volume ls -q)$(docker-compose ps -q)" ] || die "containers or volumes left after down -v"
