#!/usr/bin/env bash
# PgBouncer in transaction pooling mode in front of the local PostgreSQL, for the `pooler` tests
# and the benchmark's PgBouncer row.
#
#   scripts/pgbouncer.sh start     install Debian's pgbouncer if missing, start it, wait until it
#                                  answers; exits 0 once it does (and at once if it already runs)
#   scripts/pgbouncer.sh stop      stop the PgBouncer this script started
#   scripts/pgbouncer.sh status    exit 0 if it answers, 1 if not
#
# It listens on 127.0.0.1:${PGBOUNCER_PORT:-6432} and forwards every database (`* =`) to
# ${PGBOUNCER_UPSTREAM_HOST:-127.0.0.1}:${PGBOUNCER_UPSTREAM_PORT:-5432}, user postgres, trust
# authentication. Its configuration, pid file and log live in ${PGBOUNCER_DIR:-/tmp/pgbouncer-run}.
# Then: DATABASE_URL=postgres://postgres@127.0.0.1:6432/postgres TEST_DB_BACKEND=postgres
#       PGBOUNCER=1 python -m pytest -m pooler
#
# Debian 12's pgbouncer is 1.18: in transaction mode it does not support protocol-level
# prepared statements (that came in 1.21), which is what this setup is meant to prove the app
# does without.
set -euo pipefail

PORT="${PGBOUNCER_PORT:-6432}"
UPSTREAM_HOST="${PGBOUNCER_UPSTREAM_HOST:-127.0.0.1}"
UPSTREAM_PORT="${PGBOUNCER_UPSTREAM_PORT:-5432}"
RUN_DIR="${PGBOUNCER_DIR:-/tmp/pgbouncer-run}"
INI="$RUN_DIR/pgbouncer.ini"
PIDFILE="$RUN_DIR/pgbouncer.pid"
LOG="$RUN_DIR/pgbouncer.log"
RUN_AS="${PGBOUNCER_USER:-postgres}"  # pgbouncer refuses to run as root

answers() {
  python3 - "$PORT" <<'PY'
import socket, struct, sys

# A StartupMessage for user postgres, database pgbouncer (the admin console): any reply (an
# AuthenticationOk 'R', or an ErrorResponse 'E') means PgBouncer is up and speaking the protocol.
port = int(sys.argv[1])
body = struct.pack("!I", 196608) + b"user\0postgres\0database\0pgbouncer\0\0"
try:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(struct.pack("!I", len(body) + 4) + body)
        reply = sock.recv(1)
except OSError:
    sys.exit(1)
sys.exit(0 if reply in (b"R", b"E") else 1)
PY
}

install() {
  if command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]; then
    return
  fi
  echo "== installing pgbouncer (apt-get)"
  if [ "$(id -u)" -eq 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y pgbouncer >/dev/null \
      || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y pgbouncer >/dev/null; }
  else
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y pgbouncer >/dev/null
  fi
}

binary() {
  command -v pgbouncer 2>/dev/null || echo /usr/sbin/pgbouncer
}

write_config() {
  mkdir -p "$RUN_DIR"
  cat >"$INI" <<EOF
[databases]
* = host=$UPSTREAM_HOST port=$UPSTREAM_PORT

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PORT
unix_socket_dir =
auth_type = trust
auth_file = $RUN_DIR/userlist.txt
admin_users = postgres
pool_mode = transaction
max_client_conn = 500
default_pool_size = 40
max_db_connections = 60
server_reset_query =
ignore_startup_parameters = extra_float_digits,options
logfile = $LOG
pidfile = $PIDFILE
EOF
  echo '"postgres" ""' >"$RUN_DIR/userlist.txt"
  if [ "$(id -u)" -eq 0 ]; then
    chown -R "$RUN_AS" "$RUN_DIR"
  fi
}

start() {
  if answers; then
    echo "pgbouncer already answers on 127.0.0.1:$PORT"
    return 0
  fi
  install
  write_config
  local cmd=("$(binary)" -d "$INI")
  if [ "$(id -u)" -eq 0 ]; then
    cmd=("$(binary)" -d -u "$RUN_AS" "$INI")
  fi
  "${cmd[@]}"
  for _ in $(seq 1 50); do
    if answers; then
      echo "pgbouncer $(pgbouncer_version) answers on 127.0.0.1:$PORT (transaction pooling -> $UPSTREAM_HOST:$UPSTREAM_PORT)"
      return 0
    fi
    sleep 0.2
  done
  echo "pgbouncer did not answer on 127.0.0.1:$PORT; its log ($LOG):" >&2
  tail -20 "$LOG" >&2 || true
  return 1
}

pgbouncer_version() {
  "$(binary)" --version | head -1 | awk '{print $2}'
}

stop() {
  if [ -f "$PIDFILE" ]; then
    local pid
    pid="$(cat "$PIDFILE")"
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid"
      for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
    fi
    rm -f "$PIDFILE"
    echo "pgbouncer stopped"
  else
    echo "no pgbouncer started by this script ($PIDFILE missing)"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status)
    if answers; then echo "pgbouncer answers on 127.0.0.1:$PORT"; else echo "pgbouncer does not answer on 127.0.0.1:$PORT"; exit 1; fi
    ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
