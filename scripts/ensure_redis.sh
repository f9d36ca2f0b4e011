#!/usr/bin/env bash
# Make sure a Redis server answers on 127.0.0.1:6379: start one if none does, installing
# redis-server with apt-get when it is missing. Exits non-zero, saying why, when it cannot.
set -uo pipefail
HOST=127.0.0.1
PORT=${KVGATE_TEST_REDIS_PORT:-6379}

ping() {
  exec 3<>"/dev/tcp/$HOST/$PORT" 2>/dev/null || return 1
  printf 'PING\r\n' >&3
  local line=""
  read -r -t 2 line <&3 || true
  exec 3<&- 3>&-
  [[ "$line" == "+PONG"* ]]
}

ping && { echo "redis: answering on $HOST:$PORT"; exit 0; }
if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis: redis-server is missing; installing it with apt-get"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; } >/dev/null 2>&1; then
    echo "redis: could not install redis-server with apt-get; install Redis and start it on $HOST:$PORT" >&2
    exit 1
  fi
fi
echo "redis: starting redis-server on $HOST:$PORT"
redis-server --daemonize yes --bind "$HOST" --port "$PORT" --save "" --appendonly no >/dev/null
for _ in $(seq 1 50); do ping && { echo "redis: answering on $HOST:$PORT"; exit 0; }; sleep 0.1; done
echo "redis: started redis-server but it does not answer on $HOST:$PORT" >&2
exit 1
