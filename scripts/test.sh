#!/usr/bin/env bash
# The whole test command: quality gates, then the test matrix (noxfile.py), then a summary table.
#
#   scripts/test.sh [pytest args]       (make test)
#
# The matrix (nox sessions, noxfile.py): the full suite (slow tests included) on SQLite,
# PostgreSQL and MariaDB side by side for the main combination, Django 6.1 on Python 3.13, with
# a pytest -m pooler pass through PgBouncer and a pytest -m second_broker pass against Tansu
# beside them; the quick suite on PostgreSQL for Django 6.0/3.12 and for 5.2/3.11, the oldest (every Django and
# every Python at least once); the quick suite on SQLite and PostgreSQL with every runtime
# dependency at its declared minimum ("lowest", 5.2/3.11); the built wheel installed bare and
# with each extra in fresh venvs ("install").
#
# Environment:
#   REQUIRE_SERVICES=1  an unreachable PostgreSQL, MariaDB, Redis or RabbitMQ fails the run
#                       instead of being skipped (.ci/run sets it).
#   QUICK=1             skip the tests marked slow (races, crashes, real workers, browser).
#   BACKENDS="sqlite postgres"   only these database passes (default: each combination's own).
#   SESSIONS="tests(6.1-py3.13) install"   only these nox sessions (default: all).
#   JOBS=2              lanes for the sessions beside the main one (1: one after the other).
#   WORKERS=N           pytest-xdist workers for each main pass (default: 2 for PostgreSQL and
#                       MariaDB, 1 for SQLite; 1: every pass in one process).
#   LANES_AFTER=1       run those lanes after the main combination instead of beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
REQUIRE_SERVICES="${REQUIRE_SERVICES:-0}"
export REQUIRE_SERVICES
started=$(date +%s)

fail() { echo; echo "!! FAILED: $*" >&2; exit 1; }
step() { echo; echo "== $*"; }

# PgBouncer (started by the pooler pass) is stopped when the command ends, unless it was already
# running; so is any helper a test starts (each test's fixture stops its own broker).
pgbouncer_was_up=0
scripts/pgbouncer.sh status >/dev/null 2>&1 && pgbouncer_was_up=1
cleanup() {
  if [ "$pgbouncer_was_up" = 0 ] && scripts/pgbouncer.sh status >/dev/null 2>&1; then
    echo "== stopping the PgBouncer this run started"
    scripts/pgbouncer.sh stop >/dev/null 2>&1 || echo "!! PgBouncer could not be stopped" >&2
  fi
}
trap cleanup EXIT

step "set-up"
scripts/bootstrap.sh dev,postgres,mysql,tasks || fail "set-up"
# shellcheck disable=SC1091
source .venv/bin/activate
export DJANGO_SETTINGS_MODULE=testproject.settings
export PYTHONDONTWRITEBYTECODE=1

step "services"
declare -A state
while read -r name status; do state[$name]=$status; done < <(python tests/services.py)
missing=()
for name in postgres mariadb redis rabbitmq; do
  echo "   $name: ${state[$name]}"
  [ "${state[$name]}" = up ] || missing+=("$name")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$REQUIRE_SERVICES" = 1 ]; then
    fail "REQUIRE_SERVICES=1 and unreachable: ${missing[*]}"
  fi
  echo
  echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
  echo "!! UNREACHABLE, tests that need them are SKIPPED: ${missing[*]}"
  echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
fi

step "ruff"
ruff check . || fail "ruff check"
ruff format --check . || fail "ruff format (run: .venv/bin/ruff format .)"

step "mypy"
mypy django_idempotency || fail "mypy"

step "migrations are up to date"
python manage.py makemigrations --check --dry-run || fail "makemigrations --check"

if [ -f mkdocs.yml ]; then
  step "docs (mkdocs build --strict)"
  # NO_MKDOCS_2_WARNING: Material's banner about its successor is not about this build.
  NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$(mktemp -d)" || fail "docs build"
fi

