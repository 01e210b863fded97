#!/usr/bin/env bash
# The whole test command: quality gates, then pytest on SQLite, PostgreSQL and MariaDB.
#
#   scripts/test.sh [pytest args]       (make test)
#
# Environment:
#   REQUIRE_SERVICES=1  an unreachable PostgreSQL, MariaDB, Redis or RabbitMQ fails the run
#                       instead of being skipped (.ci/run sets it).
#   QUICK=1             skip the tests marked slow (races, crashes, real workers, browser).
#   BACKENDS="sqlite postgres mariadb"   the database passes to run (default: all three).
set -uo pipefail
cd "$(dirname "$0")/.."
REQUIRE_SERVICES="${REQUIRE_SERVICES:-0}"
export REQUIRE_SERVICES
BACKENDS="${BACKENDS:-sqlite postgres mariadb}"
started=$(date +%s)

fail() { echo; echo "!! FAILED: $*" >&2; exit 1; }
step() { echo; echo "== $*"; }

step "set-up"
scripts/bootstrap.sh dev,postgres,mysql || fail "set-up"
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
  mkdocs build --strict --quiet --site-dir "$(mktemp -d)" || fail "docs build"
fi

step "wheel holds the package, its migrations and templates, and no tests"
wheel_dir=$(mktemp -d)
python -m pip wheel -q --no-deps -w "$wheel_dir" . 2> >(grep -v "is ignored" >&2) || fail "pip wheel"
python scripts/check_wheel.py "$wheel_dir"/django_idempotency-*.whl || fail "wheel contents"

markexpr=()
[ "${QUICK:-0}" = 1 ] && markexpr=(-m "not slow")

# The browser test drives Debian's chromium (never a Playwright download); install it if we can.
if [ "${QUICK:-0}" != 1 ] && [ "$(id -u)" = 0 ] && [ ! -x /usr/bin/chromium ]; then
  step "chromium for the browser test"
  # On failure the browser test itself skips loudly, or fails under REQUIRE_SERVICES=1.
  scripts/install-chromium.sh || echo "!! chromium could not be installed: see the browser test"
fi

declare -A db_url=(
  [sqlite]=""
  [postgres]="postgres://postgres@127.0.0.1:5432/postgres"
  [mariadb]="mysql://root@127.0.0.1:3306/test"
)
declare -A result
cov_flag=()
rm -f .coverage .coverage.*
for backend in $BACKENDS; do
  if [ "$backend" != sqlite ] && [ "${state[$backend]}" != up ]; then
    result[$backend]="SKIPPED (unreachable)"
    continue
  fi
  step "pytest on $backend"
  t0=$(date +%s)
  DATABASE_URL="${db_url[$backend]}" TEST_DB_BACKEND="$backend" \
    python -m pytest -W error::DeprecationWarning --cov --cov-branch --cov-report= "${cov_flag[@]}" "${markexpr[@]}" "$@"
  code=$?
  cov_flag=(--cov-append)
  if [ $code -ne 0 ]; then
    result[$backend]="FAILED (pytest exit $code)"
    failed=1
  else
    result[$backend]="passed in $(( $(date +%s) - t0 ))s"
  fi
done

step "coverage (all backends combined)"
python -m coverage report | tail -n 15

echo
echo "================================ summary ================================"
for backend in $BACKENDS; do printf '   %-9s %s\n' "$backend" "${result[$backend]:-not run}"; done
for name in redis rabbitmq; do
  [ "${state[$name]}" = up ] || printf '   %-9s %s\n' "$name" "UNREACHABLE: broker tests SKIPPED"
done
echo "   total time: $(( $(date +%s) - started ))s"
echo "========================================================================="
[ "${failed:-0}" = 0 ] || fail "pytest"
