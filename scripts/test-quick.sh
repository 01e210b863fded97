#!/usr/bin/env bash
# The loop between two edits (make test-quick): ruff, then the quick tests (no race, crash,
# worker or browser test) of the .venv's Django and Python on SQLite and PostgreSQL, side by
# side, each in WORKERS pytest-xdist workers (default 2; 1: one process each), in at most three
# minutes on two cores. It starts no service: the full suite, MariaDB, PgBouncer, the version
# matrix, the wheel and the docs build are `make test`'s. PostgreSQL down: its pass is skipped,
# loudly.
#
# It installs only what it lacks, once: when the .venv has no ruff, pytest, pytest-xdist or
# psycopg (a fresh checkout, or the .venv `make demo` made with the demo extra alone), it runs
# `scripts/bootstrap.sh dev,postgres` first and says so. Printing that command instead would
# leave a newcomer one more step from a green run; installing every time would cost each run
# pip's resolution. A .venv that has them (after `make test`, say) is used as it is: no pip.
#
#   scripts/test-quick.sh [pytest args]     e.g. scripts/test-quick.sh tests/test_outbox.py -x
set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

has_tools() {
  [ -x .venv/bin/python ] && [ -x .venv/bin/ruff ] \
    && .venv/bin/python -c "import pytest, pytest_django, xdist, psycopg" 2>/dev/null
}
if ! has_tools; then
  echo "== the .venv lacks the test tools (ruff, pytest, pytest-xdist, psycopg): installing them"
  echo "   once with: scripts/bootstrap.sh dev,postgres"
  scripts/bootstrap.sh dev,postgres || { echo "!! scripts/bootstrap.sh dev,postgres failed" >&2; exit 1; }
  has_tools || { echo "!! still no ruff/pytest/psycopg in .venv after bootstrapping" >&2; exit 1; }
  echo "   installed in $(( $(date +%s) - started ))s"
fi
# shellcheck disable=SC1091
source .venv/bin/activate
export DJANGO_SETTINGS_MODULE=testproject.settings PYTHONDONTWRITEBYTECODE=1

echo "== ruff"
ruff check . || exit 1
ruff format --check . || { echo "!! run: .venv/bin/ruff format ." >&2; exit 1; }

python -c "import django, sys; print('== quick tests: Django', django.__version__, 'on Python', sys.version.split()[0])"
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
backends=(sqlite)
if python tests/services.py postgres | grep -q " up$"; then
  backends+=(postgres)
else
  echo "!!!! PostgreSQL at 127.0.0.1:5432 is UNREACHABLE: its quick pass is SKIPPED !!!!"
fi
declare -A url=([sqlite]="" [postgres]="postgres://postgres@127.0.0.1:5432/postgres")
# WORKERS pytest-xdist workers per pass (whole files each): the quick tests' time is mostly
# spent waiting on Kafka group joins, broker timeouts and subprocesses, which overlap.
xdist=()
if [ "${WORKERS:-2}" -gt 1 ]; then
  if python -c "import xdist" 2>/dev/null; then
    xdist=(-n "${WORKERS:-2}" --dist loadfile)
  else
    echo "!! pytest-xdist is not in .venv (scripts/bootstrap.sh dev installs it): one process per pass"
  fi
fi
pids=()
for backend in "${backends[@]}"; do
  DATABASE_URL="${url[$backend]}" TEST_DB_BACKEND="$backend" TEST_DB_SUFFIX="${TEST_DB_SUFFIX:-}_quick" \
    python -m pytest -q -p no:cacheprovider -m "not slow" -W error::DeprecationWarning \
    "${xdist[@]}" "$@" > "$reports/$backend.log" 2>&1 &
  pids+=($!)
done
code=0
for i in "${!backends[@]}"; do
  wait "${pids[$i]}"; status=$?
  # exit 5 (nothing selected) fails the loop, unless a selection of yours made it so
  if [ $status != 0 ] && ! { [ $status = 5 ] && [ $# -gt 0 ]; }; then code=1; fi
  echo; echo "----- ${backends[$i]} (exit $status) -----"
  tail -n 25 "$reports/${backends[$i]}.log"
done
echo
echo "== test-quick: $([ $code = 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - started ))s"
exit $code