step "wheel holds the package, its migrations and templates, and no tests; release check"
wheel_dir=$(mktemp -d)
python -m pip wheel -q --no-deps -w "$wheel_dir" . 2> >(grep -v "is ignored: it is neither" >&2) \
  || fail "pip wheel"
python scripts/check_wheel.py "$wheel_dir"/django_idempotency-*.whl || fail "wheel contents"
# The sdist beside this wheel, twine check --strict on both, the wheel with Django only.
scripts/release-check.sh "$wheel_dir" || fail "release check (scripts/release-check.sh)"

# The browser test drives Debian's chromium (never a Playwright download); install it if we can.
if [ "${QUICK:-0}" != 1 ] && [ "$(id -u)" = 0 ] && [ ! -x /usr/bin/chromium ]; then
  step "chromium for the browser test"
  # On failure the browser test itself skips loudly, or fails under REQUIRE_SERVICES=1.
  scripts/install-chromium.sh || echo "!! chromium could not be installed: see the browser test"
fi

rm -rf .reports
mkdir -p .reports
if [ -n "${SESSIONS:-}" ]; then
  read -ra all_sessions <<< "$SESSIONS"
else
  mapfile -t all_sessions < <(nox -l --json | python -c \
    'import json, sys; print("\n".join(s["session"] for s in json.load(sys.stdin)))')
fi
main_session="tests(6.1-py3.13)"
rest=()
for name in "${all_sessions[@]}"; do [ "$name" = "$main_session" ] || rest+=("$name"); done
nox_code=0

# The other sessions (the version matrix, lowest, install) in JOBS parallel lanes, each with its
# own test databases and log. They start with the main combination and run beside it at the
# lowest CPU priority: the main combination's slow tests spend most of their time waiting on
# workers, brokers and sleeps, and the lanes' quick passes fill that time, while any test that
# needs the CPU gets it first (nice 19). Set LANES_AFTER=1 to run them after the main one.
JOBS="${JOBS:-2}"
pids=()
lanes=()
start_lanes() {
  [ ${#rest[@]} -gt 0 ] || return 0
  mapfile -t lanes < <(python -c '
import sys
sys.path.insert(0, ".")
import noxfile
for lane in noxfile.lanes(sys.argv[2:], int(sys.argv[1])):
    print(" ".join(lane))' "$JOBS" "${rest[@]}")
  step "the other sessions in ${#lanes[@]} lanes (JOBS=$JOBS), at nice 19"
  for i in "${!lanes[@]}"; do
    read -ra lane <<< "${lanes[$i]}"
    echo "   lane $((i + 1)): ${lane[*]}  (log: .reports/lane$((i + 1)).log)"
    TEST_DB_SUFFIX="${TEST_DB_SUFFIX:-}_lane$((i + 1))" \
      nice -n 19 nox -s "${lane[@]}" -- "$@" > ".reports/lane$((i + 1)).log" 2>&1 &
    pids+=($!)
  done
}

[ "${LANES_AFTER:-0}" = 1 ] || start_lanes "$@"
if [[ " ${all_sessions[*]} " == *" $main_session "* ]]; then
  step "the main combination, its backends side by side: nox -s $main_session"
  nox -s "$main_session" -- "$@" || nox_code=1
fi
[ "${LANES_AFTER:-0}" != 1 ] || start_lanes "$@"
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || nox_code=1
  step "lane $((i + 1)) output"
  cat ".reports/lane$((i + 1)).log"
done

echo
echo "================================ summary ================================"
python scripts/summary.py .reports
summary_code=$?
for name in redis rabbitmq; do
  [ "${state[$name]}" = up ] || printf '   %-9s %s\n' "$name" "UNREACHABLE: broker tests SKIPPED"
done
echo "   total time: $(( $(date +%s) - started ))s"
echo "========================================================================="
[ $nox_code = 0 ] || fail "nox (a session failed; see above)"
[ $summary_code = 0 ] || fail "a test pass failed (see the summary)"
