#!/usr/bin/env bash
# Every benchmark, side by side, against PostgreSQL at 127.0.0.1:5432 (make bench).
#
#   scripts/bench.sh [options]      e.g. scripts/bench.sh --rounds 5 --seconds 6
#                                   scripts/bench.sh --help
#
# Creates its own environment, bench/.venv, with this package (editable) and the competitor
# libraries (the "bench" extra in setup.cfg), so they never reach the test environment. Creates
# and drops its own databases (idempotency_bench_*), prints a table and writes
# bench/results/results.json. Redis (127.0.0.1:6379, database 13) backs django-idempotency-key.
#
# Environment: BENCH_PG_URL (default postgres://postgres@127.0.0.1:5432/postgres),
#              BENCH_REDIS_URL (default redis://127.0.0.1:6379/13), PYTHON (default python3),
#              BENCH_OUTBOX=0 to leave out the outbox relay's throughput (bench/outbox.py),
#              BENCH_GROWTH=0 to leave out the growth bench (bench/growth.py: the claim, purge,
#              admin and status beside big tables; here 1,000,000 rows per table, about 2 min,
#              or BENCH_GROWTH_ROWS; the documented run used its default, 10,000,000).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
venv=bench/.venv

if [ ! -x "$venv/bin/python" ]; then
  echo "== creating $venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
fi

scripts/mariadb-headers.sh

stamp="$venv/.installed"
want="$(sha256sum setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "== installing django-idempotency[bench,postgres,mysql] (editable) and the competitors into $venv"
  "$venv/bin/python" -m pip install -q -e ".[bench,postgres,mysql]" 2> >(grep -v "is ignored" >&2)
  echo "$want" > "$stamp"
fi

export PYTHONDONTWRITEBYTECODE=1
# The in-process section's PgBouncer row needs PgBouncer in transaction mode: start it (installing
# Debian's package if needed) unless it already runs, and stop it afterwards if we started it.
started_pgbouncer=0
if ! scripts/pgbouncer.sh status >/dev/null 2>&1; then
  if scripts/pgbouncer.sh start; then
    started_pgbouncer=1
  else
    echo "!! PgBouncer could not be started: the in-process PgBouncer row will fail" >&2
  fi
fi
status=0
"$venv/bin/python" -m bench "$@" || status=$?
# The outbox relay's throughput, old path and new side by side (bench/outbox.py), on PostgreSQL
# with Redis and RabbitMQ; skipped with BENCH_OUTBOX=0.
if [ "${BENCH_OUTBOX:-1}" != 0 ]; then
  pg="${BENCH_PG_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
  outbox=(--only relay,kafka --database-url "${pg%/*}/idempotency_bench_outbox"
          --output bench/results/outbox.json --charts docs/assets/benchmarks)
  for arg in "$@"; do if [ "$arg" = --quick ]; then outbox+=(--quick); fi; done
  "$venv/bin/python" -m bench.outbox "${outbox[@]}" || status=$?
fi
# The claim, the purge, the admin and idempotency_status beside big tables (bench/growth.py).
if [ "${BENCH_GROWTH:-1}" != 0 ]; then
  growth=(--rows "${BENCH_GROWTH_ROWS:-1000000}")
  for arg in "$@"; do if [ "$arg" = --quick ]; then growth=(--quick); fi; done
  "$venv/bin/python" -m bench.growth "${growth[@]}" || status=$?
fi
if [ "$started_pgbouncer" = 1 ]; then scripts/pgbouncer.sh stop; fi
exit "$status"
